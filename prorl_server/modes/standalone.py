"""A server on its own: its jobs are the ones its JobManager holds.

The store (`jobs.store`) is a SQLite file of this server's (true; the file is
`jobs.store_path`, by default <sandbox.state_dir>/jobs/<server.instance_id>.sqlite)
or none (false: jobs live in memory only). A job's last write is tried once;
shutdown cancels what is still running after the grace period; backends are
changed on this server's router alone. No background tasks of its own.
"""

from __future__ import annotations

from pathlib import Path

from prorl_server.config import Settings
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.service import LocalJobs
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from prorl_server.llm.administration import LocalAdministration
from prorl_server.modes.base import JobParts, ServerHooks, ServerMode, Services


class StandaloneMode(ServerMode):
    runs_jobs = True

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.store = sqlite_store(settings)
        self._manager: JobManager | None = None

    async def open(self) -> None:
        if self.store is not None:
            await self.store.open()

    def services(self, parts: JobParts) -> Services:
        settings = self._settings
        self._manager = manager = parts.job_manager(settings, self.store)
        administration = LocalAdministration(
            parts.router, request_timeout_s=settings.llm.request_timeout_s, max_retries=settings.llm.max_retries
        )
        return Services(manager=manager, jobs=LocalJobs(manager), administration=administration, cluster_view=None)

    async def start(self, server: ServerHooks) -> None:
        """Nothing runs in the background of a server on its own."""

    async def shutdown(self, grace_s: float) -> None:
        if self._manager is not None:
            await self._manager.shutdown(grace_s)

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


def sqlite_store(settings: Settings) -> SQLiteJobStore | None:
    """The store `jobs.store` = true asks for (not opened); None for false."""
    if settings.jobs.store is False:
        return None
    path = settings.jobs.store_path or str(
        Path(settings.sandbox.state_dir) / "jobs" / f"{settings.server.instance_id}.sqlite"
    )
    return SQLiteJobStore(path)
