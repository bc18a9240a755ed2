"""A pytest run as the harness sees it (swe and terminal mode): start the pytest
runner child on the selected tests, and turn its report stream into one outcome per
test, checked for completeness, keys and consistency with the exit status.
"""

import os
import sys
import tempfile
import time

from .judge_processes import clean_env
from .runner_child import run_child


def run_pytest(repo, spec, tests, workdir, digests):
    """Run the selected tests in a runner child; its reporter's frames are the outcome.

    The runner is told the digest of every protected file (`digests`: the test files
    and test infrastructure as the harness put them in place): the files it may
    trust, and what pytest must read when it imports a test module."""
    started = time.monotonic()
    paths = [os.path.join(repo, entry) for entry in str(spec.get("pythonpath") or "").split(":") if entry]
    options = []
    for path in paths:
        options += ["--path", path]
    env = clean_env()
    if paths:
        env["PYTHONPATH"] = ":".join(paths)  # for the processes the tests start
    pycache = tempfile.mkdtemp(prefix="pycache-", dir=workdir)
    options += ["--pycache", pycache]
    if spec.get("cwd_on_path", True) is False:
        options += ["--cwd-on-path", "no"]
    key, frames, problem, timed_out, code, log, truncated = run_child(
        [sys.executable, "-I", "-B", "-u"], "pytest", options, tests, repo, env, workdir, float(spec["timeout_s"]),
        briefing={"digests": digests},
    )  # fmt: skip
    if os.listdir(pycache):
        problem = problem or "bytecode was written where pytest would read it back (%s)" % pycache
    outcome = aggregate_reports(frames, tests, key)
    if problem:
        outcome["anomalies"].append(problem)
    if outcome["complete"] and outcome["exit_code"] != code:
        outcome["anomalies"].append(
            "the runner exited with %s, not pytest's exit code %s" % (code, outcome["exit_code"])
        )
    outcome.update(
        timed_out=timed_out, runner_exit=code, duration_s=time.monotonic() - started, log=log, log_truncated=truncated
    )
    return outcome


def phase_status(phases):
    """One test's status, as pytest's -rA summary names it, from its reports.

    A failure anywhere wins: an extra "passed" report cannot hide a real failure."""
    if not phases:
        return "MISSING"
    if any(when != "call" and outcome == "failed" for when, outcome, _, _ in phases):
        return "ERROR"
    if any(outcome == "failed" for _, outcome, _, _ in phases):
        return "FAILED"
    for when, outcome, xfail, sub in phases:
        if when == "call" and not sub:
            if outcome == "passed":
                return "XPASS" if xfail else "PASSED"
            return "XFAIL" if xfail else "SKIPPED"
    for when, outcome, xfail, _ in phases:
        if when == "setup" and outcome == "skipped":
            return "XFAIL" if xfail else "SKIPPED"
    return "MISSING"


def aggregate_reports(frames, tests, key):
    """Per-test statuses from the reporter's frames, and whatever does not add up.

    Expected: `collected`, then one `report` per phase of each collected test,
    then `finished` (pytest's exit status) and `exit` (the code the runner
    exits with), each carrying the run's key (given to the runner on its stdin
    before any test code was imported). A frame without the key (ignored), a
    duplicate, a report of an uncollected test, a frame after `exit`, or an
    exit status that contradicts the reports is an anomaly; a stream without
    `exit` is incomplete (the runner died or was made to exit)."""
    anomalies, phases, seen = [], {}, set()
    collected, finished, exit_code, after_exit = None, None, None, False
    foreign = 0
    for frame in frames:
        if frame.get("key") != key:
            foreign += 1
            continue
        kind = frame.get("kind")
        if exit_code is not None:
            after_exit = True
        if kind == "collected" and collected is None and isinstance(frame.get("nodeids"), list):
            collected = set(str(node) for node in frame["nodeids"])
        elif kind == "report" and finished is None:
            phase = (str(frame.get("nodeid")), str(frame.get("when")))
            sub = frame.get("sub") is True
            if phase in seen and not sub:
                anomalies.append("two %s reports for %s" % (phase[1], phase[0]))
            if not sub:
                seen.add(phase)
            if collected is not None and phase[0] not in collected:
                anomalies.append("a report for %s, which was not collected" % phase[0])
            outcome = (phase[1], str(frame.get("outcome")), frame.get("xfail") is True, sub)
            phases.setdefault(phase[0], []).append(outcome)
        elif kind == "tampered":
            anomalies.append("the test run was tampered with: %s" % str(frame.get("names"))[:500])
        elif kind == "finished" and finished is None:
            finished = frame.get("exitstatus")
        elif kind == "exit" and exit_code is None and finished is not None:
            exit_code = frame.get("code")
        else:
            anomalies.append("an unexpected %s frame" % str(kind)[:40])
    if after_exit:
        anomalies.append("frames after the runner's last one")
    if foreign:
        anomalies.append("%d frames that did not come from the reporter (no run key)" % foreign)
    failed = any(report[1] == "failed" for reports in phases.values() for report in reports)
    if finished == 0 and failed:
        anomalies.append("pytest reported success, but a test failed")
    if finished == 1 and not failed:
        anomalies.append("pytest reported failed tests, but none failed")
    statuses = dict((test, phase_status(phases.get(test, ()))) for test in tests)
    return {
        "statuses": statuses,
        "anomalies": anomalies,
        "exitstatus": finished,
        "exit_code": exit_code,
        "complete": exit_code is not None and type(exit_code) is int,
        # Every collected test's status (terminal mode runs whole test files, not named tests).
        "collected": dict((test, phase_status(phases.get(test, ()))) for test in sorted(collected or ())),
    }
