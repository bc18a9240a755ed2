"""SWE-bench-style judging: apply a patch to the repository at its base commit
in a fresh sandbox, put the task's tests in place, run FAIL_TO_PASS and
PASS_TO_PASS with pytest, and resolve only if every one of them passes.

The judging harness (sandbox/runtime/prorl_judge.py, mode `swe`) does the
steps in the sandbox, following SWE-bench's harness with the holes closed:
1. apply the model's patch (`patch_does_not_apply` if it does not);
2. restore what the patch changed among the files pytest or Python would load
   as configuration or plugins (any conftest.py, pytest.ini, tox.ini,
   setup.cfg, pyproject.toml, sitecustomize.py, usercustomize.py, *.pth,
   *.dist-info/ and *.egg-info/ with their entry points, __pycache__ and
   *.pyc, .gitattributes) and among the test files (those the test patch
   touches and those holding the selected tests) to the base commit; new ones
   are deleted. What was reverted is listed in the details (`reverted`);
3. apply the test patch;
4. run pytest in a child process, with no inherited PYTEST_ADDOPTS,
   PYTHONSTARTUP or other environment, and a reporter plugin that sends each
   test's outcome to the harness over a pipe. Test outcomes come from there,
   never from the printed log (its tail stays in `log_tail` for humans).

Verdicts: resolved, unresolved, patch_does_not_apply, tests_timed_out,
test_files_not_restorable, tampered (the outcome stream does not add up: a
test reported twice, pytest's exit status contradicting its reports, pytest's
reporting code changed during the run), no_verdict (the runner or the harness
was killed or made to exit before pytest finished). Only `resolved` scores 1.
The residual risk (code under test tampering with the memory of the process
it is imported into) and what raises the bar against it are described in
prorl_judge.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prorl_server.errors import InfrastructureError
from prorl_server.sandbox.base import Sandbox
from prorl_server.verifiers.harness import HARNESS_GRACE_S, LOG_TAIL_CHARS, NO_VERDICT, run_harness

PASSING = frozenset({"PASSED", "XFAIL"})
# Beyond the tests' own time: git work on the repository (apply, diff, checkout).
GIT_GRACE_S = 90.0
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

    def details(self) -> dict[str, Any]:
        def failing(results: dict[str, str]) -> list[str]:
            return [test for test, status in results.items() if status not in PASSING]

        details: dict[str, Any] = {
            "verdict": self.verdict,
            "resolved": self.resolved,
            "fail_to_pass": self.fail_to_pass,
            "pass_to_pass_passed": len(self.pass_to_pass) - len(failing(self.pass_to_pass)),
            "pass_to_pass_failing": failing(self.pass_to_pass),
            "reverted": self.reverted,
            "log_tail": self.log_tail,
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
) -> SWEVerdict:
    """Judge `patch` in `sandbox`, a fresh sandbox whose repository is at `base_commit`."""
    tests = list(dict.fromkeys([*fail_to_pass, *pass_to_pass]))
    spec = {
        "repo_dir": repo_dir,
        "base_commit": base_commit,
        "patch": patch,
        "test_patch": test_patch,
        "tests": tests,
        "pythonpath": pythonpath,
        "timeout_s": timeout_s,
    }
    result = await run_harness(sandbox, "swe", spec, timeout_s + GIT_GRACE_S + HARNESS_GRACE_S)
    tail = result.output[-LOG_TAIL_CHARS:]
    outcome = result.verdict
    if outcome is None:
        return SWEVerdict(False, NO_VERDICT, log_tail=tail, reason=result.problem)
    reverted = {"restored": _strings(outcome.get("restored")), "deleted": _strings(outcome.get("deleted"))}
    stage, ok = outcome.get("stage"), outcome.get("ok") is True
    output = str(outcome.get("output", ""))[-LOG_TAIL_CHARS:]
    if stage == "model_patch" and not ok:
        return SWEVerdict(False, "patch_does_not_apply", log_tail=output)
    if stage == "restore" and not ok:
        return SWEVerdict(False, "test_files_not_restorable", log_tail=tail, reason=output, reverted=reverted)
    if stage == "test_patch" and not ok:
        raise InfrastructureError(
            f"the task's test_patch does not apply at {base_commit}: {output[-500:]}", reason="swe_test_patch"
        )
    statuses = outcome.get("statuses")
    if stage != "tests" or not ok or not isinstance(statuses, dict):
        return SWEVerdict(False, NO_VERDICT, log_tail=tail, reason="the harness gave a malformed verdict")
    f2p = {test: str(statuses.get(test, "MISSING")) for test in fail_to_pass}
    p2p = {test: str(statuses.get(test, "MISSING")) for test in pass_to_pass}
    found = SWEVerdict(False, "unresolved", f2p, p2p, tail, reverted=reverted)
    if outcome.get("timed_out") is True:
        return replace(found, verdict="tests_timed_out")
    anomalies = _strings(outcome.get("anomalies"))
    if outcome.get("complete") is not True:
        reason = (
            "the test run ended before pytest finished (the runner was killed or made to exit; "
            f"exit status {outcome.get('runner_exit')})"
        )
        return replace(found, verdict=NO_VERDICT, reason=reason, anomalies=anomalies)
    if anomalies:
        return replace(found, verdict="tampered", reason="the test outcomes do not add up", anomalies=anomalies)
    failing = sum(status not in PASSING for status in [*f2p.values(), *p2p.values()])
    if failing:
        return replace(found, reason=f"{failing} of {len(f2p) + len(p2p)} selected tests did not pass")
    if outcome.get("exitstatus") != 0:
        return replace(found, reason=f"pytest exited with status {outcome.get('exitstatus')}")
    return replace(found, resolved=True, verdict="resolved")
