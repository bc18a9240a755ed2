"""New weights into inference (AdminService.UpdateWeights) and the minimum policy version a job
accepts, through a real server on a real port and the real client; no Podman, no model: the
backend is a scripted in-process fake that "loads" a checkpoint by answering with its name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.errors import InvalidArgument
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import LoadableScriptedBackend, ScriptedChatBackend, ScriptedReply, tool_call_text
from tests.fakes.token_servers import FakeSGLang, write_tiny_tokenizer
from tests.helpers import assert_eventually, math_request, server_settings


class LoadableBackend(LoadableScriptedBackend):
    """Answers with the name of the checkpoint it serves; its replies wait for `release`."""

    def __init__(self) -> None:
        super().__init__(self.reply, backend_id="loadable")
        self.release = asyncio.Event()
        self.release.set()

    def reply(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply(tool_call_text("finish", {"answer": self.weights}), wait_for=self.release)


class Served:
    def __init__(self, *extra: ScriptedChatBackend) -> None:
        self.backend = LoadableBackend()
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"))
        settings = server_settings()
        self.server = ProrlServer(settings, sandbox_provider=self.provider, backends=[self.backend, *extra])
        self.client = Client.connect("")

    async def result(self, job_id: str, **fields: Any) -> v1.RolloutResult:
        request = math_request("What is 6 * 7?", "42", job_id=job_id, **fields)
        events = [event async for event in self.client.rollout(request)]
        return events[-1].finished.result


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    served = Served(ScriptedChatBackend(lambda _: ScriptedReply("never asked"), backend_id="fixed", weight=1e-9))
    await served.server.start()
    served.client = Client.connect(served.server.address)
    yield served
    served.backend.release.set()
    await served.client.close()
    await served.server.stop()
    assert served.provider.busy == 0


async def test_new_weights_are_served_after_resume_under_the_new_version(served: Served) -> None:
    client = served.client
    await client.remove_backend("fixed")  # every turn on the loadable backend
    before = await served.result("before")
    assert before.details["answer"] == "initial" and list(before.trajectory.turn_policy_versions) == [0]

    await client.pause()
    update = await client.update_weights("/ckpt/step-1")
    assert update.policy_version == 1 and not update.resumed
    assert [b.backend_id for b in update.backends] == ["loadable"]
    assert update.backends[0].load_time.ToTimedelta().total_seconds() >= 0
    assert (await client.get_stats()).paused  # loaded, not resumed yet
    assert await client.resume() == 1  # Resume without a version takes the staged one

    after = await served.result("after")
    assert after.details["answer"] == "step-1"
    assert list(after.trajectory.turn_policy_versions) == [1]
    assert dict(after.trajectory.turns_by_policy_version) == {1: 1}

    await client.pause()
    update = await client.update_weights("/ckpt/step-7", policy_version=7, resume=True)
    assert update.resumed and update.policy_version == 7
    assert not (await client.get_stats()).paused
    assert (await served.result("seventh")).trajectory.turns_by_policy_version == {7: 1}


async def test_weights_load_only_once_the_requests_under_way_have_finished(served: Served) -> None:
    client = served.client
    await client.remove_backend("fixed")
    served.backend.release.clear()
    running = asyncio.create_task(served.result("running"))
    await assert_eventually(lambda: served.backend.in_flight == 1)
    await client.pause()  # without abort: the turn under way finishes on the old weights
    update = asyncio.create_task(client.update_weights("/ckpt/new", resume=True))
    await asyncio.sleep(0.2)
    assert not update.done() and served.backend.loaded == []
    served.backend.release.set()
    assert (await update).policy_version == 1
    assert served.backend.in_flight_at_load == [0]
    result = await running
    assert result.details["answer"] == "initial" and list(result.trajectory.turn_policy_versions) == [0]


async def test_a_job_waits_for_its_minimum_policy_version(served: Served) -> None:
    client = served.client
    await client.remove_backend("fixed")
    waiting = asyncio.create_task(served.result("for-v2", min_policy_version=2))
    await asyncio.sleep(0.3)
    assert not waiting.done() and served.backend.requests == []  # no turn sampled from version 0
    for step in (1, 2):
        await client.pause()
        await client.update_weights(f"/ckpt/v{step}", resume=True)
        if step == 1:
            await asyncio.sleep(0.2)
            assert not waiting.done()
    result = await waiting
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.details["answer"] == "v2"
    assert dict(result.trajectory.turns_by_policy_version) == {2: 1}
    older = await served.result("any", min_policy_version=1)
    assert list(older.trajectory.turn_policy_versions) == [2]


async def test_bad_weight_updates_get_clear_errors_and_change_nothing(served: Served) -> None:
    client = served.client

    async def refused(call: Any) -> RpcError:
        with pytest.raises(RpcError) as error:
            await call
        return error.value

    error = await refused(client.update_weights("/ckpt/x"))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "Pause" in error.details
    await client.pause()
    error = await refused(client.update_weights(""))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "model_path" in error.details
    error = await refused(client.update_weights("/ckpt/x", backend_ids=["fixed"]))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "cannot load weights" in error.details
    error = await refused(client.update_weights("/ckpt/x", backend_ids=["nope"]))
    assert error.code == grpc.StatusCode.NOT_FOUND
    error = await refused(client.update_weights("/ckpt/x", policy_version=0))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in error.details
    error = await refused(client.update_weights("/elsewhere/x"))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "generation stays paused" in error.details
    assert served.backend.loaded == [] and (await client.get_stats()).policy_version == 0
    request = math_request("What is 1 + 1?", "2", min_policy_version=-1)
    error = await refused(client.submit(request))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "min_policy_version" in error.details
    assert await client.resume() == 1  # nothing was staged: current + 1


async def test_resume_cannot_go_below_the_staged_version(served: Served) -> None:
    await served.client.pause()
    await served.client.update_weights("/ckpt/x", policy_version=5)
    with pytest.raises(RpcError) as error:
        await served.client.resume(policy_version=4)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert await served.client.resume(policy_version=6) == 6


async def test_sglang_loads_weights_through_its_update_from_disk_endpoint(tmp_path: Path) -> None:
    folder = write_tiny_tokenizer(tmp_path / "tokenizer")
    fake = FakeSGLang(folder, lambda prompt: "ok")
    await fake.start()
    try:
        settings = BackendSettings(id="sg", kind="sglang", base_url=fake.base_url, tokenizer_path=str(folder))
        pool = BackendRouter(health_interval_s=0)
        entry = pool.add(build_backend(settings, timeout_s=10, max_retries=0))
        sampling = Sampling(max_tokens=8, temperature=1.0)
        messages = [{"role": "user", "content": "hi"}]
        assert set((await LLMSession("a", pool).chat(messages, [], sampling)).logprobs) == {-0.25}
        pool.pause(abort_in_flight=False)
        with pytest.raises(InvalidArgument, match="did not load"):
            await pool.load_weights([entry], str(tmp_path / "missing"))
        checkpoint = tmp_path / "ckpt"
        checkpoint.mkdir()
        await pool.load_weights([entry], str(checkpoint))
        pool.resume()
        assert fake.weights == str(checkpoint)
        after = await LLMSession("b", pool).chat(messages, [], sampling)
        assert set(after.logprobs) == {-0.125} and after.policy_version == 1
        await pool.close()
    finally:
        await fake.stop()
