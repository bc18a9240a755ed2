"""The job pipeline (jobs/pipeline.py, jobs/phase_runner.py) built by hand over the fakes:
phase gates, a sandbox allocator over the fake provider, a router with a scripted in-process
backend; jobs made with resolve_plan as the manager makes them. No Podman, no model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import v1
from prorl_server.agents.base import AgentHandler, EvalOutcome, FailureInfo, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.math import MathHandler
from prorl_server.agents.registry import HandlerRegistry
from prorl_server.config import Settings, load_settings
from prorl_server.errors import PolicyError
from prorl_server.jobs.event_log import EventLog
from prorl_server.jobs.phases import PhaseGate, phase_gates
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.validation import resolve_plan
from prorl_server.llm.base import BackendInfo, LLMBackend
from prorl_server.llm.openai_chat import OpenAIChatBackend
from prorl_server.llm.router import BackendRouter
from prorl_server.sandbox.allocator import SandboxAllocator
from prorl_server.sandbox.base import LABEL_JOB
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import Replies, ScriptedChatBackend, ScriptedLLMServer, ScriptedReply, tool_call_text
from tests.helpers import assert_eventually, kinds, math_request

Step = Callable[[RolloutContext[Any]], Awaitable[Any]]


async def nothing(ctx: RolloutContext[Any]) -> None:
    return None


class StepsInstance(TaskInstance):
    pass


class StepsHandler(AgentHandler[StepsInstance, RunOutcome]):
    """A family whose phases are whatever the test gives; init errors get its own reason."""

    name = "steps"
    instance_model = StepsInstance

    def __init__(self, init: Step = nothing, run: Step | None = None) -> None:
        self._init = init
        self._run = run

    async def init(self, ctx: RolloutContext[StepsInstance]) -> None:
        await self._init(ctx)

    async def run(self, ctx: RolloutContext[StepsInstance]) -> RunOutcome:
        if self._run is not None:
            await self._run(ctx)
        return RunOutcome("finish", "done")

    async def evaluate(self, ctx: RolloutContext[StepsInstance], outcome: RunOutcome) -> EvalOutcome:
        return EvalOutcome(0.5, {"verdict": "judged", "answer": outcome.answer, "stop_reason": outcome.stop_reason})

    def on_init_error(self, ctx: RolloutContext[StepsInstance], exc: BaseException) -> FailureInfo:
        return FailureInfo(True, "steps_init_broke", f"init went wrong: {exc}")


class Harness:
    """A pipeline over the fakes, and the jobs it ran."""

    def __init__(self, provider: FakeSandboxProvider, backend: LLMBackend, **limits: int) -> None:
        self.provider = provider
        self.backend = backend
        self.settings: Settings = load_settings(None, environ={}, overrides={"jobs": {"store": False}})
        self.gates: dict[v1.Phase, PhaseGate] = phase_gates(**{"init": 4, "run": 4, "eval": 4, **limits})
        self.allocator = SandboxAllocator(provider, [])
        self.router = BackendRouter(health_interval_s=0)
        self.router.add(backend)
        self.pipeline = Pipeline(gates=self.gates, sandboxes=self.allocator, router=self.router)
        self._numbers = 0

    def job(self, request: v1.RolloutRequest, *handlers: AgentHandler[Any, Any]) -> JobRecord:
        """A job as JobManager.submit makes one, with the manager's `queued` event."""
        self._numbers += 1
        job_id = request.job_id or f"job-{self._numbers}"
        request.job_id = job_id
        registry = HandlerRegistry([MathHandler(), *handlers])
        job = JobRecord(
            job_id=job_id,
            number=self._numbers,
            request=request,
            fingerprint=request.SerializeToString(deterministic=True),
            plan=resolve_plan(request, self.settings, registry),
            create_time=time.time(),
            events=EventLog(job_id),
        )
        job.events.append(queued=v1.JobQueued(queue_position=self.pipeline.waiting))
        return job

    async def run(self, job: JobRecord) -> v1.RolloutResult:
        job.started = True
        await self.pipeline.execute(job)
        assert job.result is not None and job.finished and job.events.closed
        return job.result


HarnessFactory = Callable[..., Harness]


@pytest_asyncio.fixture
async def harness(fake_provider: FakeSandboxProvider) -> AsyncIterator[HarnessFactory]:
    made: list[Harness] = []

    def make(replies: Replies | LLMBackend = (), **limits: int) -> Harness:
        backend = replies if isinstance(replies, LLMBackend) else ScriptedChatBackend(replies)
        made.append(Harness(fake_provider, backend, **limits))
        return made[-1]

    yield make
    for built in made:
        await built.allocator.close()
        await built.router.close()
    assert fake_provider.busy == 0, "a job left its sandbox behind"


def steps_request(**fields: Any) -> v1.RolloutRequest:
    return v1.RolloutRequest(handler="steps", **fields)


def budget(request: v1.RolloutRequest, seconds: float) -> v1.RolloutRequest:
    request.limits.budget.FromNanoseconds(int(seconds * 1e9))
    return request


def nanos(value: Any) -> int:
    result: int = value.ToNanoseconds()
    return result


async def test_a_succeeded_math_job_events_and_result(harness: HarnessFactory) -> None:
    built = harness([tool_call_text("python", {"code": "print(6 * 7)"}), tool_call_text("finish", {"answer": "42"})])
    job = built.job(math_request("What is 6 * 7?", "42", job_id="math-1"))

    result = await built.run(job)

    events = job.events.events()
    assert kinds(events) == [
        "queued",
        "phase_started",
        "phase_started",
        "model_turn",
        "tool_call",
        "tool_result",
        "model_turn",
        "tool_call",
        "tool_result",
        "phase_started",
        "evaluation",
        "finished",
    ]
    assert [e.seq for e in events] == list(range(1, len(events) + 1)) and {e.job_id for e in events} == {"math-1"}
    phases = [e.phase_started.phase for e in events if e.HasField("phase_started")]
    assert phases == [v1.PHASE_INIT, v1.PHASE_RUN, v1.PHASE_EVAL]
    assert events[5].tool_result.output == "42\n" and events[5].tool_result.name == "python"
    evaluation = events[-2].evaluation
    assert evaluation.reward == 1.0 and "format_errors" not in evaluation.details

    assert (result.status, result.reward, result.job_id) == (v1.JOB_STATUS_SUCCEEDED, 1.0, "math-1")
    assert not result.HasField("failure") and job.status == v1.JOB_STATUS_SUCCEEDED and job.phase == v1.PHASE_EVAL
    details = dict(result.details)
    assert {"verdict", "answer", "stop_reason", "format_errors", "gold"} <= set(details)
    assert (details["verdict"], details["answer"], details["stop_reason"]) == ("correct", "42", "finish")
    assert details["format_errors"] == 0
    assert result.trajectory.num_turns == 2 and result.trajectory.turn_policy_versions == [0, 0]
    assert [m.role for m in result.trajectory.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    timing = result.timing
    for name in ("init", "run", "eval", "llm", "tools", "sandbox_acquire", "total", "cleanup"):
        assert timing.HasField(name) and nanos(getattr(timing, name)) > 0, name
    assert timing.HasField("queue")
    # One sandbox of the job's image, labelled with the job, and removed at the end.
    (spec,) = built.provider.created
    assert spec.image == "localhost/prorl-python:latest" and spec.labels == {LABEL_JOB: "math-1"}
    assert built.provider.busy == 0 and built.allocator.busy == 0
    assert built.gates[v1.PHASE_EVAL].active == 0


async def test_an_exception_in_init_is_infrastructure_with_the_handlers_reason(harness: HarnessFactory) -> None:
    async def broken_init(ctx: RolloutContext[Any]) -> None:
        await ctx.open_sandbox()
        raise RuntimeError("the disk is on fire")

    built = harness()
    result = await built.run(built.job(steps_request(), StepsHandler(init=broken_init)))

    assert result.status == v1.JOB_STATUS_FAILED and result.reward == 0.0
    failure = result.failure
    assert (failure.kind, failure.phase, failure.reason) == (
        v1.FAILURE_KIND_INFRASTRUCTURE,
        v1.PHASE_INIT,
        "steps_init_broke",
    )
    assert failure.message == "init went wrong: the disk is on fire"
    assert dict(result.details) == {"format_errors": 0}  # never evaluated
    assert built.provider.busy == 0 and len(built.provider.created) == 1  # the sandbox init opened is gone


async def test_a_policy_error_in_run_is_the_policys_failure(harness: HarnessFactory) -> None:
    async def misbehave(ctx: RolloutContext[Any]) -> None:
        raise PolicyError("the agent deleted its repository", reason="agent_broke_it")

    built = harness()
    job = built.job(steps_request(), StepsHandler(run=misbehave))
    result = await built.run(job)

    assert result.status == v1.JOB_STATUS_FAILED
    assert (result.failure.kind, result.failure.phase, result.failure.reason) == (
        v1.FAILURE_KIND_POLICY,
        v1.PHASE_RUN,
        "agent_broke_it",
    )
    assert result.failure.message == "the agent deleted its repository"
    assert "evaluation" not in kinds(job.events.events())
    assert [e.phase_started.phase for e in job.events.events() if e.HasField("phase_started")] == [
        v1.PHASE_INIT,
        v1.PHASE_RUN,
    ]


async def test_the_budget_running_out_in_run_is_a_policy_timeout(harness: HarnessFactory) -> None:
    built = harness([tool_call_text("bash", {"command": "sleep 60"})])
    # 5 s: the init phase (a fake sandbox's start) has to fit in it on a loaded machine.
    job = built.job(budget(math_request("Sleep", job_id="slow"), 5.0))

    result = await built.run(job)

    assert result.status == v1.JOB_STATUS_TIMED_OUT and job.status == v1.JOB_STATUS_TIMED_OUT
    assert (result.failure.kind, result.failure.phase, result.failure.reason) == (
        v1.FAILURE_KIND_POLICY,
        v1.PHASE_RUN,
        "budget_exceeded",
    )
    assert result.failure.message == "the job's budget of 5s ran out in the run phase"
    # The partial trajectory: the turn that started the command.
    assert result.trajectory.num_turns == 1 and "sleep 60" in result.trajectory.messages[2].content
    assert dict(result.details) == {"format_errors": 0}
    assert kinds(job.events.events())[-3:] == ["model_turn", "tool_call", "finished"]
    assert built.provider.busy == 0  # the sleeping command went with its sandbox


async def test_the_budget_running_out_in_init_is_an_infrastructure_timeout(harness: HarnessFactory) -> None:
    async def stuck(ctx: RolloutContext[Any]) -> None:
        await asyncio.Event().wait()

    built = harness()
    result = await built.run(built.job(budget(steps_request(), 0.2), StepsHandler(init=stuck)))

    assert result.status == v1.JOB_STATUS_TIMED_OUT
    assert (result.failure.kind, result.failure.phase, result.failure.reason) == (
        v1.FAILURE_KIND_INFRASTRUCTURE,
        v1.PHASE_INIT,
        "budget_exceeded",
    )


async def test_cancel_while_running_ends_cancelled_and_removes_the_sandbox(harness: HarnessFactory) -> None:
    built = harness([tool_call_text("bash", {"command": "sleep 60"})])
    job = built.job(math_request("Loop", job_id="cancel-me"))
    task = asyncio.create_task(built.run(job))
    await assert_eventually(lambda: "tool_call" in kinds(job.events.events()), message="the command never started")
    assert built.provider.busy == 1 and job.status == v1.JOB_STATUS_RUNNING

    job.cancel_reason = "the test says stop"  # what JobManager.cancel does
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert job.status == v1.JOB_STATUS_CANCELLED and job.events.closed
    result = job.result
    assert result is not None and result.status == v1.JOB_STATUS_CANCELLED
    assert (result.failure.reason, result.failure.message, result.failure.phase) == (
        "cancelled",
        "the test says stop",
        v1.PHASE_RUN,
    )
    assert kinds(job.events.events())[-1] == "finished" and result.trajectory.num_turns == 1
    assert built.provider.busy == 0 and built.allocator.busy == 0
    assert built.gates[v1.PHASE_RUN].active == 0


async def test_a_job_cancelled_before_it_started_never_runs_a_phase(harness: HarnessFactory) -> None:
    built = harness()
    job = built.job(math_request("Never", job_id="early"))
    job.cancel_reason = "changed my mind"

    with pytest.raises(asyncio.CancelledError):
        await built.pipeline.execute(job)

    assert job.status == v1.JOB_STATUS_CANCELLED and kinds(job.events.events()) == ["queued", "finished"]
    assert job.result is not None and job.result.failure.message == "changed my mind"
    assert isinstance(built.backend, ScriptedChatBackend)
    assert built.provider.created == [] and built.backend.requests == []


async def test_the_budget_does_not_count_time_queued_for_a_slot(harness: HarnessFactory) -> None:
    budget_s = 1.0  # the job's own work fits in it however loaded the machine
    built = harness(run=1)
    job = built.job(budget(steps_request(), budget_s), StepsHandler())
    run_gate = built.gates[v1.PHASE_RUN]

    async with run_gate.slot():  # another job holds the only run slot
        task = asyncio.create_task(built.run(job))
        await assert_eventually(lambda: run_gate.queued == 1, message="the job never queued for run")
        await asyncio.sleep(2 * budget_s)  # deliberately: queued for longer than its whole budget
        assert not task.done()
    result = await task

    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 0.5, result.failure
    run_started = [e.phase_started for e in job.events.events() if e.HasField("phase_started")][1]
    assert run_started.phase == v1.PHASE_RUN and nanos(run_started.queue_wait) > budget_s * 1e9
    assert nanos(result.timing.queue) > budget_s * 1e9


async def test_jobs_sharing_one_model_slot_interleave_and_their_budget_never_counts_the_wait(
    harness: HarnessFactory,
) -> None:
    """Six jobs with 3 s of budget on a slow model with one slot: each job's own model time is
    0.9 s (3 turns of 0.3 s), the six together need 5.4 s of it, so the last turn of every job
    comes well after 3 s. None times out (the wait for the slot is not the policy's time), and
    the turns go round, first come first served, rather than one trajectory after another."""
    turns, turn_s, budget_s = 3, 0.3, 3.0
    script = [ScriptedReply("ok", delay_s=turn_s)] * (6 * turns)
    built = harness(ScriptedChatBackend(script, max_in_flight=1), run=6)

    waits: dict[str, list[float]] = {}

    async def chat_turns(ctx: RolloutContext[Any]) -> None:
        for turn in range(turns):
            result = await ctx.chat([{"role": "user", "content": f"{ctx.job_id}:{turn}"}], [], ctx.sampling)
            waits.setdefault(ctx.job_id, []).append(result.model_wait_s)

    jobs = [built.job(budget(steps_request(job_id=f"j{n}"), budget_s), StepsHandler(run=chat_turns)) for n in range(6)]
    results = await asyncio.gather(*(built.run(job) for job in jobs))

    assert [r.status for r in results] == [v1.JOB_STATUS_SUCCEEDED] * 6, [r.failure for r in results]
    assert isinstance(built.backend, ScriptedChatBackend)
    served = [str(request.messages[-1]["content"]).split(":") for request in built.backend.requests]
    rounds = [served[k * 6 : (k + 1) * 6] for k in range(turns)]
    order = [job for job, _ in rounds[0]]
    assert sorted(order) == [f"j{n}" for n in range(6)]
    # Round k is every job's turn k, in the order the jobs first came: no job takes two turns in a row.
    assert rounds == [[[job, str(k)] for job in order] for k in range(turns)]
    last = results[-1].timing
    # The last job waited for the others' turns: more than its whole budget, shown on its own bar.
    assert nanos(last.model_wait) > budget_s * 1e9 and nanos(last.run) > budget_s * 1e9
    assert nanos(last.run) - nanos(last.model_wait) < budget_s * 1e9
    # Each turn says what it waited (ModelTurn.model_wait); the job's total is their sum.
    assert len(waits["j5"]) == turns and all(w > 0 for w in waits["j5"])
    assert sum(waits["j5"]) * 1e9 == pytest.approx(nanos(last.model_wait), rel=0.05)


async def test_a_job_whose_own_model_time_exceeds_its_budget_still_times_out_as_the_policys(
    harness: HarnessFactory,
) -> None:
    """The wait is excluded, not the policy's own time: a job behind another on the one slot
    whose own turns take longer than its budget ends TIMED_OUT, and says what it waited."""

    def reply(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply("ok", delay_s=1.0 if messages[-1]["content"] == "first" else 60)

    backend = ScriptedChatBackend(reply, max_in_flight=1)
    built = harness(backend, run=2)

    async def one_turn(ctx: RolloutContext[Any]) -> None:
        await ctx.chat([{"role": "user", "content": ctx.job_id}], [], ctx.sampling)

    first = built.job(steps_request(job_id="first"), StepsHandler(run=one_turn))
    slow = built.job(budget(steps_request(job_id="slow"), 0.3), StepsHandler(run=one_turn))
    first_task = asyncio.create_task(built.run(first))
    await assert_eventually(lambda: backend.in_flight == 1, message="the first job never reached the model")
    done, timed_out = await asyncio.gather(first_task, built.run(slow))

    assert done.status == v1.JOB_STATUS_SUCCEEDED
    assert timed_out.status == v1.JOB_STATUS_TIMED_OUT
    assert (timed_out.failure.kind, timed_out.failure.reason) == (v1.FAILURE_KIND_POLICY, "budget_exceeded")
    assert "waiting for a model slot" in timed_out.failure.message
    assert nanos(timed_out.timing.model_wait) > 0.3e9  # it waited longer than its budget, and went on


# --- a TimeoutError that is not the budget's ---------------------------------------------
# These two fail today (see the report): PhaseRunner.run re-raises a TimeoutError whose source
# is not its own deadline, and Pipeline.execute lets it through without _finish, so the job
# never ends (no result, no `finished` event, its log never closed, its sandbox left).


async def test_a_timeout_error_raised_by_a_step_is_classified_like_any_other_error(harness: HarnessFactory) -> None:
    async def slow_dependency(ctx: RolloutContext[Any]) -> None:
        await ctx.open_sandbox()
        raise TimeoutError("the tool server did not answer in time")

    built = harness()
    job = built.job(steps_request(), StepsHandler(run=slow_dependency))
    result = await built.run(job)

    assert result.status == v1.JOB_STATUS_FAILED
    assert (result.failure.kind, result.failure.phase, result.failure.reason) == (
        v1.FAILURE_KIND_INFRASTRUCTURE,
        v1.PHASE_RUN,
        "internal",
    )
    assert built.provider.busy == 0


async def test_an_http_backend_past_its_request_timeout_fails_the_job_as_the_backends(
    harness: HarnessFactory, scripted_llm: Callable[..., Awaitable[ScriptedLLMServer]]
) -> None:
    """llm.request_timeout_s runs out (aiohttp raises a bare TimeoutError): the job fails as the
    backend's, with reason llm_timeout, and ends like any other job."""
    server = await scripted_llm(lambda messages: ScriptedReply(tool_call_text("finish", {"answer": "42"}), delay_s=30))
    backend = OpenAIChatBackend(BackendInfo("http", "openai_chat", server.base_url, "m"), timeout_s=0.3, max_retries=0)
    built = harness(backend)
    job = built.job(math_request("What is 6 * 7?", "42", job_id="http-timeout"))

    result = await built.run(job)

    assert result.status == v1.JOB_STATUS_FAILED
    assert (result.failure.kind, result.failure.phase, result.failure.reason) == (
        v1.FAILURE_KIND_INFRASTRUCTURE,
        v1.PHASE_RUN,
        "llm_timeout",
    )
    assert built.provider.busy == 0
