"""Terminal (Harbor / Terminal-Bench) judging: the task's pytest files run, after
the agent, in a fresh sandbox that holds the agent's working directory and
nothing else of its sandbox.

The judging harness (sandbox/runtime/prorl_judge.py, mode `terminal`) empties
the working directory of the fresh sandbox, unpacks the agent's archive of it
there (no member outside it, none written through a link), removes whatever
stands in the tests folder and puts the task's test files there, then runs
the test files that the task's test.sh runs with the SWE judge's pytest
runner, from the working directory (not put on sys.path, as for test.sh's
pytest command). Each test's outcome comes from that
runner's reporter over its keyed pipe, with every guard of the SWE judge
(plugins or hooks registered by the code under test, swapped test functions,
test files rewritten at import, trace functions); after the run the tests
folder is compared with what was put there.

What the task's test.sh prints or writes (a reward file, pytest's summary) is
never read: the reward is the reporter's. The printed log is parsed with
SWE-bench's pytest parser only to catch forgeries: a line claiming more than
the reporter reported (a `PASSED test_outputs.py::test_x` printed by the
agent's program) makes the verdict `tampered`.

Verdicts: passed (at least one test collected, every collected test PASSED,
pytest exited 0), failed, no_tests, tests_timed_out, tampered, state_unreadable
(the agent's archive could not be unpacked), no_verdict. Only `passed` scores 1.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_server.errors import InfrastructureError
from prorl_server.sandbox.base import Sandbox
from prorl_server.verifiers.harness import HARNESS_GRACE_S, LOG_TAIL_CHARS, NO_VERDICT, run_harness
from prorl_server.verifiers.swe import PYTEST_LOG_PARSER, official_log
from prorl_server.verifiers.swebench import grading

# Beyond the tests' own time: unpacking the agent's working directory.
UNPACK_GRACE_S = 60.0
PASSED = "PASSED"


@dataclass
class TerminalVerdict:
    passed: bool
    verdict: str
    tests: dict[str, str] = field(default_factory=dict)
    log_tail: str = ""
    reason: str = ""
    anomalies: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Members of the agent's archive not unpacked (outside the working directory, through a link, devices)."""

    def details(self) -> dict[str, Any]:
        details: dict[str, Any] = {
            "verdict": self.verdict,
            "passed": self.passed,
            "tests": self.tests,
            "tests_passed": sum(status == PASSED for status in self.tests.values()),
            "tests_total": len(self.tests),
            "log_tail": self.log_tail,
        }
        if self.reason:
            details["reason"] = self.reason
        if self.anomalies:
            details["anomalies"] = self.anomalies
        if self.skipped:
            details["state_skipped"] = self.skipped
        return details


async def judge(
    sandbox: Sandbox,
    *,
    workdir: str,
    tests_dir: str,
    tests: Mapping[str, str],
    run: Sequence[str],
    state_path: str,
    timeout_s: float,
    logs_dirs: Sequence[str] = (),
) -> TerminalVerdict:
    """Judge the agent's working directory (the archive at `state_path` in `sandbox`, a fresh
    sandbox of the task's image) with the task's test files `run` (paths in `tests`)."""
    spec = {
        "workdir": workdir,
        "tests_dir": tests_dir,
        "tests": {name: base64.b64encode(text.encode()).decode() for name, text in tests.items()},
        "run": list(run),
        "state": state_path,
        "timeout_s": timeout_s,
        "logs_dirs": list(logs_dirs),
    }
    result = await run_harness(sandbox, "terminal", spec, timeout_s + UNPACK_GRACE_S + HARNESS_GRACE_S)
    tail = result.output[-LOG_TAIL_CHARS:]
    outcome = result.verdict
    if outcome is None:
        return TerminalVerdict(False, NO_VERDICT, log_tail=tail, reason=result.problem)
    stage, ok = outcome.get("stage"), outcome.get("ok") is True
    skipped = [str(item) for item in outcome.get("skipped") or []] if isinstance(outcome.get("skipped"), list) else []
    if stage == "state" and not ok:
        reason = f"the agent's working directory could not be unpacked: {str(outcome.get('output', ''))[-500:]}"
        return TerminalVerdict(False, "state_unreadable", log_tail=tail, reason=reason)
    if stage == "tests_in_place" and not ok:
        raise InfrastructureError(
            f"the task's tests cannot be put in {tests_dir} in its image: {str(outcome.get('output', ''))[-500:]}",
            reason="terminal_tests_not_placed",
        )
    if stage != "tests" or not ok or not isinstance(outcome.get("collected"), dict):
        return TerminalVerdict(False, NO_VERDICT, log_tail=tail, reason="the harness gave a malformed verdict")
    return _graded(outcome, tail, skipped)


def _graded(outcome: dict[str, Any], tail: str, skipped: list[str]) -> TerminalVerdict:
    trusted = {str(name): str(status) for name, status in outcome["collected"].items()}
    printed = str(outcome.get("log", ""))
    logged, _ = grading.statuses_from_log(official_log(printed, outcome.get("exit_code")), PYTEST_LOG_PARSER)
    # Every test the log names or the reporter collected: a log line better than the reporter's
    # word (or naming a test that never ran) is a forgery. pytest prints ids relative to the
    # working directory, the reporter gives them relative to the root folder: both by file name.
    reported, printed_ids = _by_file_name(trusted), _by_file_name(logged)
    _, forged = grading.cross_check(reported, printed_ids, sorted({*reported, *printed_ids}), strict=True)
    anomalies = [str(item) for item in outcome.get("anomalies") or []] + forged
    found = TerminalVerdict(False, "failed", trusted, printed[-LOG_TAIL_CHARS:] or tail, skipped=skipped)
    if outcome.get("timed_out") is True:
        if anomalies:
            return _with(found, "tampered", "the test run was tampered with", anomalies)
        return _with(found, "tests_timed_out", "the tests ran out of time")
    if outcome.get("complete") is not True:
        reason = f"the test run ended before pytest finished (exit status {outcome.get('runner_exit')})"
        return _with(found, NO_VERDICT, reason, anomalies)
    if anomalies:
        return _with(found, "tampered", "the test outcomes do not add up", anomalies)
    if not trusted:
        return _with(found, "no_tests", "pytest collected no test")
    failing = [test for test, status in trusted.items() if status != PASSED]
    if failing:
        return _with(found, "failed", f"{len(failing)} of {len(trusted)} tests did not pass")
    if outcome.get("exitstatus") != 0:
        return _with(found, "failed", f"pytest exited with status {outcome.get('exitstatus')}")
    found.passed, found.verdict = True, "passed"
    return found


def _by_file_name(statuses: Mapping[str, str]) -> dict[str, str]:
    """Statuses keyed by `file.py::test` (the file's folder dropped); of two tests of that name
    in files of the same name, the worse status."""
    keyed: dict[str, str] = {}
    for test, status in statuses.items():
        path, sep, rest = test.partition("::")
        key = path.rsplit("/", 1)[-1] + sep + rest
        if keyed.get(key, PASSED) == PASSED:
            keyed[key] = status
    return keyed


def _with(found: TerminalVerdict, verdict: str, reason: str, anomalies: list[str] | None = None) -> TerminalVerdict:
    found.verdict, found.reason = verdict, reason
    if anomalies:
        found.anomalies = anomalies
    return found
