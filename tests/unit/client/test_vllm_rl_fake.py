"""The vLLM backend's weight updates, re-sampled turns and MoE routing, against the fake vLLM
(tests/fakes/token_servers.py, kept honest by tests/integration/test_vllm_fake_contract.py);
the same paths on a real vLLM are in tests/integration/test_vllm_*.py.

The server is real (a real gRPC port, the real client); sandboxes are the fake provider's
(the real in-sandbox runtime in a local folder) and the model's replies are scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from prorl_client.bridges import _core
from prorl_client.bridges.skyrl import generator_output
from prorl_client.bridges.verl import agent_loop_output

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.errors import InvalidArgument, Unavailable
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.token_http import VLLMBackend
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.helpers import assert_eventually, math_request, server_settings

FINISH = '<tool_call>{"name": "finish", "arguments": {"answer": "42"}}</tool_call>'


@pytest.fixture
def tokenizer_folder(tmp_path: Path) -> Path:
    return write_tiny_tokenizer(tmp_path / "tokenizer")


@pytest_asyncio.fixture
async def fake(tokenizer_folder: Path) -> AsyncIterator[FakeVLLM]:
    server = FakeVLLM(tokenizer_folder, lambda prompt: FINISH)
    await server.start()
    yield server
    if server.hold is not None:
        server.hold.set()
    await server.stop()


def backend_for(fake: FakeVLLM, folder: Path) -> VLLMBackend:
    settings = BackendSettings(id="vllm", kind="vllm", base_url=fake.base_url, tokenizer_path=str(folder))
    backend = build_backend(settings, timeout_s=60, max_retries=0)
    assert isinstance(backend, VLLMBackend)
    return backend


class Served:
    def __init__(self, fake: FakeVLLM, folder: Path) -> None:
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"))
        backend = {"id": "vllm", "kind": "vllm", "base_url": fake.base_url, "tokenizer_path": str(folder)}
        settings = server_settings(llm={"backends": [backend]})
        self.server = ProrlServer(settings, sandbox_provider=self.provider)
        self.client = Client.connect("")

    async def __aenter__(self) -> Served:
        await self.server.start()
        self.client = Client.connect(self.server.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.server.stop()
        assert self.provider.busy == 0

    async def result(self, job_id: str) -> v1.RolloutResult:
        events = [e async for e in self.client.rollout(math_request("What is 6 * 7?", "42", job_id=job_id))]
        return events[-1].finished.result


async def test_load_weights_pauses_reloads_resets_the_cache_and_resumes(fake: FakeVLLM, tokenizer_folder: Path) -> None:
    backend = backend_for(fake, tokenizer_folder)
    try:
        await backend.load_weights("/ckpt/step-1")
        await backend.set_weights_version(1)
    finally:
        await backend.close()
    assert fake.control == [
        "/pause?mode=wait",
        "/collective_rpc reload_weights",
        "/reset_prefix_cache",
        "/resume",
        "/update_weight_version 1",
    ]
    assert fake.weights == "/ckpt/step-1" and fake.weight_version == "1" and not fake.paused


async def test_a_checkpoint_vllm_cannot_load_is_refused_and_the_previous_one_loaded_again(
    fake: FakeVLLM, tokenizer_folder: Path
) -> None:
    backend = backend_for(fake, tokenizer_folder)
    try:
        await backend.load_weights("/ckpt/step-1")
        fake.control.clear()
        with pytest.raises(InvalidArgument) as raised:
            await backend.load_weights("/ckpt/missing-step-2")
        assert "missing-step-2" in raised.value.message and "/ckpt/step-1" in raised.value.message
        assert fake.loads == ["/ckpt/step-1", "/ckpt/step-1"] and fake.weights == "/ckpt/step-1"
        assert fake.control[-1] == "/resume" and not fake.paused
        # The first load of a backend falls back to the folder vLLM was started with.
        fresh = backend_for(fake, tokenizer_folder)
        with pytest.raises(InvalidArgument):
            await fresh.load_weights("/ckpt/missing-3")
        await fresh.close()
        assert fake.weights == fake.root
    finally:
        await backend.close()


async def test_when_the_previous_checkpoint_cannot_be_loaded_back_vllm_is_left_paused(
    fake: FakeVLLM, tokenizer_folder: Path
) -> None:
    """Its layers may be half reset (vLLM's reload is not transactional): a forward pass on them
    crashed the engine, so vLLM must not be resumed, and the error says what to do."""
    backend = backend_for(fake, tokenizer_folder)
    backend._weights_path = "/ckpt/missing-old"  # the checkpoint it served was deleted since
    try:
        with pytest.raises(Unavailable) as raised:
            await backend.load_weights("/ckpt/missing-new")
        assert "missing-new" in raised.value.message and "missing-old" in raised.value.message
        assert "left paused" in raised.value.message
        assert fake.paused and "/resume" not in fake.control
    finally:
        await backend.close()


async def test_update_weights_through_the_service_sets_vllms_version(fake: FakeVLLM, tokenizer_folder: Path) -> None:
    async with Served(fake, tokenizer_folder) as served:
        before = await served.result("before")
        assert before.trajectory.logprobs[before.trajectory.turn_spans[0].start] == -0.5
        await served.client.pause()
        update = await served.client.update_weights("/ckpt/step-1", resume=True)
        assert update.policy_version == 1 and fake.weight_version == "1"
        after = await served.result("after")
    span = after.trajectory.turn_spans[0]
    assert span.policy_version == 1 and not span.resampled
    assert after.trajectory.logprobs[span.start] == -0.125  # sampled by the new weights


async def test_a_turn_aborted_by_pause_is_resampled_and_says_so(fake: FakeVLLM, tokenizer_folder: Path) -> None:
    fake.hold = asyncio.Event()
    async with Served(fake, tokenizer_folder) as served:
        running = asyncio.create_task(served.result("aborted"))
        await assert_eventually(lambda: len(fake.requests) == 1)
        pause = await served.client.pause(abort_in_flight=True)
        assert pause.aborted == 1
        await assert_eventually(lambda: fake.cancelled == 1, message="the aborted request reached vLLM as a disconnect")
        fake.hold.set()
        await served.client.update_weights("/ckpt/step-1", resume=True)
        result = await running
        events = [e async for e in served.client.watch("aborted")]
    assert result.status == v1.JOB_STATUS_SUCCEEDED
    (span,) = result.trajectory.turn_spans
    assert span.resampled and span.policy_version == 1
    assert result.trajectory.logprobs[span.start] == -0.125
    turns = [e.model_turn for e in events if e.HasField("model_turn")]
    assert [t.resampled for t in turns] == [True]
    assert len(fake.requests) == 2 and fake.requests[0]["prompt"] == fake.requests[1]["prompt"]


@pytest.mark.parametrize("routed", [(3, 2), None])
async def test_routed_experts_reach_the_trajectory_and_the_bridges(
    fake: FakeVLLM, tokenizer_folder: Path, routed: tuple[int, int] | None
) -> None:
    fake.routed = routed
    backend = backend_for(fake, tokenizer_folder)
    try:
        generation = await backend.generate([1, 2, 3], Sampling(max_tokens=64, temperature=1.0))
    finally:
        await backend.close()
    async with Served(fake, tokenizer_folder) as served:
        result = await served.result("routed")
    trajectory = result.trajectory
    rollout = _core.split("routed", "g", result)
    verl = agent_loop_output(rollout)
    skyrl = generator_output([rollout])
    if routed is None:
        assert generation.routed_experts is None and not trajectory.HasField("routed_experts")
        assert rollout.routed_experts is None and verl["routed_experts"] is None
        assert skyrl["rollout_expert_indices"] is None
        return
    layers, top_k = routed
    assert generation.routed_experts is not None
    assert (generation.routed_experts.num_tokens, generation.routed_experts.num_layers) == (
        3 + len(generation.token_ids) - 1,
        3,
    )
    experts = trajectory.routed_experts
    assert (experts.num_tokens, experts.num_layers, experts.top_k) == (len(trajectory.token_ids) - 1, layers, top_k)
    assert len(experts.expert_ids) == experts.num_tokens * layers * top_k
    nested = rollout.routed_experts
    assert nested is not None and len(nested) == experts.num_tokens
    assert nested[5][1] == [(5 + 1 + k) % 8 for k in range(top_k)]  # token 5, layer 1: the fake's routing
    assert verl["routed_experts"] == nested and skyrl["rollout_expert_indices"] == [nested]
