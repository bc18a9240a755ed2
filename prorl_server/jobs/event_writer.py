"""Running jobs' events to the store as they happen, in batches (JobStore.appended).

The job manager owns one EventWriter (when it has a store). A job's EventLog is
`track`ed once the job is submitted to the store: its events so far, and every
later one through the log's listener hook, join one queue of pending events, in
the order they happened. One background task writes that queue in batches, one
`appended` call per job of the batch:

- a batch goes when FLUSH_EVENTS events are pending, or FLUSH_INTERVAL_S after
  the first of them, whichever comes first; nothing runs while nothing is
  pending. Appending an event only queues it: a job never waits for the store.
- a store error is logged (once per outage, then every LOG_EVERY_FAILURES
  failed batches) and the batch goes back to the head of the queue, to be tried
  again FLUSH_INTERVAL_S later: no event is lost while the store is down...
- ...within MAX_PENDING events: beyond it the oldest pending events are dropped,
  logged as an error and counted (`dropped`). A job's `finished` write still
  carries its whole log; a job interrupted before then is restored with the
  events before the first missing one (see JobManager.restore).
- `finish(job_id)` when the job ends, before the manager writes `finished`: the
  job's log is no longer followed, its pending events are forgotten (the
  `finished` write carries the whole log) and an `appended` call of the job in
  flight is awaited. So no `appended` of a job reaches the store after its
  `finished`, and the job ends without waiting for a batch.
- `close()` (the manager's shutdown) writes what is pending, once, and awaits
  the task. Cancelled, the task stops following the logs and re-raises.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Sequence

import structlog

from prorl_client import v1
from prorl_server.jobs.event_log import EventLog, Listener
from prorl_server.jobs.store import JobStore

log = structlog.get_logger(__name__)

FLUSH_EVENTS = 64
"""A batch goes as soon as this many events are pending."""
FLUSH_INTERVAL_S = 0.2
"""...or this long after the first of them was queued; also the pause after a failed batch."""
MAX_PENDING = 10_000
"""Pending events kept while the store fails; beyond it the oldest are dropped."""
LOG_EVERY_FAILURES = 50
"""During a store outage, a failed batch is logged once, then every this many."""


class EventWriter:
    def __init__(
        self,
        store: JobStore,
        *,
        flush_events: int = FLUSH_EVENTS,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_pending: int = MAX_PENDING,
        on_written: Callable[[], None] | None = None,
    ) -> None:
        """`on_written`: called after each flush that stored events (the event feed reads
        the store's head at once rather than at its next poll)."""
        self._store = store
        self._on_written = on_written
        self._flush_events = max(flush_events, 1)
        self._flush_interval_s = flush_interval_s
        self._max_pending = max(max_pending, 1)
        self._pending: collections.deque[v1.RolloutEvent] = collections.deque()
        self._followed: dict[str, tuple[EventLog, Listener]] = {}
        self._writing: set[str] = set()
        """Jobs whose `appended` call is in flight."""
        self._written = asyncio.Event()
        """Set (and replaced) each time an `appended` call ends."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._failures = 0
        self._unlogged_drops = 0
        self.dropped = 0
        """Events dropped from the queue (beyond MAX_PENDING) since the start."""
        self.batches = 0
        """`appended` calls that succeeded."""

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- the manager's side ------------------------------------------------------

    def track(self, events: EventLog, *, after_seq: int = 0) -> None:
        """Send the events of `events` (those so far after `after_seq`, which the store
        has, then every new one) to the store until `finish(events.job_id)`. Starts the
        writer's task on first use."""
        if self._closing:
            return  # shutting down: the job's `finished` write carries its log
        self.finish_nowait(events.job_id)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="job-event-writer")
        for event in events.events()[after_seq:]:
            self._queue(event)
        listener = self._queue
        events.add_listener(listener)
        self._followed[events.job_id] = (events, listener)

    def finish_nowait(self, job_id: str) -> None:
        """Stop following the job's log and forget its pending events."""
        followed = self._followed.pop(job_id, None)
        if followed is not None:
            followed[0].remove_listener(followed[1])
        if any(event.job_id == job_id for event in self._pending):
            self._pending = collections.deque(event for event in self._pending if event.job_id != job_id)

    async def finish(self, job_id: str) -> None:
        """The job ended: after this returns, no `appended` of it reaches the store
        (the manager writes `finished` next, with the whole log)."""
        self.finish_nowait(job_id)
        while job_id in self._writing:
            await self._written.wait()

    async def close(self) -> None:
        """Write what is pending (one attempt) and stop the task."""
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        try:
            if task is not None and not task.done():
                await task
        finally:
            self._unfollow_all()

    # --- the task -------------------------------------------------------------------

    def _queue(self, event: v1.RolloutEvent) -> None:
        self._pending.append(event)
        self._trim()
        if len(self._pending) == 1 or len(self._pending) >= self._flush_events:
            self._wake.set()

    def _trim(self) -> None:
        excess = len(self._pending) - self._max_pending
        for _ in range(excess):
            self._pending.popleft()
        if excess > 0:
            self.dropped += excess
            self._unlogged_drops += excess

    async def _run(self) -> None:
        try:
            while True:
                if not self._pending:
                    if self._closing:
                        return
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                if not self._closing and len(self._pending) < self._flush_events:
                    # Woken early by FLUSH_EVENTS events, or by close(). (asyncio.timeout, not
                    # wait_for: on 3.11 wait_for can swallow a cancellation.)
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._flush_interval_s):
                            await self._wake.wait()
                    self._wake.clear()
                ok = await self._flush()
                self._log_drops()
                if self._closing:
                    if self._pending:
                        log.error("job_events_not_written", pending=len(self._pending), reason="shutdown")
                        self._pending.clear()
                    return
                if not ok:
                    await asyncio.sleep(self._flush_interval_s)
        except asyncio.CancelledError:
            self._unfollow_all()
            if self._pending:
                log.warning("job_events_not_written", pending=len(self._pending), reason="cancelled")
            raise
        finally:
            self._writing.clear()
            self._signal_written()

    async def _flush(self) -> bool:
        """Write every pending event, one `appended` call per job; False if one failed
        (its events are queued again, ahead of the newer ones)."""
        batch, self._pending = self._pending, collections.deque()
        by_job: dict[str, list[v1.RolloutEvent]] = {}
        for event in batch:
            by_job.setdefault(event.job_id, []).append(event)
        self._writing = set(by_job)
        retry: list[v1.RolloutEvent] = []
        stored = False
        for job_id, events in by_job.items():
            if job_id not in self._followed:  # finished meanwhile: its `finished` write has them
                self._done_writing(job_id)
                continue
            try:
                await self._store.appended(job_id, events)
                followed = self._followed.get(job_id)
                if followed is not None:
                    followed[0].mark_durable(events[-1].seq)
            except Exception as exc:  # any store failure: keep the events, try again
                if job_id in self._followed:
                    retry.extend(events)
                self._failed(exc, job_id, events)
            else:
                self.batches += 1
                stored = True
            finally:
                self._done_writing(job_id)
        if stored and self._on_written is not None:
            self._on_written()
        if retry:
            self._pending.extendleft(reversed(retry))
            self._trim()
            return False
        if self._failures:
            log.info("job_events_store_recovered", failed_batches=self._failures)
            self._failures = 0
        return True

    def _failed(self, exc: Exception, job_id: str, events: Sequence[v1.RolloutEvent]) -> None:
        if self._failures % LOG_EVERY_FAILURES == 0:
            log.error(
                "job_events_write_failed",
                job_id=job_id,
                events=len(events),
                failed_batches=self._failures + 1,
                pending=len(self._pending),
                error=str(exc) or type(exc).__name__,
            )
        self._failures += 1

    def _log_drops(self) -> None:
        if self._unlogged_drops:
            log.error(
                "job_events_dropped",
                count=self._unlogged_drops,
                dropped_total=self.dropped,
                max_pending=self._max_pending,
            )
            self._unlogged_drops = 0

    def _done_writing(self, job_id: str) -> None:
        self._writing.discard(job_id)
        self._signal_written()

    def _signal_written(self) -> None:
        self._written.set()
        self._written = asyncio.Event()

    def _unfollow_all(self) -> None:
        for events, listener in self._followed.values():
            events.remove_listener(listener)
        self._followed.clear()
