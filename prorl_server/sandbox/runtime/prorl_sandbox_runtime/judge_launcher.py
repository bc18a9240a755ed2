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
    process, verdict_r = start_harness(mode)
    writer = feed_spec(process, json.dumps(spec).encode("utf-8"))
    reading = HarnessOutput(cap)
    timed_out = reading.read(process, verdict_r, started + timeout)
    kill_session(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    exit_code = process.wait()
    writer.join(5)
    process.stdout.close()
    os.close(verdict_r)
    text = reading.output.text()
    if timed_out:
        text += "\n[judging timed out after %gs; its processes were killed]" % timeout
    return {
        "output": text,
        "truncated": reading.output.truncated,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "verdict": reading.verdict_text(),
        "verdict_truncated": reading.verdict_truncated,
        "duration_s": time.monotonic() - started,
    }


def start_harness(mode):
    """The harness's process and the read end of its verdict pipe (see run_judge)."""
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
    return process, verdict_r


def feed_spec(process, body):
    """Write the spec to the harness's stdin from a thread (it may read it late, or never)."""

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
    return writer


class HarnessOutput:
    """What the harness writes on its two pipes: its log (capped) and its verdict (at most
    MAX_VERDICT bytes, else none)."""

    def __init__(self, cap):
        self.output = CappedBuffer(cap)
        self.verdict = bytearray()
        self.verdict_truncated = False

    def read(self, process, verdict_r, deadline):
        """Read both pipes until they close, the harness has exited a second ago (what it left
        behind may hold the log pipe open), or the deadline; True when the deadline came first."""
        log_fd = process.stdout.fileno()
        open_fds = [log_fd, verdict_r]
        exited_at = None
        while open_fds:
            now = time.monotonic()
            if now >= deadline:
                return process.poll() is None
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 1.0:
                return False
            ready, _, _ = select.select(open_fds, [], [], min(deadline - now, 0.2))
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_fds.remove(fd)
                elif fd == log_fd:
                    self.output.write(chunk)
                elif len(self.verdict) + len(chunk) > MAX_VERDICT:
                    self.verdict_truncated = True
                else:
                    self.verdict += chunk
        return False

    def verdict_text(self):
        if self.verdict_truncated or not self.verdict:
            return None
        return bytes(self.verdict).decode("utf-8", "replace")
