"""Starting a runner child (pytest, Django's or SymPy's runner) and collecting its
keyed report frames: the run's key and the test files' digests go on its stdin before
any code under test is imported; its log goes to a capped file.
"""

import json
import os
import subprocess
import time

from . import JUDGE_SCRIPT
from .judge_processes import kill_descendants, kill_group
from .pipe_frames import FrameReader, ProtocolError, Timeout


def collect_reports(process, report_r, started, timeout):
    """Read the runner child's report frames until it ends (or `timeout` runs out, or the
    stream breaks: then its process group is killed), then what it and any process its
    tests left behind wrote last. Returns (frames, problem, timed out, exit code); closes report_r."""
    reader = FrameReader(report_r)
    frames, problem, timed_out = [], None, False
    deadline = started + timeout
    while True:
        try:
            frame = reader.read(min(deadline, time.monotonic() + 0.2))
        except Timeout:
            if process.poll() is not None:
                break  # exited; something it started may hold the pipe
            if time.monotonic() >= deadline:
                timed_out = True
                break
            continue
        except ProtocolError as exc:
            problem = "the report stream broke: %s" % exc
            break
        if frame is None:
            break
        frames.append(frame)
    if timed_out or problem:
        kill_group(process)
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        kill_group(process)
        code = process.wait()
    # The rest of the stream: what the runner wrote last, and whatever processes the
    # tests left behind write there before they are killed (an anomaly, if anything).
    reader.drain(0.5, 2.0)
    kill_descendants()
    reader.drain(0.5, 2.0)
    try:
        while True:
            frame = reader.pop()
            if frame is None:
                break
            frames.append(frame)
    except ProtocolError as exc:
        problem = problem or "the report stream broke: %s" % exc
    os.close(report_r)
    return frames, problem, timed_out, code


# The most of a runner child's printed log that goes back to the server.
LOG_CAP = 8 << 20


def run_child(python, mode, options, args, repo, env, workdir, timeout, briefing=None):
    """Run this file in runner mode `mode` in a child: its printed stdout and stderr go to a
    file in `workdir`, the run's key to its stdin (then `briefing`, a line of JSON, if
    given), and its report frames are collected.

    Returns (key, frames, problem, timed out, exit code, the printed log (at most
    LOG_CAP bytes, as text), whether the log was longer)."""
    report_r, report_w = os.pipe()
    argv = list(python) + [JUDGE_SCRIPT, mode, "--report-fd", str(report_w)] + list(options)
    log_path = os.path.join(workdir, "test.log")
    started = time.monotonic()
    key = os.urandom(16).hex()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv + ["--"] + list(args), pass_fds=(report_w,), stdin=subprocess.PIPE, stdout=log,
            stderr=subprocess.STDOUT, cwd=repo, env=env, preexec_fn=os.setpgrp,
        )  # fmt: skip
    os.close(report_w)
    try:
        process.stdin.write(key.encode() + b"\n")
        if briefing is not None:
            process.stdin.write(json.dumps(briefing).encode("utf-8") + b"\n")
        process.stdin.close()
    except OSError:
        pass
    frames, problem, timed_out, code = collect_reports(process, report_r, started, timeout)
    with open(log_path, "rb") as handle:
        raw = handle.read(LOG_CAP + 1)
    return key, frames, problem, timed_out, code, raw[:LOG_CAP].decode("utf-8", "replace"), len(raw) > LOG_CAP
