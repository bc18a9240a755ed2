"""A fork of a terminal job in real rootless Podman starts from the task's working directory as
the parent left it at the branch.

A Harbor task's workdir (/app, its Dockerfile's WORKDIR) is not the runtime's own (/workspace):
the fork must carry the task's. The scripted policy (a fake, named so) writes the right hello
file in turn 0 and deletes it in turn 1, so the parent scores 0; once the parent is done, it
finishes at once, so a fork after turn 0 is judged on /app as it was after turn 0 (reward 1 only
if that was carried), and a fork after turn 1 on /app without the file (reward 0)."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_client import v1
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.integration.test_terminal import TASKS, solution, statuses

pytestmark = pytest.mark.podman


class Policy:
    def __init__(self) -> None:
        self.parent_done = False
        self.turns = [
            tool_call_text("bash", {"command": f"cd /app && {solution('hello-world')}"}),
            tool_call_text("bash", {"command": "cd /app && echo changed > notes.txt && rm hello.txt"}),
        ]

    def __call__(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if not self.parent_done and turn < len(self.turns):
            return ScriptedReply(self.turns[turn])
        return ScriptedReply(tool_call_text("finish", {}))


async def result_of(client: Any, job_id: str) -> v1.RolloutResult:
    events = [event async for event in client.watch(job_id)]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    return result


async def test_a_fork_is_judged_on_the_task_workdir_as_the_parent_left_it(
    scripted_llm, start_server, podman_url
) -> None:
    policy = Policy()
    llm = await scripted_llm(policy)
    _, client = await start_server(llm.base_url)
    request = v1.RolloutRequest(job_id="term-parent", handler="terminal", forkable=True)
    request.instance.update(TASKS["hello-world"])
    request.limits.max_turns = 5
    await client.submit(request)
    parent = await result_of(client, "term-parent")
    assert parent.reward == 0.0 and parent.trajectory.num_turns == 3, parent.details
    policy.parent_done = True

    await client.fork_job("term-parent", 0, [v1.ForkBranch(job_id="term-after-0")])
    await client.fork_job("term-parent", 1, [v1.ForkBranch(job_id="term-after-1")])
    after_0, after_1 = await result_of(client, "term-after-0"), await result_of(client, "term-after-1")

    assert after_0.reward == 1.0 and set(statuses(after_0).values()) == {"PASSED"}, after_0.details
    events = [event async for event in client.watch("term-after-0")]
    forked = next(event.forked for event in events if event.HasField("forked"))
    assert "/app" in forked.carried_paths, forked
    assert after_1.reward == 0.0, after_1.details
    assert statuses(after_1)["test_outputs.py::test_hello_file_exists"] == "FAILED"
    for job_id in ("term-parent", "term-after-0", "term-after-1"):
        assert not job_containers(podman_url, job_id)
