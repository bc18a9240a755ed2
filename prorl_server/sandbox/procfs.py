"""The host's processes started since a given one, read from /proc without reading every
process's files.

Starting a sandbox, the server looks for the processes of its container (to move them
into the sandbox's cgroups, to find the runtime that init forked). They were all started
after the container's init, and Linux hands out pids in increasing order until the
counter wraps at kernel.pid_max, so only the pids above init's need a look, unless the
counter has wrapped since. Reading every process's stat instead took a quarter of the
server's CPU at 64 concurrent jobs on a host of a few thousand processes (py-spy, `make
bench-throughput`), and it grows with the host's process count: a thousand sandboxes are
four thousand processes.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def last_pid() -> int | None:
    """The pid the kernel handed out last (in the pid namespace of this /proc)."""
    try:
        return int((PROC / "loadavg").read_text().split()[4])
    except (OSError, ValueError, IndexError):
        return None


def pids_since(pid: int) -> list[int]:
    """Processes (thread group ids) that may have started after `pid`, ascending: those
    with a higher pid, or every process when the pid counter has wrapped since `pid` was
    handed out (the last pid then lies below it). Blocking: one directory read."""
    newest = last_pid()
    found = sorted(int(entry) for entry in os.listdir(PROC) if entry.isdigit())
    if newest is None or newest < pid:
        return found
    return [entry for entry in found if entry > pid]
