"""The server's mode: what a server on its own and a server of a cluster do differently.

A server runs standalone (`jobs.store` true or false: a SQLite file, or no
store) or as one of a cluster's servers (`jobs.store` a postgresql:// URL: the
store every server of the cluster shares). app.py wires both the same way and
asks its mode for the five things in which they differ:

- the job store (built with the mode, opened first at start, closed last);
- the job manager, built on that store with the mode's options (how long a
  job's last write is retried, what shutdown does with a job still running,
  how soon events are written);
- the jobs RolloutService answers from, the administration AdminService
  changes backends through, and the cluster GetStats shows;
- the background tasks that run while the server serves (a cluster's
  coordinator: claims, leases, takeovers, admin operations), started last;
- the shutdown of the jobs: take no more, let the running ones finish within
  the grace period, then cancel them (standalone) or hand them to a peer
  (cluster).

One module per mode beside this one (standalone.py, cluster.py); factory.py
picks the one the settings ask for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prorl_server.agents.registry import HandlerRegistry
from prorl_server.api.admin_servicer import ClusterView
from prorl_server.config import Settings
from prorl_server.jobs.event_writer import FLUSH_INTERVAL_S
from prorl_server.jobs.forks import ForkRegistry
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.service import JobService
from prorl_server.jobs.store import JobStore
from prorl_server.llm.administration import Administration
from prorl_server.llm.router import BackendRouter
from prorl_server.metrics import Metrics
from prorl_server.stats import ServerStats


@dataclass(frozen=True)
class JobParts:
    """What the server builds for its jobs, whatever its mode."""

    registry: HandlerRegistry
    pipeline: Pipeline
    metrics: Metrics
    router: BackendRouter
    """The policy's backends, which the administration changes."""
    forks: ForkRegistry
    on_stored: Callable[[], None]
    """Called after each write that added events to the store (the event feed's nudge)."""

    def job_manager(
        self,
        settings: Settings,
        store: JobStore | None,
        *,
        persist_retry_s: float = 0.0,
        handover: Callable[[JobRecord], None] | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> JobManager:
        """The job manager on these parts, with a mode's store and options (see JobManager)."""
        return JobManager(
            settings=settings,
            registry=self.registry,
            pipeline=self.pipeline,
            metrics=self.metrics,
            store=store,
            persist_retry_s=persist_retry_s,
            handover=handover,
            flush_interval_s=flush_interval_s,
            on_stored=self.on_stored,
            forks=self.forks,
        )


@dataclass(frozen=True)
class Services:
    """What the gRPC services answer from."""

    manager: JobManager
    """The jobs this server runs."""
    jobs: JobService
    """RolloutService's jobs: this server's, or every job of the cluster."""
    administration: Administration
    cluster_view: ClusterView | None
    """Every server of the cluster and its jobs by status (GetStats); None on a server on its own."""


@dataclass(frozen=True)
class ServerHooks:
    """What a mode's background tasks see of the server that runs them."""

    stats: Callable[[], ServerStats]
    address: Callable[[], str]
    """Where clients reach this server (host:port, once the gRPC server is bound)."""
    set_serving: Callable[[bool], Awaitable[None]]
    """Health of every service: SERVING or NOT_SERVING."""


class ServerMode(ABC):
    store: JobStore | None
    """The job store, built with the mode (not opened); None: jobs are kept in memory only."""
    runs_jobs: bool
    """Whether this server runs jobs, and so needs sandboxes (a cluster's front does not)."""

    @abstractmethod
    async def open(self) -> None:
        """First at start: the store opened (schema created or migrated). Raises JobStoreError
        naming the store (password masked) and why it cannot be used."""

    @abstractmethod
    def services(self, parts: JobParts) -> Services:
        """The job manager and what the gRPC services answer from (called once, before the
        manager restores the stored jobs)."""

    @abstractmethod
    async def start(self, server: ServerHooks) -> None:
        """Last at start, once the gRPC server serves: the mode's background tasks."""

    @abstractmethod
    async def shutdown(self, grace_s: float) -> None:
        """First at stop (health already NOT_SERVING): take no more jobs, give those running
        `grace_s` to finish, stop the rest and the background tasks. Safe after a start
        that failed at any point."""

    @abstractmethod
    async def close(self) -> None:
        """Last of the mode at stop: the store closed. Safe when it was never opened."""
