"""The SWE family's pure parts: instance validation, the patch's file list, and
grading a harness verdict (test outcomes: tests/unit/sandbox/test_judge.py)."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from prorl_server.agents.swe import SWEHandler, node_ids
from prorl_server.datasets.swe import load_task, task_dirs, to_task
from prorl_server.errors import InfrastructureError, InvalidArgument
from prorl_server.sandbox.base import JudgeResult, Sandbox
from prorl_server.verifiers.swe import _graded, judge, patched_files, runner_command

INSTANCE: dict[str, Any] = {
    "instance_id": "owner__proj-1.0",
    "repo": "owner/proj",
    "base_commit": "0123456789abcdef0123456789abcdef01234567",
    "problem_statement": "It breaks.",
    "image": "localhost/prorl-swe-owner__proj-1.0:latest",
    "test_patch": "",
    "FAIL_TO_PASS": ["tests/test_a.py::test_bug"],
    "PASS_TO_PASS": [],
}


def test_patched_files_names_old_and_new_paths() -> None:
    patch = (
        "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n+++ b/tests/test_a.py\n"
        "diff --git a/old.py b/new.py\nsimilarity index 90%\n"
    )
    assert patched_files(patch) == ["tests/test_a.py", "old.py", "new.py"]
    assert patched_files("--- a/lib.py\n+++ b/lib.py\n@@ -1 +1 @@\n") == ["lib.py"]  # plain unified diff


def test_lists_may_be_json_strings_as_in_published_datasets() -> None:
    assert node_ids({"FAIL_TO_PASS": json.dumps(["t::a", "t::b"])}, "FAIL_TO_PASS") == ["t::a", "t::b"]
    assert node_ids({}, "PASS_TO_PASS") == []
    with pytest.raises(InvalidArgument, match="not a JSON list"):
        node_ids({"FAIL_TO_PASS": "[t::a"}, "FAIL_TO_PASS")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"image": ""}, "'image'"),
        ({"base_commit": "HEAD~1; rm -rf /"}, "hex commit"),
        ({"FAIL_TO_PASS": []}, "at least one test"),
        ({"PASS_TO_PASS": [3]}, "node ids"),
        ({"repo_dir": "testbed"}, "absolute path"),
        ({"eval_timeout_s": 0}, "eval_timeout_s"),
        ({"test_patch": 7}, "'test_patch'"),
    ],
)
def test_bad_instances_are_named(change: dict[str, Any], message: str) -> None:
    SWEHandler().validate(INSTANCE)
    with pytest.raises(InvalidArgument, match=message):
        SWEHandler().validate({**INSTANCE, **change})


def test_the_image_comes_from_the_instance() -> None:
    handler = SWEHandler()
    assert handler.image_for(handler.validate(INSTANCE)) == INSTANCE["image"]


def test_shipped_tasks_are_complete_and_hide_the_gold_patch() -> None:
    dirs = task_dirs()
    assert len(dirs) >= 3
    for task_dir in dirs:
        instance = load_task(task_dir)
        SWEHandler().validate(instance)
        assert instance["patch"].startswith("diff --git") and instance["test_patch"].startswith("diff --git")
        assert not set(patched_files(instance["patch"])) & set(patched_files(instance["test_patch"]))
        line = to_task(instance)
        assert line["handler"] == "swe" and "patch" not in line["instance"]
        assert line["instance"]["test_patch"] == instance["test_patch"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"repo": "sphinx-doc/sphinx", "version": "3.5"}, "with tox"),
        ({"repo": "django/django", "version": "9.9"}, "swebench defines no evaluation for django/django version"),
        ({"eval_script": "pytest -rA", "log_parser": "parse_log_pytest"}, "does not bracket its test output"),
        (
            {"eval_script": ": '>>>>> Start Test Output'\npython tests/runtests.py x\n: '>>>>> End Test Output'"},
            "the judge does not run 'python tests/runtests.py x'",
        ),
    ],
)
def test_instances_the_judge_would_score_wrongly_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SWEHandler().validate({**INSTANCE, "log_parser": "parse_log_django", **change})


@pytest.mark.parametrize(
    ("change", "runner", "args"),
    [
        (
            {"repo": "django/django", "version": "3.0"},
            "django",
            ["--verbosity", "2", "--settings=test_sqlite", "--parallel", "1"],
        ),
        ({"repo": "sympy/sympy", "version": "1.4"}, "sympy", ["-C", "--verbose"]),
        (
            {"eval_script": ": '>>>>> Start Test Output'\n./tests/runtests.py x\n: '>>>>> End Test Output'"},
            "django",
            ["x"],
        ),
    ],
)
def test_django_and_sympy_instances_are_judged_by_their_runners(
    change: dict[str, Any], runner: str, args: list[str]
) -> None:
    instance = SWEHandler().validate({**INSTANCE, "log_parser": "parse_log_django", **change})
    evaluation = instance.evaluation()
    assert evaluation is not None and evaluation.runner == runner
    command = runner_command(evaluation, instance.test_patch)
    assert command.runner == runner and command.args[: len(args)] == args


@pytest.mark.parametrize(
    "change",
    [
        {"repo": "astropy/astropy", "version": "4.3"},
        {"repo": "pytest-dev/pytest", "version": "99.0"},
        {"repo": "getmoto/moto", "version": "5.0"},
        {
            "eval_script": ": '>>>>> Start Test Output'\npytest -rA t.py\n: '>>>>> End Test Output'",
            "log_parser": "parse_log_pytest",
        },
    ],
)
def test_instances_judged_by_pytest_are_accepted(change: dict[str, Any]) -> None:
    assert SWEHandler().validate({**INSTANCE, **change}).repo


def test_a_pytest_repository_of_swebench_is_graded_with_its_official_parser() -> None:
    """psf/requests' official parser is parse_log_requests: the judge's pytest log goes through it."""
    instance = SWEHandler().validate({**INSTANCE, "repo": "psf/requests", "version": "2.0"})
    evaluation = instance.evaluation()
    assert evaluation is not None and (evaluation.runner, evaluation.log_parser) == ("pytest", "parse_log_requests")
    tests = ["t.py::test_fixed", "t.py::test_kept"]
    printed = "".join(f"PASSED {test}\n" for test in tests)
    outcome = {
        "stage": "tests", "ok": True, "complete": True, "exitstatus": 0, "exit_code": 0,
        "statuses": dict.fromkeys(tests, "PASSED"), "log": printed,
    }  # fmt: skip
    verdict = _graded(outcome, evaluation, True, tests[:1], tests[1:], "", {})
    assert verdict.resolved and verdict.fail_to_pass == {"t.py::test_fixed": "PASSED"}
    forged = _graded(
        {**outcome, "statuses": {"t.py::test_kept": "PASSED"}}, evaluation, True, tests[:1], tests[1:], "", {}
    )
    assert not forged.resolved and forged.verdict == "tampered"  # the log's PASSED line, unreported by pytest


def pytest_outcome(statuses: dict[str, str]) -> dict[str, Any]:
    """A complete pytest run of the harness whose log and reporter agree on `statuses`."""
    printed = "".join(f"{status} {test}\n" for test, status in statuses.items())
    return {
        "stage": "tests", "ok": True, "complete": True, "exitstatus": 0, "exit_code": 0,
        "statuses": dict(statuses), "log": printed,
    }  # fmt: skip


@pytest.mark.parametrize("status", ["XFAIL", "SKIPPED", "XPASS"])
@pytest.mark.parametrize("where", ["fail_to_pass", "pass_to_pass"])
def test_only_a_pass_is_a_pass(status: str, where: str) -> None:
    """An XFAIL, a skip or an XPASS never resolves (the code under test can call
    pytest.xfail() or pytest.skip()); SWE-bench's grading, behind swebench_grading,
    takes an XFAIL for a pass and keeps a skipped PASS_TO_PASS test."""
    fixed, kept = "t.py::test_fixed", "t.py::test_kept"
    statuses = {fixed: "PASSED", kept: "PASSED"}
    statuses[fixed if where == "fail_to_pass" else kept] = status
    outcome = pytest_outcome(statuses)
    strict = _graded(outcome, None, True, [fixed], [kept], "", {})
    assert not strict.resolved and strict.verdict == "unresolved" and strict.grading == "strict"
    compatible = _graded(outcome, None, True, [fixed], [kept], "", {}, swebench_grading=True)
    swebench_passes = status == "XFAIL" or (status == "SKIPPED" and where == "pass_to_pass")
    assert compatible.resolved == swebench_passes, compatible


def test_a_logged_pass_over_a_reported_xfail_is_tampering() -> None:
    """The log says PASSED where the reporter said XFAIL: a forged line under the default grading."""
    fixed = "t.py::test_fixed"
    outcome = {**pytest_outcome({fixed: "PASSED"}), "statuses": {fixed: "XFAIL"}}
    assert _graded(outcome, None, True, [fixed], [], "", {}).verdict == "tampered"
    assert _graded(outcome, None, True, [fixed], [], "", {}, swebench_grading=True).resolved


def test_swebench_grading_is_off_unless_asked_for() -> None:
    assert SWEHandler().validate(INSTANCE).swebench_grading is False
    assert SWEHandler().validate({**INSTANCE, "swebench_grading": True}).swebench_grading is True
    with pytest.raises(InvalidArgument, match="swebench_grading"):
        SWEHandler().validate({**INSTANCE, "swebench_grading": "yes"})


class ScriptedHarness:
    """A scripted stand-in for a sandbox whose judging harness gives `verdict`."""

    def __init__(self, verdict: dict[str, Any]) -> None:
        self.verdict = verdict

    async def judge(self, mode: str, spec: Any, *, timeout_s: float) -> JudgeResult:
        return JudgeResult(self.verdict, output="log")


async def judged(verdict: dict[str, Any]) -> Any:
    return await judge(
        cast(Sandbox, ScriptedHarness(verdict)), repo_dir="/testbed", base_commit="0" * 40, patch="x",
        test_patch="y", fail_to_pass=["t.py::a"], pass_to_pass=[], pythonpath="", timeout_s=10,
    )  # fmt: skip


async def test_a_test_patch_the_models_patch_blocks_is_the_policys_failure() -> None:
    """It applies at the base commit, not after the model's patch: reward 0, never infrastructure."""
    blocked = await judged({"stage": "test_patch", "ok": False, "output": "error", "applies_at_base": True})
    assert not blocked.resolved and blocked.verdict == "test_patch_blocked" and "applies at" in blocked.reason
    with pytest.raises(InfrastructureError, match="does not apply") as caught:
        await judged({"stage": "test_patch", "ok": False, "output": "error", "applies_at_base": False})
    assert caught.value.reason == "swe_test_patch"  # the task's own fault


def test_tampering_caught_before_the_time_ran_out_is_tampering() -> None:
    """A trace function slows every test down: the run is caught, then times out."""
    fixed = "t.py::test_fixed"
    outcome = {**pytest_outcome({fixed: "PASSED"}), "complete": False, "timed_out": True}
    assert _graded(outcome, None, True, [fixed], [], "", {}).verdict == "tests_timed_out"
    caught = {**outcome, "anomalies": ["the test run was tampered with: ['a trace function set by ...']"]}
    assert _graded(caught, None, True, [fixed], [], "", {}).verdict == "tampered"
