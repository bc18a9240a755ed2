"""The job manager (jobs/manager.py) over a real pipeline on the fakes: admission and
idempotency, refusals naming the field, listing, watching, cancel and shutdown.

The scripted policy reads the question: "answer N" finishes with N, "hold" finishes only when
the test releases it (the job waits in its model turn), "refuse" gets a backend refusal (an
infrastructure failure)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import v1
from prorl_server.agents.registry import default_registry
from prorl_server.config import load_settings
from prorl_server.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.phases import phase_gates
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.record import JobRecord
from prorl_server.llm.router import BackendRouter
from prorl_server.sandbox.allocator import SandboxAllocator
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt
from tests.helpers import assert_eventually, kinds, math_request

SUCCEEDED, FAILED, CANCELLED = v1.JOB_STATUS_SUCCEEDED, v1.JOB_STATUS_FAILED, v1.JOB_STATUS_CANCELLED


class Env:
    def __init__(self, provider: FakeSandboxProvider, **jobs: Any) -> None:
        self.provider = provider
        self.release = asyncio.Event()
        self.backend = ScriptedChatBackend(self.script)
        self.router = BackendRouter(health_interval_s=0)
        self.router.add(self.backend)
        self.allocator = SandboxAllocator(provider, [])
        settings = load_settings(None, environ={}, overrides={"jobs": {"store": False, **jobs}})
        pipeline = Pipeline(gates=phase_gates(init=8, run=8, eval=8), sandboxes=self.allocator, router=self.router)
        self.manager = JobManager(settings=settings, registry=default_registry(), pipeline=pipeline)

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        question = user_prompt(messages)
        if question == "hold":
            return ScriptedReply(tool_call_text("finish", {"answer": "42"}), wait_for=self.release)
        if question == "refuse":
            return ScriptedReply(status=404, error_message="no such model")
        return ScriptedReply(tool_call_text("finish", {"answer": question.split()[-1]}))

    def submit(self, question: str, answer: str = "42", **fields: Any) -> JobRecord:
        job, created = self.manager.submit(math_request(question, answer, **fields))
        assert created
        return job

    async def held(self, count: int = 1) -> None:
        """Wait until `count` held jobs are in their model turn."""
        await assert_eventually(lambda: self.backend.in_flight == count, message=f"{count} jobs never got held")


async def finished(*jobs: JobRecord) -> None:
    await assert_eventually(lambda: all(job.finished for job in jobs), message="jobs did not finish")


@pytest_asyncio.fixture
async def make_env(fake_provider: FakeSandboxProvider) -> AsyncIterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(**jobs: Any) -> Env:
        made.append(Env(fake_provider, **jobs))
        return made[-1]

    yield make
    for env in made:
        env.release.set()
        await env.manager.shutdown(0)
        assert all(job.finished for job in env.manager.list(page_size=1000)[0])
        await env.allocator.close()
        await env.router.close()
    assert fake_provider.busy == 0


@pytest.fixture
def env(make_env: Callable[..., Env]) -> Env:
    return make_env()


async def test_submit_is_idempotent_on_the_job_id(env: Env) -> None:
    manager = env.manager
    job, created = manager.submit(math_request("answer 7", "7", job_id="same"))
    again, created_again = manager.submit(math_request("answer 7", "7", job_id="same"))
    assert created and not created_again and again is job

    with pytest.raises(AlreadyExists, match="job id 'same' is already used by a different request"):
        manager.submit(math_request("answer 8", "8", job_id="same"))
    await finished(job)
    assert manager.submit(math_request("answer 7", "7", job_id="same")) == (job, False)  # finished: still the same
    assert job.status == SUCCEEDED and job.result is not None and job.result.reward == 1.0
    assert len(env.backend.requests) == 1  # it ran once

    first, second = env.submit("answer 1", "1"), env.submit("answer 1", "1")
    assert first.job_id != second.job_id and len(first.job_id) == 32  # ids the server made up
    assert first.request.job_id == first.job_id
    await finished(first, second)


def _with(change: Callable[[v1.RolloutRequest], Any]) -> v1.RolloutRequest:
    request = math_request("answer 1", "1")
    change(request)
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (
            _with(lambda r: setattr(r, "handler", "chess")),
            "unknown handler 'chess'; this server has: code, command, math, rubric, stem, swe, terminal",
        ),
        (_with(lambda r: setattr(r, "handler", "")), "handler is empty"),
        (_with(lambda r: r.instance.__delitem__("question")), "math instance field 'question': missing"),
        (_with(lambda r: r.instance.update({"question": 5})), "math instance field 'question'"),
        (_with(lambda r: setattr(r, "job_id", "no spaces")), "job_id 'no spaces' is invalid"),
        (_with(lambda r: setattr(r.limits, "max_turns", 10_000)), "limits.max_turns must be between 1 and 200"),
        (_with(lambda r: setattr(r.sampling, "temperature", 50)), "sampling.temperature must be between 0 and 10"),
    ],
    ids=["unknown-handler", "no-handler", "no-question", "question-not-text", "job-id", "max-turns", "temperature"],
)
async def test_a_bad_request_is_refused_naming_the_field(env: Env, request_: v1.RolloutRequest, message: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        env.manager.submit(request_)
    assert message in refused.value.message
    assert env.manager.list() == ([], "") and env.manager.count_by_status() == {}


async def test_the_queue_limit_refuses_then_admits_again(make_env: Callable[..., Env]) -> None:
    env = make_env(max_queued=2)
    first, second = env.submit("hold", job_id="q1"), env.submit("hold", job_id="q2")

    with pytest.raises(ResourceExhausted, match=r"2 jobs are queued or running.*jobs\.max_queued"):
        env.submit("answer 3", "3")
    assert env.manager.submit(first.request) == (first, False)  # resending a live job is no new job

    await env.held(2)
    env.release.set()
    await finished(first, second)
    third = env.submit("answer 3", "3")
    await finished(third)
    assert [job.status for job in (first, second, third)] == [SUCCEEDED] * 3


async def test_list_filters_and_pages_in_submission_order(env: Env) -> None:
    jobs = [
        env.submit(
            "refuse" if n == 4 else f"answer {n}",
            str(n),
            job_id=f"l{n}",
            group_id="g1" if n < 3 else "g2",
            labels={"split": "train" if n % 2 == 0 else "test"},
        )
        for n in range(5)
    ]
    await finished(*jobs)
    manager = env.manager

    def ids(page: tuple[list[JobRecord], str]) -> tuple[list[str], str]:
        return [job.job_id for job in page[0]], page[1]

    assert ids(manager.list()) == (["l0", "l1", "l2", "l3", "l4"], "")
    first = ids(manager.list(page_size=2))
    second = ids(manager.list(page_size=2, page_token=first[1]))
    last = ids(manager.list(page_size=2, page_token=second[1]))
    assert (first[0], second[0], last) == (["l0", "l1"], ["l2", "l3"], (["l4"], ""))
    assert ids(manager.list(statuses=[FAILED])) == (["l4"], "")
    assert ids(manager.list(statuses=[SUCCEEDED, FAILED], page_size=4))[0] == ["l0", "l1", "l2", "l3"]
    assert ids(manager.list(group_id="g1")) == (["l0", "l1", "l2"], "")
    assert ids(manager.list(labels={"split": "train"})) == (["l0", "l2", "l4"], "")
    assert ids(manager.list(group_id="g2", labels={"split": "train"})) == (["l4"], "")
    assert ids(manager.list(statuses=[CANCELLED])) == ([], "")
    with pytest.raises(InvalidArgument, match="page_token is not one this server issued"):
        manager.list(page_token="abc")
    with pytest.raises(InvalidArgument, match="page_size must not be negative"):
        manager.list(page_size=-1)


async def test_watch_replays_what_happened_then_follows_to_the_end(env: Env) -> None:
    job = env.submit("hold", job_id="w1")
    await env.held()
    seen: list[v1.RolloutEvent] = []

    async def watch() -> None:
        async for event in env.manager.watch("w1"):
            seen.append(event)

    watcher = asyncio.create_task(watch())
    await assert_eventually(lambda: len(seen) == 3, message="the watcher got no replay")
    assert kinds(seen) == ["queued", "phase_started", "phase_started"] and not watcher.done()

    env.release.set()
    await asyncio.wait_for(watcher, 20)

    assert seen == job.events.events() and kinds(seen)[-1] == "finished"
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    later = [event async for event in env.manager.watch("w1", after_seq=3)]
    assert later == seen[3:]
    with pytest.raises(InvalidArgument, match="after_seq must not be negative"):
        await anext(env.manager.watch("w1", after_seq=-1))
    with pytest.raises(NotFound, match="no job with id 'nobody'"):
        await anext(env.manager.watch("nobody"))


async def test_two_concurrent_cancels_both_return_the_cancelled_job(env: Env) -> None:
    job = env.submit("hold", job_id="c1")
    await env.held()
    assert env.provider.busy == 1 and job.status == v1.JOB_STATUS_RUNNING

    first, second = await asyncio.gather(env.manager.cancel("c1", "first reason"), env.manager.cancel("c1", "second"))

    assert first is job and second is job and job.status == CANCELLED
    assert job.result is not None and job.result.failure.reason == "cancelled"
    assert job.result.failure.message == "first reason"  # the first request's reason stands
    assert env.provider.busy == 0 and env.backend.in_flight == 0
    assert kinds(job.events.events())[-1] == "finished" and job.events.closed
    assert (await env.manager.cancel("c1", "again")).result == job.result  # finished: nothing changes
    with pytest.raises(NotFound):
        await env.manager.cancel("nobody")
    with pytest.raises(InvalidArgument, match="reason is 2000 characters"):
        await env.manager.cancel("c1", "x" * 2000)


async def test_a_job_cancelled_before_it_ran_ends_cancelled_without_a_sandbox(env: Env) -> None:
    job = env.submit("answer 1", "1", job_id="early")
    cancelled = await env.manager.cancel("early")

    assert cancelled is job and job.status == CANCELLED
    assert job.result is not None and job.result.failure.message == "cancelled by the client"
    assert kinds(job.events.events()) == ["queued", "finished"]
    assert env.provider.created == [] and env.backend.requests == []


async def test_shutdown_cancels_running_jobs_and_refuses_new_ones(env: Env) -> None:
    done = env.submit("answer 5", "5")
    await finished(done)
    running = [env.submit("hold"), env.submit("hold")]
    await env.held(2)

    await env.manager.shutdown(grace_s=0)

    assert done.status == SUCCEEDED
    for job in running:
        assert job.status == CANCELLED and job.result is not None
        assert job.result.failure.message == "the server is shutting down"
    assert env.provider.busy == 0
    with pytest.raises(Unavailable, match="shutting down"):
        env.submit("answer 1", "1")


async def test_shutdown_lets_running_jobs_finish_within_the_grace_period(env: Env) -> None:
    job = env.submit("hold")
    await env.held()
    shutdown = asyncio.create_task(env.manager.shutdown(grace_s=30))
    await asyncio.sleep(0)  # the shutdown begins: it stops admitting, then waits for the job
    with pytest.raises(Unavailable):
        env.submit("answer 1", "1")
    env.release.set()
    await asyncio.wait_for(shutdown, 20)
    assert job.status == SUCCEEDED and job.result is not None and job.result.reward == 1.0


async def test_count_by_status_counts_every_job_the_server_knows(env: Env) -> None:
    won, failed, held = env.submit("answer 2", "2"), env.submit("refuse"), env.submit("hold")
    queued = env.submit("answer 3", "3")
    assert env.manager.count_by_status() == {v1.JOB_STATUS_QUEUED: 4}  # none has started yet

    await finished(won, failed, queued)
    await env.held()
    assert env.manager.count_by_status() == {SUCCEEDED: 2, FAILED: 1, v1.JOB_STATUS_RUNNING: 1}
    assert failed.result is not None and failed.result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE

    await env.manager.cancel(held.job_id)
    assert env.manager.count_by_status() == {SUCCEEDED: 2, FAILED: 1, CANCELLED: 1}


async def test_only_the_newest_finished_jobs_are_retained(make_env: Callable[..., Env]) -> None:
    env = make_env(retain_finished=2)
    jobs = []
    for n in range(3):
        jobs.append(env.submit(f"answer {n}", str(n), job_id=f"r{n}"))
        await finished(jobs[-1])
    with pytest.raises(NotFound, match="no job with id 'r0'"):
        env.manager.get("r0")
    assert [job.job_id for job in env.manager.list()[0]] == ["r1", "r2"]
