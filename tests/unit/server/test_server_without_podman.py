"""A real ProrlServer on a real port, driven by the real Python client, with no Podman and no
model: sandboxes from the fake provider, model turns from a scripted in-process backend.

The scripted policy reads the question: "answer N" finishes with N, "hold" finishes only when
the test releases it, "refuse" gets a backend refusal (an infrastructure failure)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt
from tests.helpers import assert_eventually, kinds, math_request, server_settings


class Served:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"))
        self.backend = ScriptedChatBackend(self.script)
        settings = server_settings()
        self.server = ProrlServer(settings, sandbox_provider=self.provider, backends=[self.backend])
        self.client: Client | None = None

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        question = user_prompt(messages)
        if question == "hold":
            return ScriptedReply(tool_call_text("finish", {"answer": "42"}), wait_for=self.release)
        if question == "refuse":
            return ScriptedReply(status=404, error_message="no such model")
        return ScriptedReply(tool_call_text("finish", {"answer": question.split()[-1]}))

    async def held(self, count: int = 1) -> None:
        await assert_eventually(lambda: self.backend.in_flight == count, message=f"{count} jobs never got held")


def leftovers(provider: FakeSandboxProvider) -> list[Path]:
    """The provider's sandbox folders still on disk (under the system's temp dir: a deeper
    folder such as tmp_path could outgrow the length of a unix socket's path)."""
    return list(Path(tempfile.gettempdir()).glob(f"prorl-{provider.instance_id}-*"))


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    served = Served()
    await served.server.start()
    served.client = Client.connect(served.server.address)
    yield served
    served.release.set()
    await served.client.close()
    await served.server.stop()
    # Nothing left: no sandbox, no folder, the backend closed with the server.
    assert served.provider.busy == 0 and leftovers(served.provider) == []
    assert served.backend.closed and served.backend.in_flight == 0


@pytest.fixture
def client(served: Served) -> Client:
    assert served.client is not None
    return served.client


async def test_submit_and_watch_a_math_job_to_success(served: Served, client: Client) -> None:
    submitted = await client.submit(math_request("answer 42", "42", job_id="s1", labels={"run": "fast"}))
    assert submitted.created and submitted.job.job_id == "s1" and submitted.job.handler == "math"

    events = [event async for event in client.watch("s1")]

    assert kinds(events)[0] == "queued" and kinds(events)[-1] == "finished"
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    result = events[-1].finished.result
    assert (result.status, result.reward, result.details["verdict"]) == (v1.JOB_STATUS_SUCCEEDED, 1.0, "correct")
    assert result.trajectory.num_turns == 1 and result.trajectory.messages[2].role == "assistant"
    job = await client.get_job("s1")
    assert job.status == v1.JOB_STATUS_SUCCEEDED and job.result == result and job.last_seq == len(events)
    assert job.labels == {"run": "fast"} and job.HasField("end_time")
    again = await client.submit(math_request("answer 42", "42", job_id="s1", labels={"run": "fast"}))
    assert not again.created and again.job.status == v1.JOB_STATUS_SUCCEEDED
    assert [request.sampling.temperature for request in served.backend.requests] == [1.0]  # the server's default


async def test_rollout_stream_runs_a_batch_and_rejects_a_bad_request(client: Client) -> None:
    bad = math_request("answer 1", "1", job_id="bad")
    bad.handler = "chess"
    requests = [math_request(f"answer {n}", str(n), job_id=f"b{n}") for n in range(3)]

    finished: dict[str, v1.RolloutResult] = {}
    rejected: list[v1.RolloutRejected] = []
    async for item in client.rollout_many([requests[0], bad, *requests[1:]]):
        if isinstance(item, v1.RolloutRejected):
            rejected.append(item)
        elif item.HasField("finished"):
            finished[item.job_id] = item.finished.result

    assert sorted(finished) == ["b0", "b1", "b2"]
    assert all(result.reward == 1.0 for result in finished.values())
    (refusal,) = rejected
    assert refusal.job_id == "bad" and refusal.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "unknown handler 'chess'" in refusal.message
    listed = await client.list_jobs(statuses=[v1.JOB_STATUS_SUCCEEDED])
    assert [job.job_id for job in listed.jobs] == ["b0", "b1", "b2"]


async def test_get_stats_agrees_with_the_jobs(served: Served, client: Client) -> None:
    for question in ("answer 1", "answer 2", "refuse"):
        [_ async for _ in client.rollout(math_request(question, "1"))]
    await client.submit(math_request("hold", job_id="held"))
    await served.held()

    stats = await client.get_stats()

    jobs = {count.status: count.count for count in stats.jobs}
    assert jobs == {v1.JOB_STATUS_SUCCEEDED: 2, v1.JOB_STATUS_FAILED: 1, v1.JOB_STATUS_RUNNING: 1}
    phases = {phase.phase: (phase.queued, phase.active, phase.limit) for phase in stats.phases}
    limits = served.server.settings.phases
    assert phases == {
        v1.PHASE_INIT: (0, 0, limits.init),
        v1.PHASE_RUN: (0, 1, limits.run),
        v1.PHASE_EVAL: (0, 0, limits.eval),
    }
    assert stats.sandboxes_busy == 1 == served.provider.busy
    (pool,) = stats.pools
    assert (pool.image, pool.busy, pool.warm, pool.target) == ("localhost/prorl-python:latest", 1, 0, 0)
    (backend,) = stats.backends
    assert (backend.id, backend.state.healthy, backend.state.in_flight) == ("scripted", True, 1)
    assert backend.state.requests_total == 4 and backend.state.errors_total == 1
    assert (stats.policy_version, stats.paused) == (0, False)

    served.release.set()
    await assert_eventually(lambda: served.provider.busy == 0, message="the held job did not finish")
    after = await client.get_stats()
    assert {count.status: count.count for count in after.jobs} == {v1.JOB_STATUS_SUCCEEDED: 3, v1.JOB_STATUS_FAILED: 1}
    assert after.sandboxes_busy == 0 and after.backends[0].state.in_flight == 0


async def test_cancel_a_running_job(served: Served, client: Client) -> None:
    await client.submit(math_request("hold", job_id="c1"))
    await served.held()
    assert served.provider.busy == 1

    job = await client.cancel("c1", reason="the test says stop")

    assert job.status == v1.JOB_STATUS_CANCELLED and job.result.status == v1.JOB_STATUS_CANCELLED
    assert (job.result.failure.reason, job.result.failure.message) == ("cancelled", "the test says stop")
    assert served.provider.busy == 0
    events = [event async for event in client.watch("c1")]
    assert kinds(events)[-1] == "finished"
    assert (await client.cancel("c1")).status == v1.JOB_STATUS_CANCELLED  # a finished job: as it was


async def test_bad_requests_get_their_status_codes(client: Client) -> None:
    no_question = math_request("answer 1", "1")
    del no_question.instance["question"]
    with pytest.raises(RpcError) as refused:
        await client.submit(no_question)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "math instance field 'question'" in refused.value.details

    unknown = math_request("answer 1", "1")
    unknown.handler = "chess"
    with pytest.raises(RpcError) as streamed:
        [_ async for _ in client.rollout(unknown)]
    assert streamed.value.code == grpc.StatusCode.INVALID_ARGUMENT and "chess" in streamed.value.details

    with pytest.raises(RpcError) as missing:
        await client.get_job("nobody")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert (await client.list_jobs()).jobs == []


async def test_stopping_the_server_cancels_running_jobs_and_removes_their_sandboxes(
    served: Served, client: Client
) -> None:
    await client.submit(math_request("hold", job_id="h1"))
    await client.submit(math_request("hold", job_id="h2"))
    await served.held(2)
    assert served.provider.busy == 2
    manager = served.server.manager
    assert manager is not None

    await served.server.stop()

    for job_id in ("h1", "h2"):
        job = manager.get(job_id)
        assert job.status == v1.JOB_STATUS_CANCELLED and job.result is not None
        assert job.result.failure.message == "the server is shutting down"
    assert served.provider.busy == 0 and served.provider.containers == []
