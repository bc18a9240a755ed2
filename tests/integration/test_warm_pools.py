"""Warm pools: ready sandboxes per spec, refilled in the background; without sandbox.reuse
never reused, with it reset and handed to the next job (tests/adversarial/test_sandbox_reuse.py
tries to leave something behind)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_client import v1
from prorl_server.sandbox.allocator import SandboxAllocator
from prorl_server.sandbox.podman import PodmanProvider
from tests.conftest import instance_id, podman_options, server_containers, small_spec
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.helpers import assert_eventually, math_request

pytestmark = pytest.mark.podman


async def test_acquire_takes_a_warm_sandbox_and_the_pool_refills(provider) -> None:
    spec = small_spec()
    pools = SandboxAllocator(provider, [(spec, 2)])
    pools.start()
    try:
        await assert_eventually(lambda: pools.stats()[0].warm == 2, message="pool never filled")
        warm_ids = {sandbox.id for sandbox, _ in pools._pools[spec.pool_key].ready}

        first = await pools.acquire(small_spec())
        assert first.id in warm_ids
        (stats,) = pools.stats()
        assert stats.busy == 1 and stats.target == 2
        assert (await first.bash("echo warm", timeout_s=10)).output == "warm\n"
        await assert_eventually(lambda: pools.stats()[0].warm == 2, message="pool never refilled")

        await first.close()
        assert pools.stats()[0].busy == 0
        # A used sandbox is destroyed, never handed out again.
        taken = [await pools.acquire(small_spec()) for _ in range(3)]
        assert first.id not in {sandbox.id for sandbox in taken}
        assert pools.stats()[0].busy == 3
        for sandbox in taken:
            await sandbox.close()

        # A spec without a pool is started cold.
        cold = await pools.acquire(small_spec(cpus=0.5))
        assert {s.cpus: s.target for s in pools.stats()} == {0.5: 0, 1.0: 2}
        await cold.close()
    finally:
        await pools.close()


async def test_stats_report_warm_and_busy_sandboxes_per_pool(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("bash", {"command": "sleep 2"}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    llm = await scripted_llm(script)
    _, client = await start_server(
        llm.base_url, sandbox={"warm_pools": [{"size": 2, "cpus": 1.0, "memory_mib": 256, "pids_limit": 64}]}
    )

    async def pool_state() -> tuple[int, int]:
        (pool,) = (await client.get_stats()).pools
        return pool.warm, pool.busy

    async def full() -> bool:
        return await pool_state() == (2, 0)

    await assert_eventually(full)
    request = math_request("What is 6 * 7?", "42", job_id="pooled")
    request.sandbox.cpus, request.sandbox.memory_mib, request.sandbox.pids_limit = 1.0, 256, 64
    await client.submit(request)

    async def one_busy() -> bool:
        return (await pool_state())[1] == 1

    await assert_eventually(one_busy)
    events = [e async for e in client.watch("pooled")]
    assert events[-1].finished.result.reward == 1.0
    await assert_eventually(full)
    stats = await client.get_stats()
    assert stats.sandboxes_busy == 0 and stats.pools[0].target == 2


async def test_a_memory_hog_job_reports_a_clear_outcome(scripted_llm, start_server) -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("python", {"code": "hog = bytearray(2 * 1024**3)"}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)
    request = math_request("Eat memory", "42")
    request.sandbox.memory_mib = 128
    events = [e async for e in client.rollout(request)]

    result = events[-1].finished.result
    tool = next(e.tool_result for e in events if e.HasField("tool_result"))
    # The hog was killed; the agent was told and went on.
    assert "killed" in tool.output or "MemoryError" in tool.output
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0


async def test_max_sandboxes_caps_containers_until_their_removal_is_done(podman_url: str) -> None:
    instance = instance_id("capped")
    provider = PodmanProvider(url_factory=lambda: podman_url, options=podman_options(instance, max_sandboxes=2))
    await provider.start()
    try:
        first, second = await provider.create(small_spec()), await provider.create(small_spec())
        third = asyncio.ensure_future(provider.create(small_spec()))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not third.done() and provider.busy == 2  # waiting for a slot, not starting a container
        assert len(server_containers(podman_url, instance)) == 2

        await first.close()  # its removal is done when close returns: the slot passes on
        sandbox = await third
        assert (await sandbox.bash("echo ok", timeout_s=10)).output == "ok\n"
        assert provider.busy == 2 and len(server_containers(podman_url, instance)) == 2
        await second.close()
        await sandbox.close()
        assert provider.busy == 0
    finally:
        await provider.close()
    assert not server_containers(podman_url, instance)


async def test_with_reuse_jobs_one_after_another_share_a_container_and_see_nothing_of_each_other(
    scripted_llm, start_server
) -> None:
    """Through a live server: each job looks for what the previous one left, then leaves its own."""

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            command = (
                "n=$(ls -A /workspace | wc -l); [ -e ~/.leftover ] && n=$((n + 1)); echo $n; hostname; "
                "echo x > /workspace/left; touch ~/.leftover"
            )
            return ScriptedReply(tool_call_text("bash", {"command": command}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    llm = await scripted_llm(script)
    server, client = await start_server(llm.base_url, sandbox={"reuse": {"enabled": True}})
    pools = server._sandboxes
    assert pools is not None
    hosts = []
    for index in range(3):
        events = [e async for e in client.rollout(math_request("What is 6 * 7?", job_id=f"reused-{index}"))]
        assert events[-1].finished.result.reward == 1.0
        tool = next(e.tool_result for e in events if e.HasField("tool_result"))
        count, host = tool.output.split()[:2]
        assert count == "0", tool.output  # nothing of the job before
        hosts.append(host)
    assert len(set(hosts)) == 1  # one container served all three
    # The third job's sandbox is reset after its job ended too (the pool's own time: a loaded machine).
    await assert_eventually(lambda: pools.stats()[0].reused == 3 and not pools.stats()[0].resetting, timeout_s=300)
    assert pools.stats()[0].retired == 0
