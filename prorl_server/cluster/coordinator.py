"""One server's part in a cluster: claim jobs, hold leases, take over the lost, apply admin.

Tasks, all owned here and stopped by `stop()`:

- claim: while this server holds fewer jobs than its slots
  (cluster.claim_slots, default phases.init + phases.run), claim queued ones
  (highest priority, then oldest) and run them on the local JobManager. Woken
  by NOTIFY prorl_queue and when one of its jobs ends; polls every
  cluster.poll_s besides. Not started with cluster.run_jobs = false (a front).
- heartbeat, every cluster.heartbeat_s: renew the leases of its jobs (their
  phase recorded), stop those it no longer holds, pass on cancels it missed,
  take over jobs whose lease lapsed anywhere, publish its load. While the
  store cannot be reached its jobs go on (their events wait in the
  EventWriter), health says NOT_SERVING, and a heartbeat before its leases
  can lapse (cluster.lease_ttl_s after the last renewal) it stops its jobs,
  which another server then takes over: a job never runs on two servers.
- admin: apply AdminService operations recorded by any server (admin.py).

At start a server first ends the leases it held before (it restarted after a
crash: those jobs are lost to it) and takes them over like any lost job; it
never resumes a job. At shutdown, jobs still running after the grace period
are handed back, whatever phase they were in (waiting for a slot, init, run,
eval): this server queues each again itself as its next attempt, at once, and
a peer claims it. A hand-back is not a loss: it uses none of the job's
retry.max_restarts (which count runs lost with their server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

import structlog

from prorl_server.cluster import membership
from prorl_server.cluster.admin import ClusterAdministration
from prorl_server.cluster.notifications import Notifications
from prorl_server.cluster.store import (
    ADMIN_CHANNEL,
    CANCEL_CHANNEL,
    QUEUE_CHANNEL,
    UNREACHABLE,
    Claimed,
    ClusterStore,
)
from prorl_server.config import Settings
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.record import JobRecord
from prorl_server.stats import ServerStats

log = structlog.get_logger(__name__)

RETENTION_EVERY_S = 60.0
"""How often a server deletes the jobs past jobs.retain_finished_s (any server may: it is idempotent)."""
CLAIM_STOP_S = 10.0
"""At shutdown, how long a claim under way may take to finish before it is cancelled."""
LEASE_LOST = (
    "this server lost its lease on the job (it could not reach the job store for cluster.lease_ttl_s); "
    "another server takes it over"
)


class ClusterCoordinator:
    def __init__(
        self,
        *,
        settings: Settings,
        store: ClusterStore,
        notifications: Notifications,
        manager: JobManager,
        admin: ClusterAdministration,
        stats: Callable[[], ServerStats],
        address: Callable[[], str],
        set_serving: Callable[[bool], Awaitable[None]],
    ) -> None:
        cluster = settings.cluster
        self._cluster = cluster
        self._slots = cluster.claim_slots or settings.phases.init + settings.phases.run
        self._store = store
        self._notifications = notifications
        self._manager = manager
        self._admin = admin
        self._stats = stats
        self._address = address
        self._set_serving = set_serving
        self._serving = True
        """The last heartbeat reached the store (it did at start)."""
        self._wake_claims = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._claiming: asyncio.Task[None] | None = None
        self._stop_claims = False
        self._renewed = time.monotonic()
        self._handed_back: set[str] = set()
        self._retain_s = settings.jobs.retain_finished_s
        self._next_retention = time.monotonic() + RETENTION_EVERY_S
        self.claimed = 0
        """Jobs claimed since the start."""

    @property
    def server_id(self) -> str:
        return self._store.server_id

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        lost = await self._store.expire_own()
        if lost:
            log.warning("jobs_of_a_previous_run_lost", count=lost)
        await self._store.take_over()
        await self._admin.catch_up()
        await self._publish()
        self._notifications.on(QUEUE_CHANNEL, lambda _payload: self._wake_claims.set())
        self._notifications.on(CANCEL_CHANNEL, self._cancel_notified)
        self._notifications.on(ADMIN_CHANNEL, self._admin.wake)
        self._tasks.append(asyncio.create_task(self._heartbeats(), name="cluster-heartbeat"))
        self._tasks.append(asyncio.create_task(self._admin.run(self._cluster.poll_s), name="cluster-admin"))
        if self._cluster.run_jobs:
            self._claiming = asyncio.create_task(self._claims(), name="cluster-claims")
            self._tasks.append(self._claiming)

    async def stop_claiming(self) -> None:
        """Claim no more. A claim under way is let finish (its jobs are then this server's and
        handed back like the others): cancelled mid-transaction, it could take jobs in the store
        that this server never runs, left to lapse as if it had died. Cancelled only if the
        store does not answer within CLAIM_STOP_S."""
        self._stop_claims = True
        self._wake_claims.set()
        if self._claiming is not None:
            done, _ = await asyncio.wait({self._claiming}, timeout=CLAIM_STOP_S)
            if not done:
                self._claiming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._claiming

    def hand_back(self, job: JobRecord) -> None:
        """The manager's shutdown stops this job: it is not ended here but given to a peer."""
        self._store.release(job.job_id)
        self._handed_back.add(job.job_id)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            if self._handed_back:
                queued = await self._store.hand_back(sorted(self._handed_back))
                log.info("jobs_handed_back", count=len(queued))
            await membership.leave(self._store)
        except UNREACHABLE as exc:  # their leases lapse by themselves
            log.warning("cluster_leave_failed", error=str(exc) or type(exc).__name__)

    # --- claims --------------------------------------------------------------------------

    async def _claims(self) -> None:
        while not self._stop_claims:
            free = self._slots - self._manager.live
            if free > 0 and self._manager.accepting and self._serving:  # no claim it could not renew
                try:
                    claimed = await self._store.claim(free, self._cluster.lease_ttl_s)
                except UNREACHABLE:
                    claimed = []
                except Exception:  # a bug, or a database refusing: log it, keep the loop alive
                    log.exception("cluster_claim_failed")
                    claimed = []
                for item in claimed:
                    previous = self._manager.local(item.job.job_id)
                    if previous is not None and previous.task is not None and not previous.task.done():
                        # This server's earlier run of the job (its lease lapsed and the job was
                        # queued again) is still ending: it must not write under the new claim.
                        self._store.release(item.job.job_id)
                        self._manager.request_cancel(item.job.job_id, LEASE_LOST)
                        self._tasks.append(asyncio.create_task(self._adopt_after(previous.task, item)))
                        continue
                    self._adopt(item)
                self.claimed += len(claimed)
                if claimed and len(claimed) == free:
                    continue  # there may be more
            self._wake_claims.clear()
            if self._stop_claims:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._cluster.poll_s):
                    await self._wake_claims.wait()

    def _adopt(self, item: Claimed) -> None:
        job = self._manager.adopt(item.job, item.cancel_reason)
        if job.task is not None:
            job.task.add_done_callback(lambda _task: self._wake_claims.set())

    async def _adopt_after(self, previous: asyncio.Task[None], item: Claimed) -> None:
        """Run a job claimed again once this server's earlier run of it has ended (unheld,
        its outcome not written); the claim is held again only then."""
        try:
            await asyncio.wait({previous})
        except asyncio.CancelledError:  # this server stops first: the claim goes back to the queue
            self._handed_back.add(item.job.job_id)
            raise
        self._store.hold(item.job.job_id, item.job.attempt)
        self._adopt(item)

    # --- heartbeat --------------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._cluster.heartbeat_s)
            try:
                await self._heartbeat()
            except Exception as exc:  # unreachable, or refusing (e.g. its database dropped)
                if not isinstance(exc, UNREACHABLE):
                    log.exception("cluster_heartbeat_failed")
                await self._serve(False, error=str(exc) or type(exc).__name__)
                # Stop a heartbeat before the leases can lapse, so that no job ever runs here
                # and on the server that takes it over at the same time.
                if time.monotonic() - self._renewed > self._cluster.lease_ttl_s - self._cluster.heartbeat_s:
                    self._stop_unheld(set(self._store.claimed_ids()))

    async def _heartbeat(self) -> None:
        asked = time.monotonic()  # the leases run from about now (the database's clock), not from the answer
        sent = self._store.claimed_ids()
        phases = {}
        for job_id in sent:
            job = self._manager.local(job_id)
            if job is not None:
                phases[job_id] = int(job.phase)
        leases = await self._store.renew(phases, self._cluster.lease_ttl_s)
        self._renewed = asked
        held = {lease.job_id for lease in leases}
        self._stop_unheld({job_id for job_id in sent if job_id not in held})
        for lease in leases:
            if lease.cancel_reason:
                self._manager.request_cancel(lease.job_id, lease.cancel_reason)
        await self._store.take_over()
        if time.monotonic() >= self._next_retention:
            self._next_retention = time.monotonic() + RETENTION_EVERY_S
            await self._store.forget_finished(self._retain_s)
        await self._publish(leases=len(leases))
        await self._serve(True)

    def _stop_unheld(self, job_ids: set[str]) -> None:
        """Jobs this server runs but no longer holds: stop them without writing anything."""
        for job_id in job_ids:
            if job_id not in self._store.claimed_ids():
                continue  # ended meanwhile
            self._store.release(job_id)
            if self._manager.request_cancel(job_id, LEASE_LOST):
                log.warning("job_lease_lost", job_id=job_id)

    async def _publish(self, leases: int | None = None) -> None:
        item = membership.summary(
            self.server_id,
            self._cluster.advertise_address or self._address(),
            self._cluster.run_jobs,
            self._stats(),
            len(self._store.claimed_ids()) if leases is None else leases,
        )
        await membership.publish(self._store, item, admin_applied=self._admin.applied)

    async def _serve(self, serving: bool, *, error: str = "") -> None:
        if serving == self._serving:
            return
        self._serving = serving
        if serving:
            log.info("job_store_reachable")
        else:
            log.error("job_store_unreachable", error=error, hint="running jobs go on; submissions are refused")
        await self._set_serving(serving)

    # --- cancels -------------------------------------------------------------------------------

    def _cancel_notified(self, payload: str) -> None:
        if not payload:
            return  # a reconnection: the next heartbeat reads any cancel it missed
        try:
            job_id, reason = json.loads(payload)
        except (ValueError, TypeError):
            return
        self._manager.request_cancel(str(job_id), str(reason))
