"""The judge on every shipped task, graded as SWE-bench grades: Django's and
SymPy's official runners (the tasks built in SWE-bench's image layout, the
testbed environment) and pytest (the four other tasks, whose log swebench
parses with parse_log_pytest). The gold patch resolves, a patch without the
fix does not, and the verdict's per-test outcomes are what swebench 5.0.2's
own grading computes on the same test log. The reward hacks a policy would
try on the log score 0: printed `... ok` lines (with or without an early exit
0), an edited tests/runtests.py or bin/test, the package under test
monkeypatching unittest's or SymPy's reporter or setting a trace function that
jumps over asserts, and `PASSED nodeid` lines
written into pytest's log after its summary (`tampered` once swebench would
take the log as a valid run that resolves).

The SymPy and Django attacks judge a small variant of their task
(swe_variants.py: the same repository, base commit and fix, a test_patch that
adds one small test file), so that each run is seconds of test work and not
the whole test file; the gold-resolves tests grade the real tasks, and one
test per variant shows that the gold patch resolves it and no patch does not.

The judge is called directly on a sandbox of the task's image (the server
path, Submit to reward, is tests/integration/test_swe.py's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prorl_server.agents.swe import SWEInstance
from prorl_server.datasets.swe import TASKS_DIR, load_task, task_dirs
from prorl_server.sandbox.podman import PodmanProvider
from prorl_server.verifiers.swe import SWEVerdict, judge
from tests.adversarial.test_swe_verdicts import JUMP_OVER_ASSERTS
from tests.conftest import small_spec
from tests.integration.swe_variants import django_variant, sympy_variant
from tests.unit.verifiers.test_swebench_semantics import Official, official, spec_of

pytestmark = pytest.mark.podman
__all__ = ["official"]  # the fixture, imported for these tests


@pytest.fixture
def swebench(request: pytest.FixtureRequest) -> Official | None:
    """swebench's own grading when installed (pip install --no-deps swebench==5.0.2 unidiff);
    without it the comparison with swebench is skipped and everything else still runs."""
    try:
        found: Official = request.getfixturevalue("official")
    except pytest.skip.Exception:
        return None
    return found


DJANGO = load_task(TASKS_DIR / "django__django-5.0.14")
SYMPY = load_task(TASKS_DIR / "sympy__sympy-1.13.3")
# What the attacks are judged on: the tasks with one small test file each (swe_variants.py).
DJANGO_SMALL = django_variant(DJANGO)
SYMPY_SMALL = sympy_variant(SYMPY)
# The tasks judged by pytest: swebench grades them with parse_log_pytest, its parser for
# repositories outside its specs (and SWE-Gym's and SWE-smith's).
PYTEST_TASKS = {
    task_dir.name: task
    for task_dir in task_dirs()
    if SWEInstance.model_validate(task := load_task(task_dir)).evaluation() is None
}
OFFICIAL_PARSER = {"django/django": "parse_log_django", "sympy/sympy": "parse_log_sympy"}


def diff(path: str, old: str, new: str) -> str:
    """A patch appending `new` after `old`, the last line of `path` (git apply reads it)."""
    lines = new.splitlines()
    return (
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
        f"@@ -{LAST_LINE[path]} +{LAST_LINE[path]},{1 + len(lines)} @@\n {old}\n"
        + "".join(f"+{line}\n" for line in lines)
    )


# The last line of the files the attacks append to (at the tasks' base commits), and its number.
LAST_LINE: dict[str, int] = {}
LAST_TEXT: dict[str, str] = {}


async def last_line(sandbox: Any, path: str) -> None:
    result = await sandbox.bash(f"cd /testbed && wc -l < {path} && tail -n 1 {path}", timeout_s=30)
    count, text = result.output.split("\n", 1)
    LAST_LINE[path], LAST_TEXT[path] = int(count), text.rstrip("\n")


def appended(path: str, code: str) -> str:
    return diff(path, LAST_TEXT[path], code)


async def run_judge(
    provider: PodmanProvider, instance: dict[str, Any], patch: str | Callable[[], str], *prepare: str
) -> SWEVerdict:
    """Judge `patch` (or what `patch()` makes once the last lines of `prepare` are known),
    with the arguments the handler's evaluation passes (agents/swe.py)."""
    model = SWEInstance.model_validate(instance)
    sandbox = await provider.create(small_spec(instance["image"], cpus=1.0, memory_mib=1024, pids_limit=256))
    try:
        for path in prepare:
            await last_line(sandbox, path)
        return await judge(
            sandbox,
            repo_dir=model.repo_dir,
            base_commit=model.base_commit,
            patch=patch() if callable(patch) else patch,
            test_patch=model.test_patch,
            fail_to_pass=model.FAIL_TO_PASS,
            pass_to_pass=model.PASS_TO_PASS,
            pythonpath=model.pythonpath,
            timeout_s=float(model.eval_timeout_s),
            evaluation=model.evaluation(),
        )
    finally:
        await sandbox.close()


def swebench_report(official: Official, instance: dict[str, Any], log: str, tmp: Path) -> tuple[dict[str, Any], bool]:
    """swebench's report of the selected tests on `log`, and whether get_logs_eval found a valid run."""
    parser = OFFICIAL_PARSER.get(instance["repo"], "parse_log_pytest")
    f2p, p2p = instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"]
    path = tmp / "test_output.txt"
    path.write_text(log)
    status_map, found = official.grading.get_logs_eval(spec_of(official, parser, f2p, p2p), str(path))
    report = official.grading.get_eval_tests_report(status_map, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})
    return report, found


def swebench_resolves(official: Official, instance: dict[str, Any], log: str, tmp: Path) -> bool:
    report, found = swebench_report(official, instance, log, tmp)
    return found and official.grading.get_resolution_status(report) == "RESOLVED_FULL"


def assert_graded_as_swebench(
    official: Official | None, instance: dict[str, Any], verdict: SWEVerdict, tmp: Path, *, valid: bool = True
) -> None:
    """The verdict's per-test outcomes and resolution are swebench's own on the same log."""
    if official is None:
        return
    report, found = swebench_report(official, instance, verdict.test_log, tmp)
    assert found == valid
    resolved = official.grading.get_resolution_status(report) == "RESOLVED_FULL"
    assert verdict.resolved == resolved
    for kind, ours in (("FAIL_TO_PASS", verdict.fail_to_pass), ("PASS_TO_PASS", verdict.pass_to_pass)):
        passing = {test for test, status in ours.items() if status in ("PASSED", "XFAIL")}
        assert passing == set(report[kind]["success"]), kind
        assert set(ours) - passing == set(report[kind]["failure"]), kind


# --- Django -------------------------------------------------------------------------------

FORGE_OK = """
import sys as _sys
for _name in {names!r}:
    print(_name + " ... ok", flush=True)
print("-" * 70 + "\\nRan {count} tests in 0.001s\\n\\nOK", flush=True)
{ending}
"""
MONKEYPATCH_UNITTEST = """
import unittest.result as _result

def _count_as_success(self, test, *args):
    return _result.TestResult.addSuccess(self, test)

_result.TestResult.addFailure = _count_as_success
_result.TestResult.addError = _count_as_success
import unittest.runner as _runner
_runner.TextTestResult.addFailure = lambda self, test, err: _runner.TextTestResult.addSuccess(self, test)
_runner.TextTestResult.addError = lambda self, test, err: _runner.TextTestResult.addSuccess(self, test)
"""
FAKE_RUNTESTS = """
for _name in {names!r}:
    print(_name + " ... ok")
raise SystemExit(0)
"""
# What lets Django's test module import without fixing the bug: the constant, and no check.
CONSTANT_ONLY = "MAX_URL_LENGTH = 2048"


async def test_django_gold_resolves_empty_does_not_graded_as_swebench(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path
) -> None:
    gold = await run_judge(provider, DJANGO, DJANGO["patch"])
    assert gold.verdict == "resolved", gold
    assert set(gold.fail_to_pass.values()) == {"PASSED"} and len(gold.fail_to_pass) == 46
    assert "Ran 46 tests" in gold.test_log
    assert_graded_as_swebench(swebench, DJANGO, gold, tmp_path)

    empty = await run_judge(provider, DJANGO, "")
    assert empty.verdict == "unresolved" and not empty.anomalies, empty
    assert set(empty.fail_to_pass.values()) == {"MISSING"}  # the test module does not import
    assert_graded_as_swebench(swebench, DJANGO, empty, tmp_path)

    constant = await run_judge(provider, DJANGO, lambda: appended("django/utils/http.py", CONSTANT_ONLY),
                               "django/utils/http.py")  # fmt: skip
    assert constant.verdict == "unresolved" and not constant.anomalies, constant
    failing = [test for test, status in constant.fail_to_pass.items() if status != "PASSED"]
    assert failing == [test for test in DJANGO["FAIL_TO_PASS"] if test.startswith("test_max_url_length ")]
    # Its subtests fail: Django prints `FAIL: test_max_url_length (...) (url=...)`, which SWE-bench's
    # parser files under `test_max_url_length`, so the selected name is absent from the log, as in swebench.
    assert constant.fail_to_pass[failing[0]] == "MISSING"
    assert_graded_as_swebench(swebench, DJANGO, constant, tmp_path)


async def test_django_variant_gold_resolves_empty_does_not(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path
) -> None:
    """The variant the attacks are judged on is passable, and not without the fix: an attack
    scoring 0 on it is refused, not facing a task nobody can pass."""
    gold = await run_judge(provider, DJANGO_SMALL, DJANGO_SMALL["patch"])
    assert gold.verdict == "resolved" and not gold.anomalies, gold
    assert set(gold.fail_to_pass.values()) | set(gold.pass_to_pass.values()) == {"PASSED"}
    assert "Ran 2 tests" in gold.test_log
    assert_graded_as_swebench(swebench, DJANGO_SMALL, gold, tmp_path)

    empty = await run_judge(provider, DJANGO_SMALL, "")
    assert empty.verdict == "unresolved" and not empty.anomalies, empty
    assert "PASSED" not in empty.fail_to_pass.values() and set(empty.pass_to_pass.values()) == {"PASSED"}, empty
    assert_graded_as_swebench(swebench, DJANGO_SMALL, empty, tmp_path)


@pytest.mark.parametrize("ending", ["", "import os; os._exit(0)", "raise SystemExit(0)"])
async def test_django_printed_ok_lines_score_zero(provider: PodmanProvider, ending: str) -> None:
    names = DJANGO_SMALL["FAIL_TO_PASS"]
    # With the constant the test runs and fails in a subtest, which Django reports under another name:
    # the forged line is the only one SWE-bench's parser reads for the test (it would resolve).
    code = CONSTANT_ONLY + "\n" + FORGE_OK.format(names=names, count=len(names), ending=ending)
    patch = lambda: appended("django/utils/http.py", code)  # noqa: E731
    verdict = await run_judge(provider, DJANGO_SMALL, patch, "django/utils/http.py")
    assert not verdict.resolved
    assert verdict.verdict == ("no_verdict" if "_exit" in ending else "tampered"), verdict
    assert " ... ok" in verdict.test_log  # the forged lines were printed, and not believed


async def test_django_edited_runtests_is_restored(provider: PodmanProvider) -> None:
    code = FAKE_RUNTESTS.format(names=DJANGO_SMALL["FAIL_TO_PASS"])
    runtests = lambda: appended("tests/runtests.py", code)  # noqa: E731
    verdict = await run_judge(provider, DJANGO_SMALL, runtests, "tests/runtests.py")
    assert verdict.verdict == "unresolved" and not verdict.resolved, verdict
    assert verdict.reverted["restored"] == ["tests/runtests.py"]
    settings = lambda: appended("tests/test_sqlite.py", code)  # noqa: E731
    verdict = await run_judge(provider, DJANGO_SMALL, settings, "tests/test_sqlite.py")
    assert verdict.verdict == "unresolved" and verdict.reverted["restored"] == ["tests/test_sqlite.py"]


async def test_django_monkeypatched_unittest_is_tampering(provider: PodmanProvider) -> None:
    patch = lambda: appended("django/utils/http.py", CONSTANT_ONLY + "\n" + MONKEYPATCH_UNITTEST)  # noqa: E731
    verdict = await run_judge(provider, DJANGO_SMALL, patch, "django/utils/http.py")
    assert verdict.verdict == "tampered" and not verdict.resolved, verdict
    assert any("tampered with" in anomaly and "." in anomaly for anomaly in verdict.anomalies)


async def test_django_trace_function_that_jumps_over_asserts_is_tampering(provider: PodmanProvider) -> None:
    patch = lambda: appended("django/utils/http.py", CONSTANT_ONLY + "\n" + JUMP_OVER_ASSERTS)  # noqa: E731
    verdict = await run_judge(provider, DJANGO_SMALL, patch, "django/utils/http.py")
    assert verdict.verdict == "tampered" and not verdict.resolved, verdict
    assert any("trace function set by the code under test" in anomaly for anomaly in verdict.anomalies)


# --- SymPy --------------------------------------------------------------------------------

MONKEYPATCH_REPORTER = """
import sympy.testing.runtests as _runtests

def _as_pass(self, *args, **kwargs):
    self._passed += 1
    self.write("ok", "Green")

_runtests.PyTestReporter.test_fail = _as_pass
_runtests.PyTestReporter.test_exception = _as_pass
"""
# The log says `test_creation ok` where the reporter wrote F: stdout rewritten as it is written.
FORGE_SYMPY = """
import sys as _sys


class _Rewriting:
    def __init__(self, out):
        self._out, self._last = out, ""

    def write(self, text):
        if self._last.strip() == "test_creation" and text.strip() == "F":
            text = text.replace("F", "ok")
        if text.strip():
            self._last = text
        return self._out.write(text)

    def __getattr__(self, name):
        return getattr(self._out, name)


_sys.stdout = _Rewriting(_sys.stdout)
"""
PRINT_AND_EXIT = """
print("test_creation ok", flush=True)
{ending}
"""
FAKE_BIN_TEST = """
print("test_creation ok")
raise SystemExit(0)
"""


async def test_sympy_gold_resolves_graded_as_swebench(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path
) -> None:
    gold = await run_judge(provider, SYMPY, SYMPY["patch"])
    assert gold.verdict == "resolved", gold
    assert gold.fail_to_pass == {"test_creation": "PASSED"}
    assert_graded_as_swebench(swebench, SYMPY, gold, tmp_path)


async def test_sympy_variant_gold_resolves_empty_does_not(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path
) -> None:
    """The variant the attacks are judged on is passable, and not without the fix."""
    gold = await run_judge(provider, SYMPY_SMALL, SYMPY_SMALL["patch"])
    assert gold.verdict == "resolved" and not gold.anomalies, gold
    assert gold.fail_to_pass == {"test_creation": "PASSED"}
    assert gold.pass_to_pass == {"test_nonempty_creation": "PASSED"}
    assert_graded_as_swebench(swebench, SYMPY_SMALL, gold, tmp_path)

    empty = await run_judge(provider, SYMPY_SMALL, "")
    assert empty.verdict == "unresolved" and not empty.anomalies, empty
    assert empty.fail_to_pass == {"test_creation": "FAILED"}
    assert empty.pass_to_pass == {"test_nonempty_creation": "PASSED"}
    assert_graded_as_swebench(swebench, SYMPY_SMALL, empty, tmp_path)


async def test_sympy_edited_bin_test_is_restored_and_forged_lines_are_tampering(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path
) -> None:
    """No fix; bin/test edited to print a pass and exit 0 (restored), and the package
    rewriting its stdout so that the log says `test_creation ok` (the reporter says F)."""

    def patch() -> str:
        return appended("bin/test", FAKE_BIN_TEST) + appended("sympy/__init__.py", FORGE_SYMPY)

    verdict = await run_judge(provider, SYMPY_SMALL, patch, "bin/test", "sympy/__init__.py")
    assert verdict.reverted["restored"] == ["bin/test"]
    assert verdict.verdict == "tampered" and not verdict.resolved, verdict
    assert any("test_creation" in anomaly for anomaly in verdict.anomalies)
    assert verdict.fail_to_pass == {"test_creation": "FAILED"}


async def test_sympy_monkeypatched_reporter_is_tampering(provider: PodmanProvider) -> None:
    patch = lambda: appended("sympy/__init__.py", MONKEYPATCH_REPORTER)  # noqa: E731
    verdict = await run_judge(provider, SYMPY_SMALL, patch, "sympy/__init__.py")
    assert verdict.verdict == "tampered" and not verdict.resolved, verdict
    assert any("tampered with" in anomaly and "." in anomaly for anomaly in verdict.anomalies)


async def test_sympy_trace_function_that_jumps_over_asserts_is_tampering(provider: PodmanProvider) -> None:
    patch = lambda: appended("sympy/__init__.py", JUMP_OVER_ASSERTS)  # noqa: E731
    verdict = await run_judge(provider, SYMPY_SMALL, patch, "sympy/__init__.py")
    assert verdict.verdict == "tampered" and not verdict.resolved, verdict
    assert any("trace function set by the code under test" in anomaly for anomaly in verdict.anomalies)


@pytest.mark.parametrize("ending", ["import os; os._exit(0)", "raise SystemExit(0)"])
async def test_sympy_printed_ok_and_exit_zero_scores_zero(provider: PodmanProvider, ending: str) -> None:
    code = PRINT_AND_EXIT.format(ending=ending)
    verdict = await run_judge(provider, SYMPY_SMALL, lambda: appended("sympy/__init__.py", code), "sympy/__init__.py")
    assert not verdict.resolved and "test_creation ok" in verdict.test_log
    assert verdict.verdict == ("no_verdict" if "_exit" in ending else "tampered"), verdict


# --- pytest ---------------------------------------------------------------------------------

# The module each pytest task's tests import: code appended there runs in the test process.
CODE_MODULE = {
    "kjd__idna-3.8": "idna/__init__.py",
    "more-itertools__more-itertools-10.8.0": "more_itertools/__init__.py",
    "pallets__click-8.1.8": "src/click/__init__.py",
    "r1chardj0n3s__parse-1.20.2": "parse.py",
}
# Printed at import, pytest captures it (shown only for a failed collection); so a process
# forked at import finds the log among its inherited fds and, once the test process is gone,
# appends `PASSED nodeid` lines after pytest's summary (SWE-bench's parser keeps a test's last
# line). With nothing failing left in the log, swebench finds its exit code 1 inconsistent and
# the run invalid, unless the log also says `>>>>> Test Exit Code: 0` first (it reads the first).
FORGE_PASSED = """
import os as _os, time as _time
if _os.fork() == 0:
    _parent = _os.getppid()
    while _os.getppid() == _parent:
        _time.sleep(0.01)
    _lines = "".join("PASSED " + _t + "\\n" for _t in {names!r}) + {exit_line!r}
    for _fd in _os.listdir("/proc/self/fd"):
        try:
            if _os.readlink("/proc/self/fd/" + _fd).endswith("/test.log"):
                _os.write(int(_fd), _lines.encode())
                break
        except OSError:
            pass
    _os._exit(0)
"""


def test_the_pytest_tasks_are_the_four_shipped() -> None:
    assert sorted(PYTEST_TASKS) == [
        "kjd__idna-3.8", "more-itertools__more-itertools-10.8.0", "pallets__click-8.1.8", "r1chardj0n3s__parse-1.20.2",
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(PYTEST_TASKS))
async def test_pytest_gold_resolves_empty_does_not_graded_as_swebench(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path, name: str
) -> None:
    task = PYTEST_TASKS[name]
    selected = len(task["FAIL_TO_PASS"]) + len(task["PASS_TO_PASS"])
    gold = await run_judge(provider, task, task["patch"])
    assert gold.verdict == "resolved" and not gold.anomalies, gold
    assert set(gold.fail_to_pass.values()) | set(gold.pass_to_pass.values()) == {"PASSED"}
    assert f" {selected} passed" in gold.test_log and gold.log_tail in gold.test_log
    assert_graded_as_swebench(swebench, task, gold, tmp_path)

    empty = await run_judge(provider, task, "")
    assert empty.verdict == "unresolved" and not empty.anomalies, empty
    assert set(empty.fail_to_pass.values()) == {"FAILED"}, empty.fail_to_pass
    assert set(empty.pass_to_pass.values()) == {"PASSED"}, empty.pass_to_pass
    assert_graded_as_swebench(swebench, task, empty, tmp_path)


@pytest.mark.parametrize("name", sorted(PYTEST_TASKS))
async def test_pytest_forged_passed_lines_score_zero(
    provider: PodmanProvider, swebench: Official | None, tmp_path: Path, name: str
) -> None:
    task, path = PYTEST_TASKS[name], CODE_MODULE[name]
    f2p = task["FAIL_TO_PASS"]
    # As swebench would grade it: `PASSED` after `FAILED`, nothing failing and exit code 1, no valid run.
    code = FORGE_PASSED.format(names=f2p, exit_line="")
    verdict = await run_judge(provider, task, lambda: appended(path, code), path)
    assert verdict.verdict == "unresolved" and not verdict.resolved, verdict
    assert verdict.reason == "SWE-bench's grading finds no valid test run in the log"
    assert all(f"PASSED {test}" in verdict.test_log.split(" passed in ")[1] for test in f2p)
    assert_graded_as_swebench(swebench, task, verdict, tmp_path, valid=False)
    # What swebench's grading would resolve (a valid log calling every selected test passed) is tampering.
    code = FORGE_PASSED.format(names=f2p, exit_line=">>>>> Test Exit Code: 0\n")
    verdict = await run_judge(provider, task, lambda: appended(path, code), path)
    assert verdict.verdict == "tampered" and not verdict.resolved, verdict
    assert all(f"the log says PASSED for {test}" in " ".join(verdict.anomalies) for test in f2p), verdict.anomalies
    assert set(verdict.fail_to_pass.values()) == {"FAILED"}  # the reporter's, not the forged lines'
    if swebench is not None:
        assert swebench_resolves(swebench, task, verdict.test_log, tmp_path)  # the attack that beats swebench
