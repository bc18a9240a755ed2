"""The mode the settings ask for: `jobs.store` a postgresql:// URL makes a cluster's server."""

from __future__ import annotations

from prorl_server.config import ConfigError, Settings, mask_url
from prorl_server.jobs.store import JobStore
from prorl_server.modes.base import ServerMode
from prorl_server.modes.cluster import ClusterMode
from prorl_server.modes.standalone import StandaloneMode

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(value: str) -> bool:
    return value.lower().startswith(POSTGRES_SCHEMES)


def build_mode(settings: Settings) -> ServerMode:
    """The mode, its store built but not opened (nothing is started here)."""
    value = settings.jobs.store
    if isinstance(value, bool):
        return StandaloneMode(settings)
    if isinstance(value, str) and is_postgres_url(value):
        return ClusterMode(settings, value)
    shown = mask_url(value) if isinstance(value, str) else repr(value)
    raise ConfigError(f"setting 'jobs.store': expected true, false or a postgresql:// URL, got {shown}")


def build_store(settings: Settings) -> JobStore | None:
    """The store the settings ask for (`jobs.store`, `jobs.store_path`), not opened; None when
    `jobs.store` is false."""
    return build_mode(settings).store


async def open_store(settings: Settings) -> JobStore | None:
    """The store, opened (schema created or migrated); None when `jobs.store` is false.
    Raises JobStoreError naming the store (password masked) and why it cannot be used."""
    store = build_store(settings)
    if store is not None:
        await store.open()
    return store
