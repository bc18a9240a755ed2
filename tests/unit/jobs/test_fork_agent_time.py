"""A fork of a terminal job goes on with the agent time its parent had left at the branch.

A Harbor task's `agent_timeout_s` is the agent's time for the whole task. A fork (ForkJob)
after turn k is the same task continued: its agent has what the parent's had left after
turn k, so it stops at the same total agent time as the parent did (or would have), and the
fork's work (the snapshot at each boundary, the restore) counts as neither's time.

On a real server (real gRPC, the real in-sandbox runtime in fake sandboxes, the shipped
hello-world task) with a scripted policy (a fake, named so): turn 0 sleeps SPENT_S, turn 1
sleeps SECOND_S and then writes the right hello file, turn 2 finishes. SPENT_S + SECOND_S is
over the task's AGENT_TIMEOUT_S, SECOND_S alone is not: the parent is stopped in turn 1; a
fork after turn 0 is stopped there too, where with the whole agent_timeout_s again it would
have finished its sleep, written the file and scored 1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import Client, v1
from prorl_server.agents import terminal
from prorl_server.agents.base import RolloutContext
from prorl_server.app import ProrlServer
from prorl_server.jobs.phase_runner import BudgetClock
from tests.conftest import TEST_STATE_DIR, instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, turn_index
from tests.helpers import server_settings
from tests.unit.agents.test_families_fast import leftovers
from tests.unit.agents.test_terminal_family import (
    TASKS,
    image_setup,
    instance_on_host,
    on_host,
    paths,
    terminal_context,
)

SPENT_S = 4.0
"""The parent's agent time in turn 0 (a sleep): what a fork after turn 0 must not get again."""
SECOND_S = 5.0
"""Turn 1's sleep before it writes the right file: within AGENT_TIMEOUT_S, not within what is left."""
AGENT_TIMEOUT_S = 8.0


class Served:
    """A server over fake sandboxes of the terminal tasks' images and the scripted policy."""

    def __init__(self, provider: FakeSandboxProvider) -> None:
        self.provider = provider
        app = paths(provider)["/app"]
        self.turns = [
            f"cd {app} && sleep {SPENT_S:g}",
            f"cd {app} && sleep {SECOND_S:g} && " + on_host("echo 'Hello, world!' > /app/hello.txt", provider),
        ]
        self.backend = ScriptedChatBackend(self.script)
        settings = server_settings(sandbox={"state_dir": str(TEST_STATE_DIR)})
        self.server = ProrlServer(settings, sandbox_provider=provider, backends=[self.backend])

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn < len(self.turns):
            return ScriptedReply(tool_call_text("bash", {"command": self.turns[turn]}))
        return ScriptedReply(tool_call_text("finish", {}))

    def request(self, job_id: str) -> v1.RolloutRequest:
        request = v1.RolloutRequest(job_id=job_id, handler="terminal", forkable=True)
        request.instance.update({**instance_on_host("hello-world", self.provider), "agent_timeout_s": AGENT_TIMEOUT_S})
        request.limits.max_turns = 5
        request.limits.tool_timeout.FromSeconds(600)  # the agent's time, not a tool's, stops the sleep
        return request

    async def result(self, client: Client, job_id: str) -> v1.RolloutResult:
        events = [event async for event in client.watch(job_id)]
        return events[-1].finished.result


@pytest_asyncio.fixture
async def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> AsyncIterator[Served]:
    # Host paths of this test's own (the fake sandboxes are folders of this host).
    monkeypatch.setattr(terminal, "STATE_PATH", str(tmp_path / "state.tar"))
    images = {instance["image"]: image_setup(task_id) for task_id, instance in TASKS.items()}
    provider = FakeSandboxProvider(images=images, instance_id=instance_id("ftime"), fixed_workdir=True)
    await provider.start()
    monkeypatch.setattr(terminal, "LOGS_DIRS", (str(provider.workdir / "logs" / "verifier"),))
    served = Served(provider)
    await served.server.start()
    yield served
    await served.server.stop()
    await provider.close()
    assert provider.busy == 0 and leftovers(provider) == []


async def test_a_fork_has_the_agent_time_its_parent_had_left(served: Served) -> None:
    client = Client.connect(served.server.address)
    try:
        await client.submit(served.request("parent"))
        parent = await served.result(client, "parent")  # finished first: the fake's one workdir is free
        response = await client.fork_job("parent", 0, [v1.ForkBranch(job_id="fork")])
        assert list(response.created) == [True]
        fork = await served.result(client, "fork")
    finally:
        await client.close()

    assert parent.status == v1.JOB_STATUS_SUCCEEDED, parent.failure
    assert dict(parent.details)["stop_reason"] == "agent_timeout"
    assert "agent_time_carried_s" not in dict(parent.details)  # not a fork

    assert fork.status == v1.JOB_STATUS_SUCCEEDED, fork.failure
    assert (fork.fork_origin.parent_job_id, fork.fork_origin.parent_turn) == ("parent", 0)
    details = dict(fork.details)
    # The fork's agent is stopped in its own turn 1, as the parent's was, and is judged on what it
    # left: no hello file. With the whole agent_timeout_s again it would have scored 1.
    assert details["stop_reason"] == "agent_timeout", details
    assert fork.reward == 0.0 and details["verdict"] == "failed"
    assert statuses_of(details)["test_outputs.py::test_hello_file_exists"] == "FAILED"
    assert fork.trajectory.num_turns == 2  # the parent's turn 0 and its own interrupted turn 1
    # The parent's turn 0 took at least its sleep of the agent's time, and the fork says so.
    assert SPENT_S <= details["agent_time_carried_s"] < AGENT_TIMEOUT_S


def statuses_of(details: dict[str, Any]) -> dict[str, str]:
    return {test.rsplit("/", 1)[-1]: str(status) for test, status in dict(details["tests"]).items()}


def context(clock: BudgetClock | None = None) -> RolloutContext[Any]:
    return terminal_context("time", clock)


async def test_a_time_limit_goes_on_from_the_time_already_used() -> None:
    ctx = context()
    assert ctx.time_used_s is None  # no limit
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(600):  # a guard: the limit below ends the sleep long before
            async with ctx.time_limit(3600, used_s=3599.8) as deadline:
                used = ctx.time_used_s
                assert used is not None and 3599.8 <= used <= 3600
                assert ctx.tool_timeout_s <= 0.2  # a tool call gets only what is left
                await asyncio.sleep(3600)
    assert deadline.expired()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(600), ctx.time_limit(60, used_s=100) as over:  # used up: stopped at once
            await asyncio.sleep(3600)
    assert over.expired()


async def test_the_jobs_own_work_is_not_the_agents_time() -> None:
    clock = BudgetClock()
    ctx = context(clock)
    async with ctx.time_limit(0.5) as deadline:
        with ctx.time_stopped():  # e.g. a fork's snapshot at a turn boundary
            await asyncio.sleep(1.0)  # past the limit, which stands still meanwhile
        assert not deadline.expired()
        used = ctx.time_used_s
        assert used is not None and used < 0.5
        with clock.waiting_for_model(), ctx.time_stopped():  # stopped by the clock already: left to it
            await asyncio.sleep(0.6)
        assert not deadline.expired()
    assert ctx.time_used_s is None
