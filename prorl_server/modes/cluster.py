"""A server of a cluster: servers that share one PostgreSQL job store are peers of one service.

Any server accepts a job into the shared store and answers for every job of
it (cluster/jobs.py); the coordinator (cluster/coordinator.py) claims queued
jobs and runs them on this server's JobManager, renews their leases, takes over
the jobs of servers that are gone and applies the admin operations any server
recorded (cluster/admin.py). A job's last write is retried for a lease's
length; its events are written sooner (the cluster's watchers see an event
once it is stored); shutdown hands a job still running after the grace period
back to the queue, for a peer. With `cluster.run_jobs` false the server is a
front: it claims nothing and needs no sandboxes.
"""

from __future__ import annotations

from prorl_client import v1
from prorl_server.cluster import membership
from prorl_server.cluster.admin import ClusterAdministration
from prorl_server.cluster.coordinator import ClusterCoordinator
from prorl_server.cluster.jobs import ClusterJobs
from prorl_server.cluster.notifications import Notifications
from prorl_server.cluster.store import ClusterStore
from prorl_server.config import Settings
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.store import JobStoreError
from prorl_server.modes.base import JobParts, ServerHooks, ServerMode, Services

FLUSH_INTERVAL_S = 0.05
"""The longest a running job's event waits before it is written to the store."""


class ClusterMode(ServerMode):
    def __init__(self, settings: Settings, url: str) -> None:
        self._settings = settings
        self._store = ClusterStore(url, server_id=settings.server.instance_id)
        self.store = self._store
        self.runs_jobs = settings.cluster.run_jobs
        self._notifications = Notifications(url)
        self._manager: JobManager | None = None
        self._admin: ClusterAdministration | None = None
        self.coordinator: ClusterCoordinator | None = None
        """This server's part in the cluster, from the start of the background tasks on."""

    async def open(self) -> None:
        await self._store.open()
        try:
            await self._notifications.start()
        except Exception as exc:
            raise JobStoreError(f"job store {self._store!r}: cannot listen for notifications: {exc}") from None

    def services(self, parts: JobParts) -> Services:
        settings = self._settings
        cluster = settings.cluster
        self._manager = manager = parts.job_manager(
            settings,
            self._store,
            persist_retry_s=cluster.lease_ttl_s,
            handover=self._hand_back,
            flush_interval_s=FLUSH_INTERVAL_S,
        )
        self._admin = admin = ClusterAdministration(
            self._store,
            parts.router,
            request_timeout_s=settings.llm.request_timeout_s,
            max_retries=settings.llm.max_retries,
            live_within_s=cluster.lease_ttl_s,
        )
        jobs = ClusterJobs(
            settings=settings,
            registry=parts.registry,
            manager=manager,
            store=self._store,
            notifications=self._notifications,
        )
        return Services(manager=manager, jobs=jobs, administration=admin, cluster_view=self._cluster_view)

    async def start(self, server: ServerHooks) -> None:
        assert self._manager is not None and self._admin is not None, "services() comes first"
        self.coordinator = ClusterCoordinator(
            settings=self._settings,
            store=self._store,
            notifications=self._notifications,
            manager=self._manager,
            admin=self._admin,
            stats=server.stats,
            address=server.address,
            set_serving=server.set_serving,
        )
        await self.coordinator.start()

    async def shutdown(self, grace_s: float) -> None:
        """Claim no more, let the jobs finish within `grace_s`, hand the rest back, leave."""
        if self.coordinator is not None:
            await self.coordinator.stop_claiming()
        if self._manager is not None:
            await self._manager.shutdown(grace_s)
        if self.coordinator is not None:
            await self.coordinator.stop()

    async def close(self) -> None:
        await self._notifications.close()
        await self._store.close()

    def _hand_back(self, job: JobRecord) -> None:
        if self.coordinator is not None:
            self.coordinator.hand_back(job)

    async def _cluster_view(self) -> tuple[list[v1.ServerSummary], dict[int, int]]:
        servers = await membership.servers(self._store, self._settings.cluster.lease_ttl_s)
        return servers, await self._store.count_by_status()
