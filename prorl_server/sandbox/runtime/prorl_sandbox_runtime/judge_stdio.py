"""Stdio mode: the program runs once per input; its stdout (its own pipe), exit status
(from waitpid) and timing go back to the server, which compares them with the
expected outputs (never shown to the program).
"""

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

from .judge_processes import clean_env, kill_descendants, kill_group


def _read_capped(process, fd, cap, deadline):
    """The process's stdout up to `cap` bytes; (data, truncated, timed_out).

    Reading stops at EOF, or shortly after the process exits (what it left
    running may hold the pipe open), or at the deadline."""
    chunks, size, exited_at = [], 0, None
    while True:
        now = time.monotonic()
        if now >= deadline:
            return b"".join(chunks), size > cap, process.poll() is None
        if exited_at is None and process.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.2:
            return b"".join(chunks), size > cap, False
        ready, _, _ = select.select([fd], [], [], min(deadline - now, 0.05))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), size > cap, False
        if size < cap:
            chunks.append(chunk[: cap - size])
        size += len(chunk)


def judge_stdio(spec):
    """Run the program on each input; report its own stdout and exit status per input."""
    timeout = float(spec["timeout_s"])
    caps = spec["max_stdout_bytes"]
    workdir = tempfile.mkdtemp(prefix="prorl-program-")
    results = []
    for index, data in enumerate(spec["inputs"]):
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as handle:
            handle.write(str(spec["program"]))
        stdin = tempfile.TemporaryFile()
        stdin.write(str(data).encode("utf-8"))
        stdin.seek(0)
        started = time.monotonic()
        read_end, write_end = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "solution.py"],
            stdin=stdin, stdout=write_end, cwd=workdir, env=clean_env(), preexec_fn=os.setpgrp,
        )  # fmt: skip
        os.close(write_end)
        stdin.close()
        out, truncated, timed_out = _read_capped(process, read_end, int(caps[index]), started + timeout)
        if timed_out:
            kill_group(process)
        try:
            code = process.wait(timeout=max(started + timeout - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            kill_group(process)
            code, timed_out = process.wait(), True
        os.close(read_end)
        kill_descendants()
        results.append(
            {
                "stdout": out.decode("utf-8", "replace"),
                "truncated": truncated,
                "exit_code": code,
                "timed_out": timed_out,
                "duration_s": time.monotonic() - started,
            }
        )
    shutil.rmtree(workdir, ignore_errors=True)
    return {"tests": results}
