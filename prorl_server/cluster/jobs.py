"""RolloutService's jobs in a cluster: every job of the shared store, wherever it runs.

Submit writes the job to the store (any server may claim it, see
coordinator.py). A job this server holds is answered from its JobManager; any
other from the store: GetJob and ListJobs read the rows, Watch reads the events
by seq and follows them as NOTIFY prorl_events says they changed (with a slow
poll besides), so that Watch on any server gives the same sequence. Cancel of a
job held elsewhere is written to the store and reaches its holder.

While the store cannot be reached, Submit (and Cancel, GetJob, ListJobs of jobs
held elsewhere) answer UNAVAILABLE saying so; a Watch of a job held elsewhere
waits for the store up to cluster.lease_ttl_s, then ends UNAVAILABLE (resume it
with after_seq).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import TypeVar

from prorl_client import v1
from prorl_server.agents.registry import HandlerRegistry
from prorl_server.cluster.notifications import Notifications
from prorl_server.cluster.store import UNREACHABLE, ClusterStore
from prorl_server.config import Settings
from prorl_server.errors import FailedPrecondition, InvalidArgument, Unavailable
from prorl_server.jobs.manager import CANCEL_WAIT_S, JobManager
from prorl_server.jobs.record import JobView
from prorl_server.jobs.submission import Submission
from prorl_server.jobs.validation import check_cancel_reason, check_page, resolve_plan, unknown_job

T = TypeVar("T")


class ClusterJobs:
    def __init__(
        self,
        *,
        settings: Settings,
        registry: HandlerRegistry,
        manager: JobManager,
        store: ClusterStore,
        notifications: Notifications,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._manager = manager
        self._store = store
        self._notifications = notifications
        self._poll_s = settings.cluster.poll_s

    async def submit(self, request: v1.RolloutRequest) -> tuple[JobView, bool]:
        self._manager.check_accepting()
        submission = Submission.of(request)
        request = submission.request
        resolve_plan(request, self._settings, self._registry)  # refused here, not on the server that claims it
        row, created = await self._reach(
            "accept the job",
            self._store.insert(request, submission.fingerprint, time.time(), self._settings.jobs.max_queued),
        )
        if not created:
            submission.check_same(row.fingerprint)
        return row, created

    async def get(self, job_id: str) -> JobView:
        local = self._manager.local(job_id)
        if local is not None and not local.finished:
            return local
        row = await self._reach("read the job", self._store.job(job_id))
        if row is None:
            if local is not None:
                return local
            raise unknown_job(job_id)
        return row

    async def list(
        self,
        *,
        statuses: Sequence[int] = (),
        labels: Mapping[str, str] | None = None,
        group_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[JobView], str]:
        size, after = check_page(page_size, page_token)
        rows = await self._reach(
            "list the jobs",
            self._store.jobs(
                after=after, statuses=statuses, group_id=group_id, labels=dict(labels or {}), limit=size + 1
            ),
        )
        page: list[JobView] = []
        for row in rows[:size]:
            local = self._manager.local(row.job_id)
            page.append(local if local is not None and not local.finished else row)
        return page, str(rows[size - 1].number) if len(rows) > size else ""

    async def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[v1.RolloutEvent]:
        if after_seq < 0:
            raise InvalidArgument(f"after_seq must not be negative, got {after_seq}")
        local = self._manager.local(job_id)
        if local is not None and not local.finished:
            # Only what is in the store: the same events any server shows, even if this one dies now.
            async for event in local.events.follow(after_seq, durable_only=True):
                yield event
                after_seq = event.seq
            if not local.events.durability_lost:
                return
        elif await self._reach("read the job", self._store.job(job_id)) is None:
            raise unknown_job(job_id)
        async for event in self._follow_stored(job_id, after_seq):
            yield event

    async def _follow_stored(self, job_id: str, after_seq: int) -> AsyncIterator[v1.RolloutEvent]:
        """The job's stored events after `after_seq`, as they are written, to its `finished`."""
        last = after_seq
        down_since: float | None = None
        with self._notifications.waiter(job_id) as changed:
            while True:
                changed.clear()
                try:
                    events = await self._store.events_after(job_id, last)
                except UNREACHABLE as exc:
                    down_since = down_since or time.monotonic()
                    if time.monotonic() - down_since > self._settings.cluster.lease_ttl_s:
                        raise Unavailable(
                            f"the job store cannot be reached ({type(exc).__name__}) to follow job {job_id!r}; "
                            f"watch again with after_seq={last}"
                        ) from None
                    await asyncio.sleep(self._poll_s)
                    continue
                down_since = None
                for event in events:
                    yield event
                    last = event.seq
                    if event.HasField("finished"):
                        return
                if not events:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._poll_s):
                            await changed.wait()

    async def fork(self, request: v1.ForkJobRequest) -> Sequence[tuple[JobView, bool]]:
        """Not in a cluster: a branch starts from state one server keeps in its memory and
        files, and the cluster's queue would let any server claim it."""
        raise FailedPrecondition(
            "ForkJob is not available on a cluster (cluster.enabled): the state a branch starts from "
            "is kept by one server; run forkable jobs on a single server"
        )

    async def cancel(self, job_id: str, reason: str = "") -> JobView:
        check_cancel_reason(reason)
        reason = reason or "cancelled by the client"
        local = self._manager.local(job_id)
        if local is not None and not local.finished:
            return await self._manager.cancel(job_id, reason)
        row = await self._reach("cancel the job", self._store.cancel(job_id, reason))
        if row is None:
            raise unknown_job(job_id)
        if row.finished:
            return row
        # Its holder ends it (notified now, or at its next heartbeat at the latest).
        with contextlib.suppress(TimeoutError, Unavailable):
            async with asyncio.timeout(CANCEL_WAIT_S):
                async for _ in self._follow_stored(job_id, row.last_seq):
                    pass
        return await self.get(job_id)

    async def _reach(self, what: str, call: Awaitable[T]) -> T:
        """The store's answer; UNAVAILABLE naming the store if it cannot be reached."""
        try:
            return await call
        except UNREACHABLE as exc:
            raise Unavailable(
                f"the cluster's job store cannot be reached to {what} ({type(exc).__name__}: {exc}); "
                "nothing was changed: retry later (a Submit with the same job_id is safe to repeat)"
            ) from None
