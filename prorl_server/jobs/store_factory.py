"""The job store the settings ask for (`jobs.store`, `jobs.store_path`)."""

from __future__ import annotations

from pathlib import Path

from prorl_server.config import ConfigError, Settings, mask_url
from prorl_server.jobs.store import JobStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(value: str) -> bool:
    return value.lower().startswith(POSTGRES_SCHEMES)


def build_store(settings: Settings) -> JobStore | None:
    """The store, not opened yet; None when `jobs.store` is false."""
    value = settings.jobs.store
    if value is False:
        return None
    if value is True:
        from prorl_server.jobs.sqlite_store import SQLiteJobStore

        path = settings.jobs.store_path or str(
            Path(settings.sandbox.state_dir) / "jobs" / f"{settings.server.instance_id}.sqlite"
        )
        return SQLiteJobStore(path)
    if isinstance(value, str) and is_postgres_url(value):
        from prorl_server.cluster.store import ClusterStore

        return ClusterStore(value, server_id=settings.server.instance_id)
    shown = mask_url(value) if isinstance(value, str) else repr(value)
    raise ConfigError(f"setting 'jobs.store': expected true, false or a postgresql:// URL, got {shown}")


async def open_store(settings: Settings) -> JobStore | None:
    """The store, opened (schema created or migrated); None when `jobs.store` is false.
    Raises JobStoreError naming the store (password masked) and why it cannot be used."""
    store = build_store(settings)
    if store is not None:
        await store.open()
    return store
