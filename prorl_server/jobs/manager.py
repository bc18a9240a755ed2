"""The job manager: admission, idempotency, cancel, watch, listing, retention.

Every job runs as one asyncio task owned here; shutdown awaits them all.
With a store, a job's events reach it as they happen through the manager's
EventWriter (event_writer.py), whose task shutdown awaits too.

In a cluster (prorl_server/cluster/) jobs are submitted to the shared store
by any server and reach this manager by `adopt` when this server claims them;
the cluster's job service answers the queries for jobs held elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import structlog
from tenacity import AsyncRetrying, retry_if_not_exception_type, stop_after_delay, wait_exponential

from prorl_client import v1
from prorl_server.agents.registry import HandlerRegistry
from prorl_server.config import Settings
from prorl_server.errors import (
    FailedPrecondition,
    InvalidArgument,
    ProrlError,
    ResourceExhausted,
    Unavailable,
)
from prorl_server.jobs.event_log import EventLog
from prorl_server.jobs.event_writer import FLUSH_INTERVAL_S, EventWriter
from prorl_server.jobs.forks import ForkRegistry, ForkStart
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.store import JobNotHeld, JobStore, StoredJob
from prorl_server.jobs.submission import Submission
from prorl_server.jobs.uninterruptible import uninterruptible
from prorl_server.jobs.validation import check_cancel_reason, check_page, resolve_plan, unknown_job
from prorl_server.metrics import Metrics

log = structlog.get_logger(__name__)

CANCEL_WAIT_S = 60.0
MAX_BRANCHES = 64


class JobManager:
    def __init__(
        self,
        *,
        settings: Settings,
        registry: HandlerRegistry,
        pipeline: Pipeline,
        metrics: Metrics | None = None,
        store: JobStore | None = None,
        persist_retry_s: float = 0.0,
        handover: Callable[[JobRecord], None] | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        on_stored: Callable[[], None] | None = None,
        forks: ForkRegistry | None = None,
    ) -> None:
        """`persist_retry_s`: how long a job's final write is retried while the store
        fails (0: tried once). `handover`: called for each job still running when
        shutdown cancels it (a cluster gives it to a peer instead). `flush_interval_s`:
        the longest a running job's event waits before it is written to the store.
        `on_stored`: called after each write that added events to the store (the event
        feed's nudge)."""
        self._on_stored = on_stored
        self._forks = forks
        self._settings = settings
        self._persist_retry_s = persist_retry_s
        self._handover = handover
        self._registry = registry
        self._metrics = metrics
        self._store = store
        self._writer = (
            EventWriter(store, flush_interval_s=flush_interval_s, on_written=on_stored) if store is not None else None
        )
        self._pipeline = pipeline
        self._jobs: dict[str, JobRecord] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._numbers = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = True

    # --- submission ------------------------------------------------------------

    def submit(self, request: v1.RolloutRequest, *, fork: ForkStart | None = None) -> tuple[JobRecord, bool]:
        """Queue a job; returns (job, created). Idempotent on job_id. `fork`: the job is a
        branch (ForkJob), which starts from that point of its parent."""
        self.check_accepting()
        submission = Submission.of(request, extra=fork.fingerprint() if fork is not None else b"")
        existing = self._jobs.get(submission.job_id)
        if existing is not None:
            submission.check_same(existing.fingerprint)
            return existing, False
        request, job_id, fingerprint = submission.request, submission.job_id, submission.fingerprint
        plan = resolve_plan(request, self._settings, self._registry)
        live = len(self._jobs) - len(self._finished)
        if live >= self._settings.jobs.max_queued:
            raise ResourceExhausted(
                f"{live} jobs are queued or running, the server's limit (jobs.max_queued); retry later"
            )
        job = JobRecord(
            job_id=job_id,
            number=next(self._numbers),
            request=request,
            fingerprint=fingerprint,
            plan=plan,
            create_time=time.time(),
            events=EventLog(job_id),
            fork=fork,
        )
        return self._admit(job), True

    def fork(self, request: v1.ForkJobRequest) -> list[tuple[JobRecord, bool]]:
        """Branch a job after one of its turns into one new job per branch (ForkJob)."""
        self.check_accepting()
        if not 1 <= len(request.branches) <= MAX_BRANCHES:
            raise InvalidArgument(f"branches must hold 1 to {MAX_BRANCHES} branches, got {len(request.branches)}")
        ids = [branch.job_id for branch in request.branches if branch.job_id]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("branches name the same job_id more than once; give each branch its own")
        parent = self.get(request.job_id)
        if parent.plan is None or not parent.plan.handler.forkable:
            handler = parent.request.handler
            raise FailedPrecondition(
                f"job {request.job_id!r} cannot be branched: its family {handler!r} has no turn boundaries"
                if parent.plan is not None
                else f"job {request.job_id!r} was restored from the store: the state it kept for forks is gone"
            )
        if self._forks is None:
            raise FailedPrecondition("this server keeps no state for forks")
        source, boundary = self._forks.start(request.job_id, request.after_turn, forkable=parent.request.forkable)
        root = parent.fork.root_job_id if parent.fork is not None else parent.job_id
        starts: list[tuple[v1.RolloutRequest, ForkStart]] = []
        for branch in request.branches:
            child = v1.RolloutRequest()
            child.CopyFrom(parent.request)
            child.job_id = branch.job_id
            child.forkable = True
            child.priority = branch.priority
            if branch.group_id:
                child.group_id = branch.group_id
            if branch.labels:
                child.labels.clear()
                child.labels.update(branch.labels)
            if branch.HasField("sampling"):
                child.sampling.CopyFrom(branch.sampling)
            start = ForkStart(parent.job_id, root, boundary, source, branch.train_prefix)
            self._check_branch(child, start)
            starts.append((child, start))
        branches = [self.submit(child, fork=start) for child, start in starts]
        for (job, created), (_, start) in zip(branches, starts, strict=True):
            if created:
                self._forks.reserve(job.job_id, start)
        return branches

    def _check_branch(self, child: v1.RolloutRequest, start: ForkStart) -> None:
        """Refuse a branch before any of its ForkJob's branches is started."""
        if not child.job_id:
            resolve_plan(child, self._settings, self._registry)
            return
        submission = Submission.of(child, extra=start.fingerprint())
        existing = self._jobs.get(child.job_id)
        if existing is not None:
            submission.check_same(existing.fingerprint, hint="choose a new job id for the branch")
        resolve_plan(child, self._settings, self._registry)

    def check_accepting(self) -> None:
        if not self._accepting:
            raise Unavailable("the server is shutting down and accepts no new jobs; retry on another server")

    def adopt(self, item: StoredJob, cancel_reason: str | None = None) -> JobRecord:
        """Run a job queued elsewhere (a cluster's store) that this server now holds: its
        log goes on after the events stored so far (its `queued` event among them)."""
        events = EventLog.restored(item.job_id, item.events, closed=False)
        events.mark_durable(len(item.events))
        try:
            plan = resolve_plan(item.request, self._settings, self._registry)
        except ProrlError as exc:  # e.g. a handler or image this server does not have
            job = _stored_record(item, plan=None, events=events, attempt=item.attempt)
            self._jobs[job.job_id] = job
            self._end_unrunnable(job, exc.message)
            return job
        job = _stored_record(item, plan=plan, events=events, attempt=item.attempt, cancel_reason=cancel_reason)
        return self._start(job, stored=len(item.events))

    def _end_unrunnable(self, job: JobRecord, why: str) -> None:
        job.result = v1.RolloutResult(
            job_id=job.job_id,
            status=v1.JOB_STATUS_FAILED,
            failure=v1.Failure(
                kind=v1.FAILURE_KIND_INFRASTRUCTURE, reason="not_runnable", message=f"this server cannot run it: {why}"
            ),
        )
        job.status = v1.JOB_STATUS_FAILED
        job.end_time = time.time()
        job.events.append(finished=v1.JobFinished(result=job.result))
        job.events.close()
        task = asyncio.create_task(uninterruptible(self._conclude(job)), name=f"job-{job.job_id}")
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def accepting(self) -> bool:
        """False once shutdown has begun."""
        return self._accepting

    @property
    def live(self) -> int:
        """Jobs queued or running on this server."""
        return len(self._jobs) - len(self._finished)

    def _admit(self, job: JobRecord) -> JobRecord:
        """Queue a job whose plan is resolved: from here on it runs to an outcome."""
        job.events.append(queued=v1.JobQueued(queue_position=self._pipeline.waiting, attempt=job.attempt))
        if job.fork is not None:
            job.events.append(forked=job.fork.forked_event())
        return self._start(job)

    def _start(self, job: JobRecord, *, stored: int = 0) -> JobRecord:
        """Run the job's task. `stored`: its first events already in the store."""
        self._jobs[job.job_id] = job
        job.stored_events = stored
        if self._metrics is not None:
            self._metrics.jobs_submitted.labels(job.request.handler).inc()
        task = asyncio.create_task(self._run(job), name=f"job-{job.job_id}")
        job.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: JobRecord) -> None:
        job.started = True
        structlog.contextvars.bind_contextvars(job_id=job.job_id, handler=job.request.handler)
        try:
            if self._store is not None:
                try:
                    await uninterruptible(
                        self._store.submitted(
                            job.job_id, job.number, job.request, job.fingerprint, job.create_time, job.attempt
                        )
                    )
                except asyncio.CancelledError:
                    # Cancelled this early: the pipeline sees cancel_reason and ends the job as cancelled.
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                if self._writer is not None:  # the job's row exists: its events can follow
                    self._writer.track(job.events, after_seq=job.stored_events)
            await self._pipeline.execute(job)
        finally:
            await uninterruptible(self._conclude(job))

    async def _conclude(self, job: JobRecord) -> None:
        if self._writer is not None:  # no append of the job may land after its `finished`
            await self._writer.finish(job.job_id)
        if self._store is not None and job.result is not None:
            await self._persist(job)
        for forgotten in self._retire(job):
            if self._forks is not None:
                await self._forks.release(forgotten)

    async def _persist(self, job: JobRecord) -> None:
        assert self._store is not None and job.result is not None
        store, result = self._store, job.result
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_delay(self._persist_retry_s),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                retry=retry_if_not_exception_type(JobNotHeld),
                reraise=True,
            ):
                with attempt:
                    await store.finished(
                        job.job_id, job.status, job.end_time or time.time(), result, job.events.events()
                    )
            job.events.mark_durable(job.events.last_seq)
            self._stored()
        except JobNotHeld as exc:  # another server took it over: its outcome is the one that counts
            log.warning("job_outcome_not_recorded", error=exc.message)
            job.events.lose_durability()
        except Exception as exc:  # the job's outcome stands in memory; say why it is not durable
            log.error("job_store_write_failed", error=str(exc))
            job.events.lose_durability()

    def _stored(self) -> None:
        if self._on_stored is not None:
            self._on_stored()

    async def restore(self) -> int:
        """Load the store: finished jobs come back as they were; jobs that were
        running when the server died start again if their retry policy allows,
        and are failed as interrupted otherwise (after the events they had stored).
        A job whose stored events end with its `finished` event (the server died
        before writing its outcome) comes back finished with that result.
        Returns how many jobs were loaded."""
        if self._store is None:
            return 0
        stored = await self._store.load(self._settings.jobs.retain_finished_s)
        for item in stored:
            events = item.events
            ended = None
            if item.result is None:
                events = _contiguous(item.job_id, events)
                if events and events[-1].HasField("finished"):
                    ended = events[-1]
            if (
                item.result is None
                and ended is None
                and item.attempt <= item.request.retry.max_restarts
                and self._restart(item)
            ):
                continue
            job = _stored_record(
                item,
                plan=None,
                events=EventLog.restored(item.job_id, events),
                status=item.status,
                end_time=item.end_time,
                result=item.result,
            )
            if ended is not None:
                job.result = ended.finished.result
                job.status = ended.finished.result.status
                job.end_time = ended.time.ToNanoseconds() / 1e9
                await self._persist(job)
            elif item.result is None:
                self._interrupted(job)
                await self._persist(job)
            self._jobs[job.job_id] = job
            self._finished.append(job.job_id)
        if stored:
            self._numbers = itertools.count(max(item.number for item in stored) + 1)
            log.info("jobs_restored", count=len(stored))
        return len(stored)

    def _restart(self, item: StoredJob) -> bool:
        """Run an interrupted job again from the beginning, under its own id."""
        try:
            plan = resolve_plan(item.request, self._settings, self._registry)
        except ProrlError as exc:  # e.g. its handler is gone from this server's build
            log.warning("job_not_restarted", job_id=item.job_id, error=exc.message)
            return False
        job = _stored_record(item, plan=plan, events=EventLog(item.job_id), attempt=item.attempt + 1)
        self._admit(job)
        log.info("job_restarted", job_id=job.job_id, attempt=job.attempt)
        return True

    @staticmethod
    def _interrupted(job: JobRecord) -> None:
        job.result = v1.RolloutResult(
            job_id=job.job_id,
            status=v1.JOB_STATUS_FAILED,
            failure=v1.Failure(
                kind=v1.FAILURE_KIND_INFRASTRUCTURE,
                reason="interrupted",
                message=(
                    "the server stopped while the job was running; submit it again under a new job id, "
                    "or set retry.max_restarts to let the server run it again"
                ),
            ),
        )
        job.status = v1.JOB_STATUS_FAILED
        job.end_time = time.time()
        # The events it had stored (seq 1..n), then its end as seq n + 1.
        job.events = EventLog.restored(job.job_id, job.events.events(), closed=False)
        job.events.append(finished=v1.JobFinished(result=job.result))
        job.events.close()

    def _retire(self, job: JobRecord) -> list[str]:
        """Count the job finished; returns the ids of the jobs no longer retained."""
        self._finished.append(job.job_id)
        forgotten: list[str] = []
        while len(self._finished) > self._settings.jobs.retain_finished:
            forgotten.append(self._finished.popleft())
            self._jobs.pop(forgotten[-1], None)
        return forgotten

    # --- queries ---------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        job = self._jobs.get(job_id)
        if job is None:
            raise unknown_job(job_id)
        return job

    def list(
        self,
        *,
        statuses: Sequence[int] = (),
        labels: Mapping[str, str] | None = None,
        group_id: str = "",
        page_size: int = 0,
        page_token: str = "",
    ) -> tuple[list[JobRecord], str]:
        size, after = check_page(page_size, page_token)
        wanted = set(statuses)
        labels = dict(labels or {})
        matches: list[JobRecord] = []
        for job in sorted(self._jobs.values(), key=lambda j: j.number):
            if job.number <= after:
                continue
            if wanted and job.status not in wanted:
                continue
            if group_id and job.request.group_id != group_id:
                continue
            if any(job.request.labels.get(key) != value for key, value in labels.items()):
                continue
            matches.append(job)
            if len(matches) > size:
                break
        page = matches[:size]
        next_token = str(page[-1].number) if len(matches) > size else ""
        return page, next_token

    async def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[v1.RolloutEvent]:
        if after_seq < 0:
            raise InvalidArgument(f"after_seq must not be negative, got {after_seq}")
        job = self.get(job_id)
        async for event in job.events.follow(after_seq):
            yield event

    async def cancel(self, job_id: str, reason: str = "") -> JobRecord:
        """Cancel a job and wait until its sandboxes are gone."""
        check_cancel_reason(reason)
        job = self.get(job_id)
        if job.finished or job.task is None:
            return job
        self._request_cancel(job, reason or "cancelled by the client")
        await asyncio.wait({job.task}, timeout=CANCEL_WAIT_S)
        return job

    def local(self, job_id: str) -> JobRecord | None:
        """The job if this server holds it (or retains it after its end)."""
        return self._jobs.get(job_id)

    def request_cancel(self, job_id: str, reason: str) -> bool:
        """Cancel a job of this server without waiting; False if it has none such running."""
        job = self._jobs.get(job_id)
        if job is None or job.finished or job.task is None:
            return False
        self._request_cancel(job, reason)
        return True

    @staticmethod
    def _request_cancel(job: JobRecord, reason: str) -> None:
        """Cancel a job once: later requests (a second Cancel, shutdown) only wait.
        A job whose task has not started yet is ended by the pipeline on its first
        step, which sees cancel_reason; cancelling that task now would skip its cleanup."""
        if job.cancel_reason is not None:
            return
        job.cancel_reason = reason
        if job.started and job.task is not None:
            job.task.cancel()

    def count_by_status(self) -> dict[v1.JobStatus, int]:
        """Jobs the server knows (queued, running and retained), by status."""
        return dict(collections.Counter(job.status for job in self._jobs.values()))

    # --- lifecycle -------------------------------------------------------------

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, give running jobs `grace_s` to finish, cancel the rest."""
        self._accepting = False
        tasks = set(self._tasks)
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        for job in self._jobs.values():
            if job.task is not None and not job.task.done():
                if self._handover is not None:
                    self._handover(job)
                self._request_cancel(job, "the server is shutting down")
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._writer is not None:
            await self._writer.close()


def _contiguous(job_id: str, events: list[v1.RolloutEvent]) -> list[v1.RolloutEvent]:
    """The stored events of an unfinished job with seq 1, 2, ... up to the first
    missing one (events the EventWriter dropped while the store was failing)."""
    kept = 0
    while kept < len(events) and events[kept].seq == kept + 1:
        kept += 1
    if kept < len(events):
        log.warning("job_events_gap", job_id=job_id, kept=kept, discarded=len(events) - kept)
    return events[:kept]


def _stored_record(item: StoredJob, **fields: Any) -> JobRecord:
    """A JobRecord with a stored job's identity (id, number, request, creation time)."""
    return JobRecord(
        job_id=item.job_id,
        number=item.number,
        request=item.request,
        fingerprint=item.fingerprint,
        create_time=item.create_time,
        **fields,
    )
