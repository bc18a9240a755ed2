"""Runs one phase of a job: wait for its gate, run the step within what is left of
the budget, and say how it ended.

Time waiting for the slot is queue time and never counts against the budget;
nor does time a step waits for a model slot (the router tells the job's
BudgetClock, which stops the phase's deadline while any request of the job
waits and moves it on by as much afterwards). A step that raises is classified
by the handler's hook for that phase; a step that runs out of budget is a
timeout, the policy's in the run phase (the agent used the time) and
infrastructure's in init and eval.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from prorl_client import v1
from prorl_server.agents.outcomes import FailureInfo
from prorl_server.jobs.phases import PhaseGate
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.wire import PHASE_NAMES, duration
from prorl_server.metrics import Metrics

log = structlog.get_logger(__name__)


class BudgetClock:
    """A job's budget deadline in the phase running now, stopped while the job waits for a
    model slot (the router's WaitClock): a shared backend busy with other jobs' turns is
    not the policy's time. Requests of one job may wait at once; the clock runs again
    when the last stops waiting. Other deadlines of the job's time (a task's own time for
    its agent, RolloutContext.time_limit) are governed the same way."""

    def __init__(self) -> None:
        self.model_wait_s = 0.0
        """Time any of the job's requests waited for a model slot, overlaps counted once."""
        self._governed: list[_Governed] = []
        self._waiting = 0
        self._since = 0.0

    @contextlib.contextmanager
    def waiting_for_model(self) -> Iterator[None]:
        self._stop()
        try:
            yield
        finally:
            self._restart()

    @contextlib.contextmanager
    def governing(self, deadline: asyncio.Timeout) -> Iterator[None]:
        """`deadline` stops while the job waits for a model slot, for as long as this lasts."""
        governed = _Governed(deadline)
        self._governed.append(governed)
        if self._waiting:
            governed.stop()
        try:
            yield
        finally:
            self._governed.remove(governed)

    def _stop(self) -> None:
        self._waiting += 1
        if self._waiting > 1:
            return
        self._since = time.monotonic()
        for governed in self._governed:
            governed.stop()

    def _restart(self) -> None:
        self._waiting -= 1
        if self._waiting:
            return
        self.model_wait_s += time.monotonic() - self._since
        for governed in self._governed:
            governed.restart()


@dataclass(eq=False)
class _Governed:
    """A deadline the BudgetClock stops, and what was left of it when it stopped."""

    deadline: asyncio.Timeout
    left: float | None = None

    def stop(self) -> None:
        deadline = self.deadline
        if not deadline.expired() and (when := deadline.when()) is not None:
            self.left = max(when - asyncio.get_running_loop().time(), 0.0)
            deadline.reschedule(None)

    def restart(self) -> None:
        left, self.left = self.left, None
        if left is not None and not self.deadline.expired():
            self.deadline.reschedule(asyncio.get_running_loop().time() + left)


@dataclass
class PhaseTimes:
    """A job's time per phase so far: what the result's timing reports."""

    queue_s: float = 0.0
    phase_s: dict[v1.Phase, float] = field(default_factory=lambda: dict.fromkeys(PHASE_NAMES, 0.0))
    clock: BudgetClock = field(default_factory=BudgetClock)

    @property
    def model_wait_s(self) -> float:
        """Time in the phases spent waiting for a model slot."""
        return self.clock.model_wait_s

    @property
    def used_s(self) -> float:
        """What the phases used of the budget (queueing for a phase or a model slot excluded)."""
        return max(sum(self.phase_s.values()) - self.model_wait_s, 0.0)


@dataclass(frozen=True)
class PhaseResult:
    phase: v1.Phase
    status: v1.JobStatus
    """SUCCEEDED when the step returned, FAILED when it raised, TIMED_OUT when the budget ran out."""
    value: Any = None
    """What the step returned."""
    failure: v1.Failure | None = None

    @property
    def ok(self) -> bool:
        return self.status == v1.JOB_STATUS_SUCCEEDED


class PhaseRunner:
    def __init__(self, gates: dict[v1.Phase, PhaseGate], metrics: Metrics | None = None) -> None:
        self._gates = gates
        self._metrics = metrics

    async def run(
        self,
        job: JobRecord,
        phase: v1.Phase,
        step: Callable[[], Awaitable[Any]],
        on_error: Callable[[BaseException], FailureInfo],
        *,
        times: PhaseTimes,
        budget_s: float,
        priority: int = 0,
    ) -> PhaseResult:
        """Run `step` in `phase`; `times` is updated even when the job is cancelled meanwhile."""
        name = PHASE_NAMES[phase]
        waited = time.monotonic()
        async with self._gates[phase].slot(priority):
            queue_s = time.monotonic() - waited
            times.queue_s += queue_s
            if self._metrics is not None:
                self._metrics.queue_seconds.labels(name).observe(queue_s)
            job.phase, job.status = phase, v1.JOB_STATUS_RUNNING
            job.start_time = job.start_time or time.time()
            job.events.append(phase_started=v1.PhaseStarted(phase=phase, queue_wait=duration(queue_s)))
            started = time.monotonic()
            try:
                async with asyncio.timeout(max(budget_s - times.used_s, 0.0)) as deadline:
                    with times.clock.governing(deadline):
                        value = await step()
            except TimeoutError as exc:
                if not deadline.expired():  # the step's own timeout, not the budget's
                    return self._failed(phase, on_error(exc), exc)
                kind = v1.FAILURE_KIND_POLICY if phase == v1.PHASE_RUN else v1.FAILURE_KIND_INFRASTRUCTURE
                uncounted = (
                    f" (not counting {times.model_wait_s:.1f}s waiting for a model slot)" if times.model_wait_s else ""
                )
                failure = v1.Failure(
                    kind=kind,
                    phase=phase,
                    reason="budget_exceeded",
                    message=f"the job's budget of {budget_s:g}s ran out in the {name} phase{uncounted}",
                )
                return PhaseResult(phase, v1.JOB_STATUS_TIMED_OUT, failure=failure)
            except Exception as exc:
                return self._failed(phase, on_error(exc), exc)
            finally:
                elapsed = time.monotonic() - started
                times.phase_s[phase] += elapsed
                if self._metrics is not None:
                    self._metrics.phase_seconds.labels(name).observe(elapsed)
            return PhaseResult(phase, v1.JOB_STATUS_SUCCEEDED, value)

    @staticmethod
    def _failed(phase: v1.Phase, info: FailureInfo, exc: BaseException) -> PhaseResult:
        log.warning("job_phase_failed", phase=PHASE_NAMES[phase], reason=info.reason, error=str(exc))
        failure = v1.Failure(
            kind=v1.FAILURE_KIND_INFRASTRUCTURE if info.infrastructure else v1.FAILURE_KIND_POLICY,
            phase=phase,
            reason=info.reason,
            message=info.message,
        )
        return PhaseResult(phase, v1.JOB_STATUS_FAILED, failure=failure)
