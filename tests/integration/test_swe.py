"""The SWE family on the shipped tasks (real projects, real upstream fixes
reverted): the gold patch resolves each task, an empty patch does not, and the
submission is the repository's own diff, whatever the model says. SymPy's task,
whose judged run is minutes of one core over a whole test file, is judged in
tests/integration/test_swe_runners.py instead: its gold patch on the real task
(graded as SWE-bench grades it), gold and empty on a small variant."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_client import v1
from prorl_server.datasets.swe import load_task, task_dirs
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index

pytestmark = pytest.mark.podman

TASKS = {task_dir.name: load_task(task_dir) for task_dir in task_dirs()}
JUDGED_ELSEWHERE = {"sympy__sympy-1.13.3"}


def swe_request(instance: dict[str, Any]) -> v1.RolloutRequest:
    request = v1.RolloutRequest(handler="swe")
    request.instance.update({key: value for key, value in instance.items() if key != "patch"})
    return request


def script_of(*replies: str) -> Any:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply(replies[min(turn_index(messages), len(replies) - 1)])

    return script


def apply_gold(instance: dict[str, Any]) -> Any:
    """The agent writes the upstream fix with the editor and applies it with git."""
    return script_of(
        tool_call_text(
            "str_replace_editor", {"command": "create", "path": "/tmp/fix.patch", "file_text": instance["patch"]}
        ),
        tool_call_text("bash", {"command": "cd /testbed && git apply /tmp/fix.patch && git status --short"}),
        tool_call_text("finish", {}),
    )


async def run_swe(client: Any, instance: dict[str, Any]) -> tuple[v1.RolloutResult, list[v1.RolloutEvent]]:
    events = [event async for event in client.rollout(swe_request(instance))]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    return result, events


@pytest.mark.parametrize("name", sorted(set(TASKS) - JUDGED_ELSEWHERE))
async def test_gold_patch_resolves_and_empty_patch_does_not(name: str, scripted_llm, start_server) -> None:
    """Both rollouts at once, each on a server of its own: they need not wait for each other."""
    instance = TASKS[name]
    gold = await scripted_llm(apply_gold(instance))
    empty = await scripted_llm(script_of(tool_call_text("finish", {})))
    _, gold_client = await start_server(gold.base_url)
    _, empty_client = await start_server(empty.base_url)
    (result, _), (empty_result, _) = await asyncio.gather(
        run_swe(gold_client, instance), run_swe(empty_client, instance)
    )
    assert result.reward == 1.0, result.details
    assert result.details["verdict"] == "resolved"
    assert set(result.details["fail_to_pass"].values()) == {"PASSED"}
    assert result.details["pass_to_pass_passed"] == len(instance["PASS_TO_PASS"])
    assert result.details["patch"] == instance["patch"]  # the repository's diff is exactly the upstream fix

    result = empty_result
    assert result.reward == 0.0
    assert result.details["verdict"] == "unresolved" and result.details["patch"] == ""
    # the upstream test really catches the bug (MISSING: Django's test module does not even import)
    assert set(result.details["fail_to_pass"].values()) & {"FAILED", "MISSING"}
    assert result.details["pass_to_pass_failing"] == []


async def test_the_submission_is_the_repository_diff_not_the_model_text(scripted_llm, start_server) -> None:
    instance = TASKS["more-itertools__more-itertools-10.8.0"]
    bogus = "diff --git a/setup.py b/setup.py\n--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-x\n+y\n"
    llm = await scripted_llm(
        script_of(
            tool_call_text(
                "str_replace_editor",
                {
                    "command": "str_replace",
                    "path": "/testbed/more_itertools/more.py",
                    "old_str": "        if hasattr(iterable, '__reversed__'):",
                    "new_str": "        if getattr(iterable, '__reversed__', None):",
                },
            ),
            tool_call_text("bash", {"command": "echo scratch > /testbed/notes.txt"}),
            tool_call_text("finish", {"summary": f"Here is my patch:\n{bogus}"}),
        )
    )
    _, client = await start_server(llm.base_url)
    result, events = await run_swe(client, instance)
    patch = result.details["patch"]
    assert "+        if getattr(iterable, '__reversed__', None):" in patch
    assert "b/notes.txt" in patch  # new files are part of the diff too
    assert "setup.py" not in patch
    assert result.reward == 1.0 and result.details["verdict"] == "resolved"
    edits = [e.tool_result for e in events if e.HasField("tool_result")]
    assert "Edited /testbed/more_itertools/more.py" in edits[0].output


async def test_a_patch_that_does_not_apply_scores_zero(scripted_llm, start_server) -> None:
    instance = TASKS["r1chardj0n3s__parse-1.20.2"]
    llm = await scripted_llm(
        script_of(
            tool_call_text("bash", {"command": "cd /testbed && git rm -q --cached parse.py && rm parse.py"}),
            tool_call_text("finish", {}),
        )
    )
    _, client = await start_server(llm.base_url)
    result, _ = await run_swe(client, instance)
    assert result.reward == 0.0
    assert result.details["verdict"] in {"unresolved", "patch_does_not_apply"}
    assert "deleted file mode" in result.details["patch"]


async def test_an_image_without_the_base_commit_is_an_infrastructure_failure(scripted_llm, start_server) -> None:
    instance = {**TASKS["kjd__idna-3.8"], "base_commit": "deadbeef"}
    llm = await scripted_llm(script_of(tool_call_text("finish", {})))
    _, client = await start_server(llm.base_url)
    events = [event async for event in client.rollout(swe_request(instance))]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_FAILED
    assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE and result.failure.reason == "swe_image_mismatch"
    assert "deadbeef" in result.failure.message


async def test_tests_that_hang_are_cut_at_the_eval_time_limit(scripted_llm, start_server) -> None:
    instance = {**TASKS["kjd__idna-3.8"], "eval_timeout_s": 3}
    llm = await scripted_llm(
        script_of(
            # In the code under test: a conftest.py would be reverted before the tests run.
            tool_call_text("bash", {"command": "echo 'import time; time.sleep(600)' >> /testbed/idna/core.py"}),
            tool_call_text("finish", {}),
        )
    )
    _, client = await start_server(llm.base_url)
    result, _ = await run_swe(client, instance)
    assert result.reward == 0.0 and result.details["verdict"] == "tests_timed_out"
