"""What RolloutService asks of the jobs: one interface, two implementations.

`LocalJobs` answers from this server's JobManager (one server, with or without
a SQLite store). `ClusterJobs` (prorl_server/cluster/jobs.py) answers for every
job of a cluster that shares a PostgreSQL store, wherever it runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from prorl_client import v1
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.record import JobView


class JobService(Protocol):
    async def submit(self, request: v1.RolloutRequest) -> tuple[JobView, bool]:
        """Queue a job; returns (job, created). Idempotent on job_id."""
        ...

    async def get(self, job_id: str) -> JobView: ...

    async def list(
        self,
        *,
        statuses: Sequence[int] = (),
        labels: Mapping[str, str] | None = None,
        group_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[JobView], str]: ...

    def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[v1.RolloutEvent]:
        """The job's events with seq > after_seq, then new ones until it ends."""
        ...

    async def cancel(self, job_id: str, reason: str = "") -> JobView:
        """Cancel a job and wait (within a limit) until it has ended."""
        ...

    async def fork(self, request: v1.ForkJobRequest) -> Sequence[tuple[JobView, bool]]:
        """Branch a job after one of its turns (ForkJob); (job, created) per branch."""
        ...


class LocalJobs:
    """The jobs of this one server."""

    def __init__(self, manager: JobManager) -> None:
        self._manager = manager

    async def submit(self, request: v1.RolloutRequest) -> tuple[JobView, bool]:
        return self._manager.submit(request)

    async def get(self, job_id: str) -> JobView:
        return self._manager.get(job_id)

    async def list(
        self,
        *,
        statuses: Sequence[int] = (),
        labels: Mapping[str, str] | None = None,
        group_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[JobView], str]:
        jobs, token = self._manager.list(
            statuses=statuses, labels=labels, group_id=group_id, page_size=page_size, page_token=page_token
        )
        return list(jobs), token

    def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[v1.RolloutEvent]:
        return self._manager.watch(job_id, after_seq)

    async def cancel(self, job_id: str, reason: str = "") -> JobView:
        return await self._manager.cancel(job_id, reason)

    async def fork(self, request: v1.ForkJobRequest) -> Sequence[tuple[JobView, bool]]:
        return self._manager.fork(request)
