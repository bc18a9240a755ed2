"""Faults from outside the server, each with a clear outcome and nothing lost:
a sandbox killed under a running job, and the server itself SIGKILLed and
restarted over its durable store."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from podman import PodmanClient

from prorl_client import Client, v1
from tests.conftest import instance_id, job_containers, server_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index, user_prompt
from tests.helpers import ServeProcess, assert_eventually, math_request

pytestmark = pytest.mark.podman


def hang_on_hang_requests(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Questions containing "hang" sleep in the sandbox; others are answered at once."""
    if "hang" in user_prompt(messages) and turn_index(messages) == 0:
        return ScriptedReply(tool_call_text("bash", {"command": "sleep 120"}))
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


async def test_a_sandbox_killed_from_outside_fails_its_job_as_infrastructure_and_frees_its_slot(
    scripted_llm, start_server, podman_url
) -> None:
    llm = await scripted_llm(hang_on_hang_requests)
    _, client = await start_server(llm.base_url, phases={"run": 1})
    await client.submit(math_request("please hang", job_id="victim"))

    async def tool_running() -> bool:
        job = await client.get_job("victim")
        return job.phase == v1.PHASE_RUN and len(llm.requests) >= 1 and bool(job_containers(podman_url, "victim"))

    await assert_eventually(tool_running)
    (container,) = job_containers(podman_url, "victim")
    with PodmanClient(base_url=podman_url) as podman:
        podman.containers.get(container.id).kill(signal="SIGKILL")

    events = [event async for event in client.watch("victim")]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_FAILED
    assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE  # never scored as the policy's reward 0
    assert result.failure.phase == v1.PHASE_RUN
    assert "sandbox" in result.failure.message.lower()
    assert not job_containers(podman_url, "victim")
    stats = await client.get_stats()
    assert stats.sandboxes_busy == 0
    assert next(p for p in stats.phases if p.phase == v1.PHASE_RUN).active == 0
    # The single run slot is free again: the next job runs to its reward.
    after = [event async for event in client.rollout(math_request("What is 6 * 7?", "42"))]
    assert after[-1].finished.result.reward == 1.0


async def test_sigkill_then_restart_reaps_orphans_and_keeps_the_store_consistent(
    scripted_llm, podman_url, tmp_path: Path
) -> None:
    llm = await scripted_llm(hang_on_hang_requests)
    instance = instance_id("crash")
    settings = (
        f"server.instance_id={instance}",
        f"sandbox.podman_socket={podman_url}",
        f'llm.backends=[{{"id": "scripted", "base_url": "{llm.base_url}"}}]',
        "jobs.store=true",
        f"jobs.store_path={tmp_path / 'jobs.sqlite'}",
        "server.shutdown_grace_s=0",
    )
    async with ServeProcess(*settings) as first:
        async with Client.connect(first.address) as client:
            done = [e async for e in client.rollout(math_request("What is 6 * 7?", "42", job_id="done-before"))]
            assert done[-1].finished.result.reward == 1.0
            await client.submit(math_request("please hang", job_id="cut-short"))
            await assert_eventually(lambda: bool(job_containers(podman_url, "cut-short")))
        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
    assert job_containers(podman_url, "cut-short"), "the crash should have orphaned the running job's container"

    async with ServeProcess(*settings) as second:
        assert not server_containers(podman_url, instance)  # reaped at start-up, before serving
        async with Client.connect(second.address) as client:
            finished = await client.get_job("done-before")
            assert finished.status == v1.JOB_STATUS_SUCCEEDED and finished.result.reward == 1.0
            replay = [event async for event in client.watch("done-before")]
            assert [event.seq for event in replay] == [event.seq for event in done]
            assert replay == done
            cut = await client.get_job("cut-short")
            assert cut.status == v1.JOB_STATUS_FAILED
            assert cut.result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
            assert cut.result.failure.reason == "interrupted"
            listed = {job.job_id: job.status for job in (await client.list_jobs()).jobs}
            assert listed == {"done-before": v1.JOB_STATUS_SUCCEEDED, "cut-short": v1.JOB_STATUS_FAILED}
        assert second.process is not None
        second.process.send_signal(signal.SIGTERM)
        assert await second.wait() == 0
    assert not server_containers(podman_url, instance)


async def test_a_backend_killed_mid_rollout_hands_the_turn_to_another(scripted_llm, start_server, podman_url) -> None:
    # Turn 0's tool waits for the test's go-ahead, given only once the first backend is down,
    # so turn 1 is asked for after the kill however late the test sees the tool start.
    wait_for_go = "for i in $(seq 600); do [ -e /tmp/go ] && break; sleep 0.1; done; echo 42"

    def python_then_finish(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(tool_call_text("bash", {"command": wait_for_go}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    first, second = await scripted_llm(python_then_finish), await scripted_llm(python_then_finish)
    backends = [
        {"id": "first", "base_url": first.base_url, "weight": 100.0},
        {"id": "second", "base_url": second.base_url},
    ]
    _, client = await start_server(None, llm={"backends": backends, "embedded": {"enabled": "never"}})
    await client.submit(math_request("What is 6 * 7?", "42", job_id="moved"))
    watch = client.watch("moved")
    events: list[v1.RolloutEvent] = []
    async for event in watch:
        events.append(event)
        if event.HasField("tool_call"):  # turn 0 is done and its tool is waiting: kill its backend
            await first.stop()
            await asyncio.to_thread(give_go_ahead, podman_url, "moved")
            break
    events += [event async for event in watch]

    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0
    turns = [event.model_turn for event in events if event.HasField("model_turn")]
    assert [turn.backend_id for turn in turns] == ["first", "second"]
    assert turns[1].switched_from_backend == "first"
    assert len(first.requests) == 1 and len(second.requests) == 1


async def test_a_sigkilled_server_leaves_no_podman_service_behind(scripted_llm) -> None:
    """The server's own `podman system service` (started as the sandbox user) ends
    with the server even when the server is SIGKILLed and runs no clean-up."""
    llm = await scripted_llm(hang_on_hang_requests)
    settings = (
        f"server.instance_id={instance_id('orphan')}",
        f'llm.backends=[{{"id": "scripted", "base_url": "{llm.base_url}"}}]',
        "jobs.store=false",
        "server.shutdown_grace_s=0",
    )
    async with ServeProcess(*settings) as server:
        assert server.process is not None
        socket_suffix = f"-{server.process.pid}.sock"

        def services() -> list[str]:
            found = []
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    args = cmdline.read_bytes().split(b"\0")
                except OSError:  # the process ended meanwhile
                    continue
                if b"service" in args and any(arg.decode(errors="replace").endswith(socket_suffix) for arg in args):
                    found.append(cmdline.parent.name)
            return found

        assert services(), "the server should have started its own podman service"
        server.process.send_signal(signal.SIGKILL)
        assert await server.wait() == -signal.SIGKILL
        await assert_eventually(lambda: not services(), timeout_s=30, message="podman service outlived the server")


def give_go_ahead(podman_url: str, job_id: str) -> None:
    (container,) = job_containers(podman_url, job_id)
    exit_code, output = container.exec_run(["touch", "/tmp/go"])
    assert exit_code == 0, output
