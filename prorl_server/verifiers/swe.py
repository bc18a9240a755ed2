"""SWE-bench-style judging: apply a patch to the repository at its base commit
in a fresh sandbox, put the task's tests in place, run FAIL_TO_PASS and
PASS_TO_PASS with pytest, and resolve only if every one of them passes.

The judging harness (sandbox/runtime/prorl_judge.py, mode `swe`) does the
steps in the sandbox, following SWE-bench's harness with the holes closed:
1. apply the model's patch (`patch_does_not_apply` if it does not);
2. restore what the patch changed among the files pytest or Python would load
   as configuration or plugins, matched in any case and anywhere in the
   repository (any conftest.py, pytest.ini, tox.ini, setup.cfg,
   pyproject.toml, sitecustomize and usercustomize in any form, *.pth,
   *.egg, *.dist-info/ and *.egg-info/ with their entry points, __pycache__
   and *.pyc, .gitattributes), among the test files (those the test patch
   touches, those holding the selected tests, every file under a tests/
   folder, the __init__.py of their test folders) and whatever stands where
   one of those must go (a directory at a
   test file's path) to the base commit; new ones are deleted. What was
   reverted is listed in the details (`reverted`);
3. apply the test patch (if it applies at the base commit but not now, the
   model's patch is in its way: `test_patch_blocked`, reward 0);
4. run `pytest -rA` in a child process, with no inherited PYTEST_ADDOPTS,
   PYTHONSTARTUP or other environment, and a reporter plugin that sends each
   test's outcome to the harness over a pipe. What the child prints (stdout
   and stderr) comes back as the test log. The runner also refuses what the
   code under test does to pytest from inside (plugins or hook
   implementations it registers, test functions it swaps, test files it
   rewrites, trace functions it sets: prorl_judge.py), and the harness
   compares every test file and piece of test infrastructure with what it put
   in place, after the run (a file rewritten, deleted or added: `tampered`).

Django's and SymPy's instances (their official runner is not pytest) are run
with that runner's official command (verifiers/swebench/specs.py) in the
image's `testbed` environment, activated as SWE-bench's eval script does; the
runner's files (EvalSpec.infrastructure) and its test folders are restored
like the test files. Each test's outcome comes from the harness's own hooks
(unittest's results under Django, SymPy's reporter), named as SWE-bench's
parser names tests.

Either way the printed log, framed as SWE-bench's eval script frames it
(`SWEVerdict.test_log`), is parsed with SWE-bench's parser (the official one
for Django and SymPy; parse_log_pytest for pytest, swebench's default for
repositories outside its specs and SWE-Gym's and SWE-smith's) and
`grading.cross_check`ed against the reporter's outcomes: a test passes only if
both say so, a log line claiming more than the run reported (a `PASSED
nodeid` printed by the code under test) makes the verdict `tampered`, and the
selected tests are graded: every one must have PASSED (an XFAIL, an XPASS or
a skip is not a pass, whoever triggered it, in FAIL_TO_PASS and PASS_TO_PASS
alike); a pytest run, which runs the selected tests only, must also exit 0.
The log's tail is `log_tail`.

Where this differs from SWE-bench: swebench's get_eval_tests_report counts an
XFAIL as a pass and keeps a skipped PASS_TO_PASS test, so code under test that
calls pytest.xfail() or pytest.skip() resolves there. An instance with
`swebench_grading: true` is graded as swebench grades (get_eval_tests_report
and get_resolution_status, RESOLVED_FULL resolves), e.g. to compare with
published numbers; the details say which grading was used (`grading`).

Verdicts: resolved, unresolved, patch_does_not_apply, test_patch_blocked,
tests_timed_out, test_files_not_restorable, tampered (the outcome stream does
not add up: a test reported twice, pytest's exit status contradicting its
reports, pytest's reporting code changed during the run, the test files or
infrastructure changed during it, a log line claiming more than the
reporter), no_verdict (the runner or the harness was killed or made to exit
before the tests finished). Only `resolved` scores 1.
The residual risk (code under test tampering with the memory of the process
it is imported into) and what raises the bar against it are described in
prorl_judge.py.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prorl_server.errors import InfrastructureError
from prorl_server.sandbox.base import Sandbox
from prorl_server.verifiers.harness import HARNESS_GRACE_S, LOG_TAIL_CHARS, NO_VERDICT, run_harness
from prorl_server.verifiers.swebench import grading
from prorl_server.verifiers.swebench.specs import (
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
    EvalSpec,
    UnknownSpec,
    test_command,
)

PASSING = frozenset({"PASSED"})
# SWE-bench's own grading (`swebench_grading`): an XFAIL passes, a skipped PASS_TO_PASS test is kept.
SWEBENCH_PASSING = frozenset({"PASSED", "XFAIL"})
# Beyond the tests' own time: git work on the repository (apply, diff, checkout).
GIT_GRACE_S = 90.0
# Runners the judge runs with their own reporter, and the script each official command starts.
RUNNER_SCRIPTS = {"django": "tests/runtests.py", "sympy": "bin/test"}
# SWE-bench's parser for a pytest run: the default for repositories outside its specs, and SWE-Gym's and SWE-smith's.
PYTEST_LOG_PARSER = "parse_log_pytest"
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_EXPORT = re.compile(r"^export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_FILE_HEADER = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|--- a/(\S+)|\+\+\+ b/(\S+))", re.MULTILINE)


@dataclass
class SWEVerdict:
    resolved: bool
    verdict: str
    """resolved, unresolved, patch_does_not_apply, tests_timed_out, test_files_not_restorable,
    tampered or no_verdict (see the module docstring)."""
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    log_tail: str = ""
    reason: str = ""
    reverted: dict[str, list[str]] = field(default_factory=dict)
    """Files of the model's patch put back as at the base commit ("restored") or removed ("deleted")."""
    anomalies: list[str] = field(default_factory=list)
    test_log: str = ""
    """The run's printed log as SWE-bench's eval script frames it (markers, exit code line): what the
    parser read."""
    grading: str = "strict"
    """strict (every selected test PASSED) or swebench (SWE-bench's rules: XFAIL passes, a skipped
    PASS_TO_PASS test is kept), the instance's `swebench_grading`."""

    def details(self) -> dict[str, Any]:
        passing = PASSING if self.grading == "strict" else SWEBENCH_PASSING | {"SKIPPED"}

        def failing(results: dict[str, str]) -> list[str]:
            return [test for test, status in results.items() if status not in passing]

        details: dict[str, Any] = {
            "verdict": self.verdict,
            "resolved": self.resolved,
            "fail_to_pass": self.fail_to_pass,
            "pass_to_pass_passed": len(self.pass_to_pass) - len(failing(self.pass_to_pass)),
            "pass_to_pass_failing": failing(self.pass_to_pass),
            "reverted": self.reverted,
            "log_tail": self.log_tail,
            "grading": self.grading,
        }
        if self.reason:
            details["reason"] = self.reason
        if self.anomalies:
            details["anomalies"] = self.anomalies
        return details


def patched_files(patch: str) -> list[str]:
    """Every path a unified diff touches (old and new names; git or plain headers)."""
    paths: list[str] = []
    for match in _FILE_HEADER.findall(patch):
        for path in match:
            if path and path not in paths:
                paths.append(path)
    return paths


@dataclass(frozen=True)
class RunnerCommand:
    """An official test command, split for the judge: what it sets, what it runs, with which arguments."""

    runner: str
    env: dict[str, str]
    args: list[str]


def runner_command(spec: EvalSpec, test_patch: str) -> RunnerCommand:
    """The official command of a Django or SymPy instance (swebench's test_cmd and the test
    patch's files, or the line between a 5.x eval_script's markers), split."""
    if spec.eval_script:
        body = spec.eval_script.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]
        lines = [line.strip() for line in body.splitlines()[1:-1] if line.strip()]
        if len(lines) != 1:
            raise UnknownSpec("the eval_script does not run one test command between its markers")
        line = lines[0]
    else:
        line = test_command(spec, test_patch)
    words = shlex.split(line)
    env: dict[str, str] = {}
    while words and _ENV_ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    script = RUNNER_SCRIPTS.get(spec.runner)
    if script is None or not words or words[0].lstrip("./") != script:
        raise UnknownSpec(f"the judge does not run {line!r} (its runners: {', '.join(RUNNER_SCRIPTS)})")
    for command in spec.eval_commands:
        export = _EXPORT.match(command.strip())
        if export:
            env[export.group(1)] = shlex.split(export.group(2))[0] if export.group(2).strip() else ""
    return RunnerCommand(spec.runner, env, words[1:])


def _strings(value: Any) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


async def judge(
    sandbox: Sandbox,
    *,
    repo_dir: str,
    base_commit: str,
    patch: str,
    test_patch: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    pythonpath: str,
    timeout_s: float,
    evaluation: EvalSpec | None = None,
    swebench_grading: bool = False,
) -> SWEVerdict:
    """Judge `patch` in `sandbox`, a fresh sandbox whose repository is at `base_commit`.

    With `evaluation` (the instance's official evaluation) whose runner is Django's
    or SymPy's, the tests run with it; otherwise with pytest. Every selected test
    must pass (PASSED, not XFAIL or skipped) unless `swebench_grading`."""
    tests = list(dict.fromkeys([*fail_to_pass, *pass_to_pass]))
    command = None
    if evaluation is not None and evaluation.runner in RUNNER_SCRIPTS:
        command = runner_command(evaluation, test_patch)
    spec: dict[str, Any] = {
        "repo_dir": repo_dir,
        "base_commit": base_commit,
        "patch": patch,
        "test_patch": test_patch,
        "tests": tests,
        "pythonpath": pythonpath,
        "timeout_s": timeout_s,
    }
    if command is not None and evaluation is not None:
        spec.update(
            runner=command.runner,
            test_args=command.args,
            env=command.env,
            infrastructure=list(evaluation.infrastructure),
            protect_test_dirs=True,
        )
    result = await run_harness(sandbox, "swe", spec, timeout_s + GIT_GRACE_S + HARNESS_GRACE_S)
    tail = result.output[-LOG_TAIL_CHARS:]
    outcome = result.verdict
    grading = "swebench" if swebench_grading else "strict"
    if outcome is None:
        return SWEVerdict(False, NO_VERDICT, log_tail=tail, reason=result.problem, grading=grading)
    reverted = {"restored": _strings(outcome.get("restored")), "deleted": _strings(outcome.get("deleted"))}
    stage, ok = outcome.get("stage"), outcome.get("ok") is True
    output = str(outcome.get("output", ""))[-LOG_TAIL_CHARS:]
    if stage == "model_patch" and not ok:
        return SWEVerdict(False, "patch_does_not_apply", log_tail=output, grading=grading)
    if stage == "restore" and not ok:
        return SWEVerdict(
            False, "test_files_not_restorable", log_tail=tail, reason=output, reverted=reverted, grading=grading
        )
    if stage == "test_patch" and not ok and outcome.get("applies_at_base") is True:
        # It applies at the base commit: what the model's patch left in the work tree
        # stops it. The policy's doing, scored 0 (never an infrastructure failure to mask).
        reason = f"the task's test patch applies at {base_commit[:12]} but not after the model's patch"
        return SWEVerdict(
            False, "test_patch_blocked", log_tail=output, reason=reason, reverted=reverted, grading=grading
        )
    if stage == "test_patch" and not ok:
        raise InfrastructureError(
            f"the task's test_patch does not apply at {base_commit}: {output[-500:]}", reason="swe_test_patch"
        )
    statuses = outcome.get("statuses")
    if stage != "tests" or not ok or not isinstance(statuses, dict):
        return SWEVerdict(False, NO_VERDICT, log_tail=tail, reason="the harness gave a malformed verdict")
    found = _graded(
        outcome, evaluation, command is None, list(fail_to_pass), list(pass_to_pass), tail, reverted, swebench_grading
    )
    return replace(found, grading=grading)


def official_log(printed: str, exit_code: object) -> str:
    """A runner's printed log as SWE-bench's eval script frames it (markers, exit code line)."""
    code = exit_code if isinstance(exit_code, int) else 1
    return f"+ : '{START_TEST_OUTPUT}'\n{printed}\n+ : '{END_TEST_OUTPUT}'\n{TEST_EXIT_CODE}: {code}\n"


def _graded(
    outcome: dict[str, Any],
    evaluation: EvalSpec | None,
    runs_pytest: bool,
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    tail: str,
    reverted: dict[str, list[str]],
    swebench_grading: bool = False,
) -> SWEVerdict:
    """A run's printed log through SWE-bench's parser (the official evaluation's when the instance
    has one, else parse_log_pytest), cross-checked with the reporter's statuses."""
    raw = outcome.get("statuses")
    trusted = {str(name): str(status) for name, status in raw.items()} if isinstance(raw, dict) else {}
    printed = str(outcome.get("log", ""))
    log = official_log(printed, outcome.get("exit_code"))
    logged, valid = grading.statuses_from_log(log, evaluation.log_parser if evaluation else PYTEST_LOG_PARSER)
    combined, forged = grading.cross_check(trusted, logged, [*fail_to_pass, *pass_to_pass], strict=not swebench_grading)

    def status(test: str) -> str:
        return grading.status_of(test, combined) or "MISSING"

    f2p = {test: status(test) for test in fail_to_pass}
    p2p = {test: status(test) for test in pass_to_pass}
    found = SWEVerdict(
        False, "unresolved", f2p, p2p, printed[-LOG_TAIL_CHARS:] or tail, reverted=reverted, test_log=log
    )
    anomalies = [*_strings(outcome.get("anomalies")), *forged]
    if outcome.get("timed_out") is True:
        if anomalies:  # caught tampering before the time ran out (a trace function slows everything down)
            return replace(found, verdict="tampered", reason="the test run was tampered with", anomalies=anomalies)
        return replace(found, verdict="tests_timed_out")
    if outcome.get("complete") is not True:
        command = "pytest" if runs_pytest else "the test command"
        reason = (
            f"the test run ended before {command} finished (the runner was killed or made to exit; "
            f"exit status {outcome.get('runner_exit')})"
        )
        return replace(found, verdict=NO_VERDICT, reason=reason, anomalies=anomalies)
    if anomalies:
        return replace(found, verdict="tampered", reason="the test outcomes do not add up", anomalies=anomalies)
    if not valid:
        return replace(found, reason="SWE-bench's grading finds no valid test run in the log")
    if swebench_grading:
        eval_type: grading.EvalType = (
            "fail_only" if evaluation and evaluation.eval_type == "fail_only" else "pass_and_fail"
        )
        report = grading.tests_report(combined, fail_to_pass, pass_to_pass, eval_type)
    else:
        report = grading.strict_report(combined, fail_to_pass, pass_to_pass)
    resolution = grading.resolution_status(report)
    if resolution != grading.FULL:
        failing = len(report[grading.F2P]["failure"]) + len(report[grading.P2P]["failure"])
        return replace(found, reason=f"{resolution}: {failing} of {len(f2p) + len(p2p)} selected tests did not pass")
    if runs_pytest and outcome.get("exitstatus") != 0:
        # Only the selected tests ran: pytest's own exit status has to agree (Django's and
        # SymPy's commands run whole modules, whose other tests may fail).
        return replace(found, reason=f"pytest exited with status {outcome.get('exitstatus')}")
    return replace(found, resolved=True, verdict="resolved")
