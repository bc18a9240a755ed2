"""Runs one job: init -> run -> eval, each behind its phase gate, within its budget.

The budget counts only time inside the phases, never the wait for a phase's
slot nor for a model slot (the job's BudgetClock is the router's wait clock for
the job).
`run`'s outcome is what `evaluate` judges. Whatever ends the job (success,
failure, budget, cancel) it ends the same way: sandboxes removed, a result
built from the trajectory so far, a `finished` event, the event log closed.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog

from prorl_client import v1
from prorl_server.agents.base import EvalOutcome, JobGateway, RolloutContext
from prorl_server.agents.events import AgentEvent
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.config import GatewaySettings
from prorl_server.gateway.app import ModelGateway
from prorl_server.gateway.chains import CallChains
from prorl_server.gateway.directory import GatewayDirectory, job_path
from prorl_server.jobs import wire
from prorl_server.jobs.forks import ForkRegistry, JobBranching
from prorl_server.jobs.phase_runner import BudgetClock, PhaseResult, PhaseRunner, PhaseTimes
from prorl_server.jobs.phases import PhaseGate
from prorl_server.jobs.record import JobPlan, JobRecord
from prorl_server.jobs.uninterruptible import uninterruptible
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.metrics import Metrics
from prorl_server.sandbox.allocator import SandboxAllocator
from prorl_server.sandbox.base import LABEL_JOB, Sandbox, SandboxSpec
from prorl_server.verifiers.judge import ModelJudge

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Models:
    """The job's model conversations: the agent's own turns, and an agent program's calls."""

    session: LLMSession
    chains: CallChains


@dataclass
class _Outcome:
    status: v1.JobStatus = v1.JOB_STATUS_SUCCEEDED
    failure: v1.Failure | None = None
    evaluation: EvalOutcome | None = None
    times: PhaseTimes = field(default_factory=PhaseTimes)

    def ended(self, result: PhaseResult) -> bool:
        """Take a phase's result; True when the job goes no further."""
        if result.ok:
            return False
        self.status, self.failure = result.status, result.failure
        return True


class Pipeline:
    def __init__(
        self,
        *,
        gates: dict[v1.Phase, PhaseGate],
        sandboxes: SandboxAllocator,
        router: BackendRouter,
        metrics: Metrics | None = None,
        gateways: GatewayDirectory | None = None,
        gateway_port: Callable[[], int | None] = lambda: None,
        gateway_host: str = "",
        gateway_limits: GatewaySettings | None = None,
        judge: ModelJudge | None = None,
        forks: ForkRegistry | None = None,
    ) -> None:
        """`gateways`: where jobs' model gateways are listed for the server's gateway port, whose
        number `gateway_port()` gives (None: not served outside the sandboxes), on `gateway_host`."""
        self._gateways = gateways if gateways is not None else GatewayDirectory()
        self._forks = forks
        """Where forkable jobs keep their turn boundaries (None: no job is forkable)."""
        self._gateway_port = gateway_port
        self._gateway_host = gateway_host
        self._gateway_limits = gateway_limits or GatewaySettings()
        self._phases = PhaseRunner(gates, metrics)
        self._init_gate = gates[v1.PHASE_INIT]
        self._metrics = metrics
        self._sandboxes = sandboxes
        self._router = router
        self._judge = judge

    @property
    def waiting(self) -> int:
        """Jobs waiting to start (for an init slot)."""
        return self._init_gate.queued

    def _context(
        self, job: JobRecord, plan: JobPlan, session: LLMSession, chains: CallChains, clock: BudgetClock
    ) -> RolloutContext[Any]:
        async def open_sandbox() -> Sandbox:
            spec = SandboxSpec(
                image=plan.image or "",
                cpus=plan.cpus,
                memory_mib=plan.memory_mib,
                pids_limit=plan.pids_limit,
                labels={LABEL_JOB: job.job_id},
            )
            return await self._sandboxes.acquire(spec)

        def emit(event: AgentEvent) -> None:
            job.events.append(**wire.agent_event(event))

        @asynccontextmanager
        async def model_gateway(sandbox: Sandbox) -> AsyncIterator[JobGateway]:
            key = secrets.token_urlsafe(24)
            gateway = ModelGateway(
                chains.chat,
                default_sampling=plan.sampling,
                api_key=key,
                limits=self._gateway_limits,
                on_left_out=chains.note_left_out,
            )
            handle = await sandbox.open_relay(gateway)
            self._gateways.add(job.job_id, gateway)
            try:
                port = self._gateway_port() or 0
                opened = v1.GatewayOpened(path=job_path(job.job_id), api_key=key, port=port, host=self._gateway_host)
                job.events.append(gateway_opened=opened)
                yield JobGateway(handle.port, key, outage=lambda: chains.outage)
            finally:
                self._gateways.remove(job.job_id)
                await handle.close()

        fork = job.fork
        if fork is not None and fork.boundary.recorder is not None:
            recorder = fork.source.recorder.branch(fork.boundary.recorder, emit, self._metrics)
        else:
            recorder = TrajectoryRecorder(emit, self._metrics)
        branching: JobBranching | None = None
        if self._forks is not None and job.request.forkable and plan.handler.forkable:
            source = self._forks.track(
                job.job_id,
                roots=tuple(plan.handler.fork_roots(plan.instance)),
                recorder=recorder,
                chat=session.job_chat,
                start=fork,
            )
            branching = JobBranching(self._forks, source, fork)
        return RolloutContext(
            job_id=job.job_id,
            instance=plan.instance,
            limits=plan.limits,
            sampling=plan.sampling,
            chat=session.chat,
            sandbox_factory=open_sandbox,
            recorder=recorder,
            model_gateway=model_gateway,
            judge=self._judge.for_job(job.job_id, wait_clock=clock) if self._judge is not None else None,
            branching=branching,
            clock=clock,
        )

    async def execute(self, job: JobRecord) -> None:
        plan = job.plan
        assert plan is not None, "a restored job never runs again"
        fork = job.fork
        job_chat = (
            fork.source.chat.branch(fork.boundary.conversation, train_prefix=fork.train_prefix)
            if fork is not None
            else None
        )
        session = LLMSession(job.job_id, self._router, job_chat=job_chat, min_policy_version=plan.min_policy_version)
        chains = CallChains(
            job.job_id,
            self._router,
            min_policy_version=plan.min_policy_version,
            job_sampling=plan.sampling,
            program_sampling=bool(getattr(plan.instance, "program_chooses_sampling", False)),
            max_result_message_bytes=self._gateway_limits.max_result_message_bytes,
        )
        outcome = _Outcome()
        ctx = self._context(job, plan, session, chains, outcome.times.clock)
        chains.on_call = ctx.recorder.model_turn
        self._router.wait_clocks[job.job_id] = outcome.times.clock
        try:
            if job.cancel_reason is not None:  # cancelled before it started to run
                raise asyncio.CancelledError
            await self._run_phases(job, plan, ctx, outcome)
        except asyncio.CancelledError:
            outcome.status = v1.JOB_STATUS_CANCELLED
            outcome.failure = v1.Failure(
                phase=job.phase, reason="cancelled", message=job.cancel_reason or "the job was cancelled"
            )
            await uninterruptible(self._finish(job, ctx, _Models(session, chains), outcome))
            raise
        except Exception as exc:  # a bug here or in a hook: the job still ends, and says why
            log.exception("job_failed_internally")
            outcome.status = v1.JOB_STATUS_FAILED
            outcome.failure = v1.Failure(
                kind=v1.FAILURE_KIND_INFRASTRUCTURE,
                phase=job.phase,
                reason="internal",
                message=f"{type(exc).__name__}: {exc}"[:4096],
            )
        # A Cancel that lands now finds the job cleaning up: its outcome stands.
        await uninterruptible(self._finish(job, ctx, _Models(session, chains), outcome))

    async def _run_phases(self, job: JobRecord, plan: JobPlan, ctx: RolloutContext[Any], outcome: _Outcome) -> None:
        handler = plan.handler

        async def phase(
            which: v1.Phase, step: Callable[[], Awaitable[Any]], on_error: Callable[..., Any]
        ) -> PhaseResult:
            return await self._phases.run(
                job,
                which,
                step,
                lambda exc: on_error(ctx, exc),
                times=outcome.times,
                budget_s=plan.budget_s,
                priority=plan.priority,
            )

        if outcome.ended(await phase(v1.PHASE_INIT, lambda: handler.init(ctx), handler.on_init_error)):
            return
        run = await phase(v1.PHASE_RUN, lambda: handler.run(ctx), handler.on_run_error)
        if outcome.ended(run):
            return
        evaluation = await phase(v1.PHASE_EVAL, lambda: handler.evaluate(ctx, run.value), handler.on_eval_error)
        if outcome.ended(evaluation):
            return
        value: EvalOutcome = evaluation.value
        outcome.evaluation = value
        job.events.append(evaluation=v1.Evaluation(reward=value.reward, details=wire.to_struct(value.details)))

    async def _finish(self, job: JobRecord, ctx: RolloutContext[Any], models: _Models, outcome: _Outcome) -> None:
        cleanup_started = time.monotonic()
        try:
            await asyncio.shield(ctx.close_sandboxes())
        except Exception as exc:  # the job's outcome stands; the leftover is reaped by label
            log.error("sandbox_cleanup_failed", error=str(exc))
        self._router.forget(job.job_id)
        if self._forks is not None:
            self._forks.finished(job.job_id)
        result = self._result(job, ctx, models, outcome, cleanup_s=time.monotonic() - cleanup_started)
        job.result = result
        job.status = outcome.status
        job.end_time = time.time()
        job.events.append(finished=v1.JobFinished(result=result))
        job.events.close()
        if self._metrics is not None:
            self._metrics.jobs_finished.labels(job.request.handler, wire.status_name(outcome.status)).inc()
        log.info(
            "job_finished",
            status=v1.JobStatus.Name(outcome.status),
            reward=result.reward,
            turns=ctx.recorder.num_turns,
        )

    @staticmethod
    def _result(
        job: JobRecord, ctx: RolloutContext[Any], models: _Models, outcome: _Outcome, *, cleanup_s: float
    ) -> v1.RolloutResult:
        recorder = ctx.recorder
        details: dict[str, Any] = dict(outcome.evaluation.details) if outcome.evaluation else {}
        details["format_errors"] = recorder.format_errors
        if models.chains.calls:  # an agent program's calls: what the gateway changed of them
            details["gateway"] = models.chains.report()
        assert job.plan is not None
        details = job.plan.handler.shape_result(ctx, details)
        phase_s = outcome.times.phase_s
        return v1.RolloutResult(
            job_id=job.job_id,
            status=outcome.status,
            failure=outcome.failure,
            reward=outcome.evaluation.reward if outcome.evaluation else 0.0,
            trajectory=wire.trajectory(
                recorder,
                models.session.token_trajectory(),
                models.chains.token_chains(),
                models.chains.last_conversation,
            ),
            timing=v1.Timing(
                queue=wire.duration(outcome.times.queue_s),
                init=wire.duration(phase_s[v1.PHASE_INIT]),
                run=wire.duration(phase_s[v1.PHASE_RUN]),
                eval=wire.duration(phase_s[v1.PHASE_EVAL]),
                llm=wire.duration(recorder.llm_s),
                model_wait=wire.duration(outcome.times.model_wait_s),
                tools=wire.duration(recorder.tools_s),
                sandbox_acquire=wire.duration(ctx.sandbox_acquire_s),
                total=wire.duration(time.time() - job.create_time),
                cleanup=wire.duration(cleanup_s),
            ),
            details=wire.to_struct(details),
            fork_origin=job.fork.origin() if job.fork is not None else None,
        )
