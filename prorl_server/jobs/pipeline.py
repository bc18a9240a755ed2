"""Runs one job: init -> run -> eval, each behind its phase gate, within its budget.

The budget counts only time inside the phases (never the wait for a slot).
Whatever ends the job (success, failure, budget, cancel) it ends the same
way: sandboxes removed, a result built from the trajectory so far, a
`finished` event, the event log closed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from google.protobuf.struct_pb2 import Struct

from prorl_client import v1
from prorl_server.agents.base import EvalOutcome, FailureInfo, RolloutContext
from prorl_server.agents.recorder import TrajectoryRecorder, duration
from prorl_server.jobs.phases import PhaseGate
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.uninterruptible import uninterruptible
from prorl_server.llm.router import BackendPool
from prorl_server.llm.session import LLMSession
from prorl_server.metrics import Metrics
from prorl_server.sandbox.base import Sandbox, SandboxSpec
from prorl_server.sandbox.podman import LABEL_JOB
from prorl_server.sandbox.pool import SandboxPools

log = structlog.get_logger(__name__)

PHASE_NAMES = {v1.PHASE_INIT: "init", v1.PHASE_RUN: "run", v1.PHASE_EVAL: "eval"}


def to_struct(data: dict[str, Any]) -> Struct:
    struct = Struct()
    struct.update(json.loads(json.dumps(data, default=str)))
    return struct


@dataclass
class _Outcome:
    status: v1.JobStatus = v1.JOB_STATUS_SUCCEEDED
    failure: v1.Failure | None = None
    evaluation: EvalOutcome | None = None
    phase_s: dict[v1.Phase, float] = field(default_factory=lambda: dict.fromkeys(PHASE_NAMES, 0.0))
    queue_s: float = 0.0


class Pipeline:
    def __init__(
        self,
        *,
        gates: dict[v1.Phase, PhaseGate],
        sandboxes: SandboxPools,
        pool: BackendPool,
        metrics: Metrics | None = None,
    ) -> None:
        self.gates = gates
        self._metrics = metrics
        self._sandboxes = sandboxes
        self._pool = pool

    def _context(self, job: JobRecord, session: LLMSession) -> RolloutContext:
        plan = job.plan
        assert plan is not None, "a restored job never runs again"

        async def open_sandbox() -> Sandbox:
            spec = SandboxSpec(
                image=plan.image or "",
                cpus=plan.cpus,
                memory_mib=plan.memory_mib,
                pids_limit=plan.pids_limit,
                labels={LABEL_JOB: job.job_id},
            )
            return await self._sandboxes.acquire(spec)

        return RolloutContext(
            job_id=job.job_id,
            instance=plan.instance,
            limits=plan.limits,
            sampling=plan.sampling,
            chat=session.chat,
            sandbox_factory=open_sandbox,
            recorder=TrajectoryRecorder(job.events.append, self._metrics),
        )

    async def execute(self, job: JobRecord) -> None:
        session = LLMSession(job.job_id, self._pool)
        ctx = self._context(job, session)
        assert job.plan is not None
        plan = job.plan
        handler = plan.handler
        outcome = _Outcome()
        phases: list[tuple[v1.Phase, Callable[[RolloutContext], Awaitable[Any]], Callable[..., FailureInfo]]] = [
            (v1.PHASE_INIT, handler.init, handler.on_init_error),
            (v1.PHASE_RUN, handler.run, handler.on_run_error),
            (v1.PHASE_EVAL, handler.evaluate, handler.on_eval_error),
        ]
        used_s = 0.0
        try:
            if job.cancel_reason is not None:  # cancelled before it started to run
                raise asyncio.CancelledError
            for phase, step, on_error in phases:
                waited = time.monotonic()
                async with self.gates[phase].slot(plan.priority):
                    queue_wait = time.monotonic() - waited
                    outcome.queue_s += queue_wait
                    if self._metrics is not None:
                        self._metrics.queue_seconds.labels(PHASE_NAMES[phase]).observe(queue_wait)
                    job.phase, job.status = phase, v1.JOB_STATUS_RUNNING
                    job.start_time = job.start_time or time.time()
                    job.events.append(phase_started=v1.PhaseStarted(phase=phase, queue_wait=duration(queue_wait)))
                    started = time.monotonic()
                    try:
                        async with asyncio.timeout(max(plan.budget_s - used_s, 0.0)) as deadline:
                            value = await step(ctx)
                    except TimeoutError:
                        if not deadline.expired():
                            raise
                        outcome.status = v1.JOB_STATUS_TIMED_OUT
                        outcome.failure = v1.Failure(
                            # Running out of time in the agent loop is the policy's doing;
                            # in sandbox start-up or the verifier it is not.
                            kind=v1.FAILURE_KIND_POLICY if phase == v1.PHASE_RUN else v1.FAILURE_KIND_INFRASTRUCTURE,
                            phase=phase,
                            reason="budget_exceeded",
                            message=f"the job's budget of {plan.budget_s:g}s ran out in the {PHASE_NAMES[phase]} phase",
                        )
                        break
                    except Exception as exc:
                        info = on_error(ctx, exc)
                        outcome.status = v1.JOB_STATUS_FAILED
                        outcome.failure = v1.Failure(
                            kind=v1.FAILURE_KIND_INFRASTRUCTURE if info.infrastructure else v1.FAILURE_KIND_POLICY,
                            phase=phase,
                            reason=info.reason,
                            message=info.message,
                        )
                        log.warning("job_phase_failed", phase=PHASE_NAMES[phase], reason=info.reason, error=str(exc))
                        break
                    finally:
                        elapsed = time.monotonic() - started
                        outcome.phase_s[phase] += elapsed
                        used_s += elapsed
                        if self._metrics is not None:
                            self._metrics.phase_seconds.labels(PHASE_NAMES[phase]).observe(elapsed)
                if phase == v1.PHASE_EVAL:
                    outcome.evaluation = value
                    job.events.append(evaluation=v1.Evaluation(reward=value.reward, details=to_struct(value.details)))
        except asyncio.CancelledError:
            outcome.status = v1.JOB_STATUS_CANCELLED
            outcome.failure = v1.Failure(
                phase=job.phase, reason="cancelled", message=job.cancel_reason or "the job was cancelled"
            )
            await uninterruptible(self._finish(job, ctx, session, outcome))
            raise
        # A Cancel that lands now finds the job cleaning up: its outcome stands.
        await uninterruptible(self._finish(job, ctx, session, outcome))

    async def _finish(self, job: JobRecord, ctx: RolloutContext, session: LLMSession, outcome: _Outcome) -> None:
        cleanup_started = time.monotonic()
        try:
            await asyncio.shield(ctx.close_sandboxes())
        except Exception as exc:  # the job's outcome stands; the leftover is reaped by label
            log.error("sandbox_cleanup_failed", error=str(exc))
        self._pool.forget(job.job_id)
        cleanup_s = time.monotonic() - cleanup_started
        recorder = ctx.recorder
        details: dict[str, Any] = dict(outcome.evaluation.details) if outcome.evaluation else {}
        details["format_errors"] = recorder.format_errors
        assert job.plan is not None
        details = job.plan.handler.shape_result(ctx, details)
        result = v1.RolloutResult(
            job_id=job.job_id,
            status=outcome.status,
            failure=outcome.failure,
            reward=outcome.evaluation.reward if outcome.evaluation else 0.0,
            trajectory=recorder.to_proto(session.token_trajectory()),
            timing=v1.Timing(
                queue=duration(outcome.queue_s),
                init=duration(outcome.phase_s[v1.PHASE_INIT]),
                run=duration(outcome.phase_s[v1.PHASE_RUN]),
                eval=duration(outcome.phase_s[v1.PHASE_EVAL]),
                llm=duration(recorder.llm_s),
                tools=duration(recorder.tools_s),
                sandbox_acquire=duration(ctx.sandbox_acquire_s),
                total=duration(time.time() - job.create_time),
                cleanup=duration(cleanup_s),
            ),
            details=to_struct(details),
        )
        job.result = result
        job.status = outcome.status
        job.end_time = time.time()
        job.events.append(finished=v1.JobFinished(result=result))
        job.events.close()
        if self._metrics is not None:
            status = v1.JobStatus.Name(outcome.status).removeprefix("JOB_STATUS_").lower()
            self._metrics.jobs_finished.labels(job.request.handler, status).inc()
        log.info(
            "job_finished",
            status=v1.JobStatus.Name(outcome.status),
            reward=result.reward,
            turns=recorder.num_turns,
        )
