"""CPU, memory and pids limits for rootless containers on a cgroup v1 host.

Rootless Podman cannot apply cgroup limits on cgroup v1 (it ignores them with
a warning). When the server runs as root it can: it creates one group per
sandbox in the v1 memory, cpu and pids hierarchies, under its own groups,
writes the limits and moves the container's processes in. Every process the
in-sandbox runtime starts afterwards inherits the groups; a `podman exec`
command does not (Podman starts it outside), so the exec fallback's commands
wait until `adopt` has moved them in. On a cgroup v2 host
Podman enforces the limits itself and this class stands aside.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import structlog

from prorl_server.sandbox.procfs import pids_since

log = structlog.get_logger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
SHUTDOWN_PATIENCE_S = 30.0


def _own_group(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path.lstrip("/")
    return ""


def _descendants(root_pid: int) -> list[int]:
    """`root_pid` and the processes it started, and theirs (all started after it)."""
    children: dict[int, list[int]] = {}
    for entry in pids_since(root_pid):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(entry)
    found, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


class CgroupV1Limiter:
    def __init__(self, parent_name: str) -> None:
        self._parents = {c: CGROUP_ROOT / c / _own_group(c) / parent_name for c in CONTROLLERS}

    @staticmethod
    def usable() -> bool:
        """True on a cgroup v1 (or hybrid) host when we may write the hierarchies."""
        if os.geteuid() != 0 or (CGROUP_ROOT / "cgroup.controllers").exists():
            return False
        return all((CGROUP_ROOT / c / _own_group(c)).is_dir() for c in CONTROLLERS)

    def apply(self, name: str, pid: int, *, cpus: float, memory_bytes: int, pids: int) -> None:
        """Limit the process tree rooted at `pid` (blocking: call from a thread)."""
        if pid <= 0:
            # Writing 0 to cgroup.procs would move the server itself.
            raise ValueError(f"no process to limit (pid {pid})")
        groups = {c: parent / name for c, parent in self._parents.items()}
        for group in groups.values():
            group.mkdir(parents=True, exist_ok=True)
        (groups["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
        swap_limit = groups["memory"] / "memory.memsw.limit_in_bytes"
        if swap_limit.exists():
            swap_limit.write_text(str(memory_bytes))
        (groups["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (groups["cpu"] / "cpu.cfs_quota_us").write_text(str(max(int(cpus * CPU_PERIOD_US), 1000)))
        (groups["pids"] / "pids.max").write_text(str(pids))
        # The root first: what it forks from then on is born inside; then what it had forked.
        for group in groups.values():
            with contextlib.suppress(ProcessLookupError):
                (group / "cgroup.procs").write_text(str(pid))
        for process in _descendants(pid):
            for group in groups.values():
                with contextlib.suppress(ProcessLookupError):
                    (group / "cgroup.procs").write_text(str(process))

    def adopt(self, name: str, init_pid: int, marker: bytes) -> bool:
        """Move every process of the sandbox's pid namespace (the one of its `init_pid`)
        that is outside the sandbox's groups into them (blocking: call from a thread).

        `podman exec` starts its command outside these groups: the exec fallback runs
        each command under a wrapper that waits until it is inside, and calls this until
        the wrapper, found by the `marker` in its command line, has been moved.
        Returns True once a process carrying `marker` is inside the groups."""
        try:
            namespace = os.readlink(f"/proc/{init_pid}/ns/pid")
        except OSError:
            return False  # the container is gone: the exec fails on its own
        if init_pid <= 0 or namespace == os.readlink("/proc/self/ns/pid"):
            raise ValueError(f"pid {init_pid} is not in a sandbox's own pid namespace")
        groups = [self._parents[c] / name for c in CONTROLLERS]
        suffix = f"/{name}"
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                    continue
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                inside = {
                    controller
                    for line in Path(f"/proc/{entry}/cgroup").read_text().splitlines()
                    for controller in line.split(":", 2)[1].split(",")
                    if line.endswith(suffix)
                }
                for controller, group in zip(CONTROLLERS, groups, strict=True):
                    if controller not in inside:
                        (group / "cgroup.procs").write_text(entry)
            except (OSError, IndexError):  # the process exited meanwhile
                continue
            found = found or marker in cmdline
        return found

    def limits_hit(self, name: str) -> list[str]:
        """Which limits the sandbox has run into, e.g. ["memory", "pids"] (blocking)."""
        hit = []
        memory = self._parents["memory"] / name
        # An OOM kill, not failcnt (which also counts page cache reclaimed at the limit),
        # where the kernel counts them (4.13 and later).
        if memory.is_dir():
            oom = (memory / "memory.oom_control").read_text().splitlines()
            kills = [int(line.split()[1]) for line in oom if line.startswith("oom_kill ")]
            counter = kills[0] if kills else int((memory / "memory.failcnt").read_text() or 0)
            if counter > 0:
                hit.append("memory")
        events = self._parents["pids"] / name / "pids.events"
        if events.exists() and any(
            line.split()[0] == "max" and int(line.split()[1]) > 0 for line in events.read_text().splitlines()
        ):
            hit.append("pids")
        return hit

    def remove(self, name: str, *, patience_s: float = 2.0) -> None:
        """Remove a sandbox's groups once its processes are gone (blocking)."""
        deadline = time.monotonic() + patience_s
        for parent in self._parents.values():
            group = parent / name
            while True:  # processes of a removed container may take a moment to exit
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        log.warning("cgroup_not_removed", group=str(group))
                        break
                    time.sleep(0.05)

    def remove_all(self, *, patience_s: float = SHUTDOWN_PATIENCE_S) -> None:
        """Remove every group of this server, and its parent groups (blocking). At shutdown
        the processes of hundreds of containers removed at once may take many seconds to
        exit on a busy host: their groups are waited for up to `patience_s` in all."""
        deadline = time.monotonic() + patience_s
        for parent in self._parents.values():
            if parent.is_dir():
                for child in parent.iterdir():
                    if child.is_dir():
                        self.remove(child.name, patience_s=max(deadline - time.monotonic(), 0.0))
                with contextlib.suppress(OSError):
                    parent.rmdir()
