"""The official test command of a Django or SymPy instance, run by swe mode: the
environment the image's `testbed` activation gives, the runner child, and one outcome
per test from its reports (the runners themselves: django_sympy_runners.py).
"""

import os
import shutil
import subprocess
import sys
import time

from .judge_processes import clean_env
from .runner_child import run_child

ACTIVATE = "/opt/miniconda3/bin/activate"


def activated_env(spec):
    """The environment of the image's testbed activation (SWE-bench's eval script's
    first two lines) plus the version's exports; the harness's own when the image
    has no /opt/miniconda3."""
    env = clean_env()
    env_name = str(spec.get("conda_env") or "testbed")
    if os.path.exists(ACTIVATE):
        script = "source %s && conda activate %s && env -0" % (ACTIVATE, env_name)
        try:
            done = subprocess.run(
                ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=60, cwd="/"
            )
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0:
            for item in done.stdout.split(b"\0"):
                name, sep, value = item.decode("utf-8", "replace").partition("=")
                if sep and name in ("PATH", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_SHLVL"):
                    env[name] = value
    for name, value in dict(spec.get("env") or {}).items():
        env[str(name)] = str(value)
    return env


def runner_python(env):
    found = shutil.which("python", path=env.get("PATH")) or shutil.which("python3", path=env.get("PATH"))
    return found or sys.executable


def run_runner(repo, spec, workdir, digests):
    """Run the official command of a Django or SymPy instance; outcomes from the report pipe
    (`digests`: the protected files, which the runner may trust)."""
    args = [str(arg) for arg in spec.get("test_args") or []]
    env = activated_env(spec)
    env["PYTHONHASHSEED"] = str(int.from_bytes(os.urandom(4), "big"))  # random, as the official run
    started = time.monotonic()
    key, frames, problem, timed_out, code, log, truncated = run_child(
        [runner_python(env), "-s", "-B", "-u"], str(spec["runner"]), [], args, repo, env, workdir,
        float(spec["timeout_s"]), briefing={"digests": digests},
    )  # fmt: skip
    outcome = aggregate_results(frames, key)
    if problem:
        outcome["anomalies"].append(problem)
    if outcome["complete"] and outcome["exit_code"] != code:
        outcome["anomalies"].append(
            "the runner exited with %s, not the test command's %s" % (code, outcome["exit_code"])
        )
    outcome.update(
        timed_out=timed_out, runner_exit=code, exitstatus=outcome["exit_code"], duration_s=time.monotonic() - started,
        log=log, log_truncated=truncated,
    )  # fmt: skip
    return outcome


_STATUS_RANK = {"PASSED": 0, "XFAIL": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 2}


def aggregate_results(frames, key):
    """Per-test statuses (by the official parser's test names) from a unittest-style runner's frames.

    Expected: `report` frames (a test's final outcome, once per test id, or a
    subtest's failure), then `exit` with the test command's exit code. A frame
    without the run key, a second final report of one test, a report from
    outside the runner's own code (`foreign`), a changed fingerprint
    (`tampered`), a frame after `exit`, or an exit code 0 after a failure is an
    anomaly; without `exit` the run is incomplete."""
    anomalies, statuses, finals = [], {}, set()
    sub_failed = {}
    exit_code, after_exit, foreign_frames = None, False, 0
    failed = False
    for frame in frames:
        if frame.get("key") != key:
            foreign_frames += 1
            continue
        kind = frame.get("kind")
        if exit_code is not None:
            after_exit = True
        if kind == "report":
            name, status = str(frame.get("name")), str(frame.get("status"))
            if status not in _STATUS_RANK:
                anomalies.append("a report with status %r" % status[:20])
                continue
            failed = failed or status in ("FAILED", "ERROR")
            if frame.get("sub") is True:
                sub_failed[name] = status
                continue
            test_id = str(frame.get("id"))
            if test_id in finals:
                anomalies.append("two reports for %s" % test_id[:200])
            finals.add(test_id)
            statuses[name] = status
        elif kind == "foreign":
            anomalies.append("a test outcome reported from outside the test runner: %s" % str(frame.get("what"))[:300])
        elif kind == "tampered":
            anomalies.append("the test run was tampered with: %s" % str(frame.get("names"))[:500])
        elif kind == "exit" and exit_code is None:
            exit_code = frame.get("code")
        elif kind != "started":
            anomalies.append("an unexpected %s frame" % str(kind)[:40])
    for name, status in sub_failed.items():
        if _STATUS_RANK.get(statuses.get(name, "PASSED"), 0) < _STATUS_RANK[status]:
            statuses[name] = status
    if after_exit:
        anomalies.append("frames after the runner's last one")
    if foreign_frames:
        anomalies.append("%d frames that did not come from the reporter (no run key)" % foreign_frames)
    if exit_code == 0 and failed:
        anomalies.append("the test command reported success, but a test failed")
    return {
        "statuses": statuses,
        "anomalies": anomalies,
        "exit_code": exit_code,
        "complete": exit_code is not None and type(exit_code) is int,
    }
