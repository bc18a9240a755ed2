"""Blame where it belongs: whatever an agent's commands do to their own sandbox
ends its job as a POLICY failure with a specific reason (trainers mask
INFRASTRUCTURE failures, so a policy must not be able to hide a rollout that
way); only what the agent could not have caused stays INFRASTRUCTURE. And
whatever a tool prints, the job's events and result stay readable over gRPC."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from podman import PodmanClient

from prorl_client import v1
from prorl_server.datasets.swe import TASKS_DIR, load_task
from prorl_server.sandbox.runtime.socket_runtime import CALL_GRACE_S
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.helpers import assert_eventually, math_request

pytestmark = pytest.mark.podman

GRPC_DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024
TOOL_TIMEOUT_S = 20


def calls(*steps: tuple[str, dict[str, Any]]) -> Any:
    """A script that makes these tool calls, one per turn, then answers 42."""

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn < len(steps):
            return ScriptedReply(tool_call_text(*steps[turn]))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    return script


async def run_job(scripted_llm, start_server, request: v1.RolloutRequest, *steps: tuple[str, dict[str, Any]]) -> Any:
    llm = await scripted_llm(calls(*steps))
    _, client = await start_server(llm.base_url)
    events = [event async for event in client.rollout(request)]
    return events[-1].finished.result


def bash(command: str) -> tuple[str, dict[str, Any]]:
    return ("bash", {"command": command})


def python(code: str) -> tuple[str, dict[str, Any]]:
    return ("python", {"code": code})


# A fork bomb that takes every pid and grabs any that is freed.
FORK_BOMB = """
import os, time
if os.fork() == 0:
    while True:
        try:
            os.fork()
        except OSError:
            pass
time.sleep(2)
"""

# $PPID of the agent's shell is the runtime that serves it.
WAYS = {
    "runtime_killed": (bash("kill -9 $PPID"),),
    # Stopped for good: a stop that something else continues (seen under load: the runtime
    # answered and the job succeeded) is a pause the job may survive, not what is tested here.
    # So the stop is repeated ($PPID in the background subshell is still the runtime), and the
    # command itself never ends: a runtime continued for a moment has no answer to give.
    "runtime_stopped": (bash("(while kill -STOP $PPID; do sleep 0.1; done) & kill -STOP $PPID; sleep 1000"),),
    # The runtime cannot start the shell the next command needs.
    "pids_limit": (python(FORK_BOMB), bash("echo hi")),
    # tmpfs pages count against the sandbox's memory and cannot be reclaimed: with /tmp
    # nearly as large as the memory limit, the OOM killer's victim is the runtime's process.
    "memory_limit": (bash("head -c 60M /dev/zero > /tmp/fill"),),
    # /tmp filled before the shell's first command: the runtime cannot write that command.
    "disk_full": (python("open('/tmp/fill', 'wb').write(bytes(100 << 20))"), bash("echo hi")),
}


@pytest.mark.parametrize("reason", sorted(WAYS))
async def test_what_the_agent_does_to_its_own_sandbox_is_a_policy_failure(
    reason: str, scripted_llm, start_server
) -> None:
    request = math_request("Break your sandbox", budget_s=120)
    request.limits.tool_timeout.FromSeconds(TOOL_TIMEOUT_S)
    request.sandbox.memory_mib = 64 if reason == "memory_limit" else 512  # /tmp is 64 MiB here
    request.sandbox.pids_limit = 48
    result = await run_job(scripted_llm, start_server, request, *WAYS[reason])

    assert result.status == v1.JOB_STATUS_FAILED, result
    assert result.failure.kind == v1.FAILURE_KIND_POLICY, result.failure
    assert result.failure.reason == reason, result.failure
    assert result.failure.phase == v1.PHASE_RUN
    # Noticed while the call was pending, not found after the call's deadline had passed.
    assert result.timing.run.ToSeconds() < TOOL_TIMEOUT_S + CALL_GRACE_S
    if reason == "runtime_stopped":
        assert "while serving" in result.failure.message, result.failure


async def test_deleting_the_runtime_socket_changes_nothing(scripted_llm, start_server) -> None:
    # The server's connection was made before the agent ran: the path is not used again.
    request = math_request("What is 6 * 7?", "42")
    result = await run_job(
        scripted_llm, start_server, request, bash("rm -f /run/prorl/rt.sock; ls -A /run/prorl"), python("print(6 * 7)")
    )
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0
    outputs = [m.content for m in result.trajectory.messages if "<tool_response>" in m.content]
    assert "42" in outputs[1]


async def test_signals_from_inside_cannot_end_the_container(scripted_llm, start_server) -> None:
    # The runtime's parent is the container's init: nothing inside may signal it.
    request = math_request("What is 6 * 7?", "42")
    result = await run_job(
        scripted_llm,
        start_server,
        request,
        bash("for s in TERM INT HUP KILL STOP; do kill -$s 1; done; sleep 0.5; echo still here"),
        python("print(6 * 7)"),
    )
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0
    assert "still here" in result.trajectory.messages[3].content


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_a_container_ended_from_outside_stays_infrastructure(
    how: str, scripted_llm, start_server, podman_url
) -> None:
    llm = await scripted_llm(calls(bash("sleep 60")))
    _, client = await start_server(llm.base_url)
    await client.submit(math_request("What is 6 * 7?", job_id=f"outside-{how}"))

    async def sleeping() -> bool:
        job = await client.get_job(f"outside-{how}")
        return job.phase == v1.PHASE_RUN and len(llm.requests) >= 1 and bool(job_containers(podman_url, job.job_id))

    await assert_eventually(sleeping)
    (container,) = job_containers(podman_url, f"outside-{how}")

    def end_it() -> None:
        with PodmanClient(base_url=podman_url) as podman:
            target = podman.containers.get(container.id)
            target.kill(signal="SIGKILL") if how == "kill" else target.stop(timeout=5)

    await asyncio.to_thread(end_it)
    result = [e async for e in client.watch(f"outside-{how}")][-1].finished.result
    assert result.status == v1.JOB_STATUS_FAILED
    assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE, result.failure
    assert result.failure.reason == "sandbox_lost"


async def test_viewing_a_70_mb_file_is_capped_and_the_job_stays_readable(scripted_llm, start_server) -> None:
    task = load_task(TASKS_DIR / "kjd__idna-3.8")
    request = v1.RolloutRequest(handler="swe", job_id="big-view")
    request.instance.update({key: value for key, value in task.items() if key != "patch"})
    view = ("str_replace_editor", {"command": "view", "path": "/var/tmp/big.txt"})
    llm = await scripted_llm(
        calls(bash("yes 'a line of the big file' | head -c 70000000 > /var/tmp/big.txt; ls -l /var/tmp/big.txt"), view)
    )
    server, client = await start_server(llm.base_url)
    await client.submit(request)
    # A plain gRPC channel: the default 4 MiB message limit, as most trainers have it.
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = v1.RolloutServiceStub(channel)
        events = [response.event async for response in stub.Watch(v1.WatchRequest(job_id="big-view"))]
        job = (await stub.GetJob(v1.GetJobRequest(job_id="big-view"))).job
        assert (await stub.ListJobs(v1.ListJobsRequest())).jobs  # the server still answers

    assert job.status == v1.JOB_STATUS_SUCCEEDED, job.result.failure
    shown = [e.tool_result for e in events if e.HasField("tool_result") and e.tool_result.name == view[0]]
    assert len(shown) == 1 and shown[0].truncated
    assert len(shown[0].output.encode()) < 66 * 1024  # the sandbox's 64 KiB cap, head and tail
    assert "     1\ta line of the big file" in shown[0].output
    assert "bytes of output truncated" in shown[0].output
    model_saw = llm.requests[2]["messages"][-1]["content"]
    assert len(model_saw.encode()) < 66 * 1024
    assert all(event.ByteSize() < GRPC_DEFAULT_MAX_MESSAGE for event in events)
    assert job.ByteSize() < GRPC_DEFAULT_MAX_MESSAGE


async def test_an_swe_agent_that_breaks_its_repository_fails_as_policy(scripted_llm, start_server) -> None:
    """The submission is the repository's git diff: an agent that deletes .git makes
    it impossible, and that is its doing (init saw git work), not infrastructure."""
    task = load_task(TASKS_DIR / "kjd__idna-3.8")
    request = v1.RolloutRequest(handler="swe", job_id="no-git")
    request.instance.update({key: value for key, value in task.items() if key != "patch"})
    result = await run_job(scripted_llm, start_server, request, bash("rm -rf /testbed/.git"))
    assert result.status == v1.JOB_STATUS_FAILED, result
    assert result.failure.kind == v1.FAILURE_KIND_POLICY, result.failure
    assert result.failure.reason == "swe_diff_failed"
