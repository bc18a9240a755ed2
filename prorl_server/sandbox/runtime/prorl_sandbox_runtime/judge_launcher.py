"""The runtime's `judge` operation: start the judging harness (prorl_judge.py, beside
the runtime) on a spec and bring back the verdict it wrote on a pipe of its own.
"""

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from . import JUDGE_SCRIPT
from .capped import CappedBuffer
from .hygiene import kill_session

JUDGE_MODES = ("function", "stdio", "swe", "terminal")
MAX_VERDICT = 32 << 20


def judge_env():
    """The judge's environment: the basics, and the sandbox's own temporary directory when the
    runtime was given one."""
    env = {
        "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME") or "/tmp",
        "LANG": "C.UTF-8",
    }
    if os.environ.get("TMPDIR"):
        env["TMPDIR"] = os.environ["TMPDIR"]
    return env


def run_judge(mode, spec, timeout, cap):
    """Run the judging harness (prorl_judge.py, trusted, beside this package) on `spec`.

    Started directly: argv with no shell and no pty, isolated Python (-I), its
    own session, a clean environment, the spec on a stdin pipe, its log on a
    stdout pipe (capped), and a dedicated pipe for the verdict that no other
    process gets (close_fds; the harness never passes it on). When `timeout`
    passes, its whole session is killed. The verdict is returned as the text
    the harness wrote there, or None; the server decides what it is worth."""
    if mode not in JUDGE_MODES:
        raise ValueError("unknown judge mode %r" % (mode,))
    started = time.monotonic()
    verdict_r, verdict_w = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", JUDGE_SCRIPT, mode, "--verdict-fd", str(verdict_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(verdict_w,),
            cwd="/",
            env=judge_env(),
            start_new_session=True,
        )
    except BaseException:
        os.close(verdict_r)
        raise
    finally:
        os.close(verdict_w)
    body = json.dumps(spec).encode("utf-8")

    def feed():
        try:
            process.stdin.write(body)
        except OSError:
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    output = CappedBuffer(cap)
    verdict = bytearray()
    verdict_truncated = False
    log_fd = process.stdout.fileno()
    open_fds = [log_fd, verdict_r]
    deadline = started + timeout
    exited_at = None
    timed_out = False
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            timed_out = process.poll() is None
            break
        if exited_at is None and process.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 1.0:
            break  # what the harness left behind may hold the log pipe open
        ready, _, _ = select.select(open_fds, [], [], min(deadline - now, 0.2))
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
            elif fd == log_fd:
                output.write(chunk)
            elif len(verdict) + len(chunk) > MAX_VERDICT:
                verdict_truncated = True
            else:
                verdict += chunk
    kill_session(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    exit_code = process.wait()
    writer.join(5)
    process.stdout.close()
    os.close(verdict_r)
    text = output.text()
    if timed_out:
        text += "\n[judging timed out after %gs; its processes were killed]" % timeout
    return {
        "output": text,
        "truncated": output.truncated,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "verdict": None if verdict_truncated or not verdict else bytes(verdict).decode("utf-8", "replace"),
        "verdict_truncated": verdict_truncated,
        "duration_s": time.monotonic() - started,
    }
