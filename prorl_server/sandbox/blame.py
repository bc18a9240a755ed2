"""Who broke a sandbox: the agent's own commands (POLICY) or something outside it.

Trainers mask INFRASTRUCTURE failures out of training, so a policy that could
make its sandbox fail as infrastructure could hide its worst rollouts. When a
call to the in-sandbox runtime fails, the server looks at the container from
the host before it says who is to blame:

- the sandbox's own cgroups: did it run into its pids or memory limit (a fork
  bomb, a memory hog);
- the container's init and the runtime, by host pid. The runtime serves from a
  child of the container's PID 1 (`prorl_runtime.py serve --init`), and the
  kernel lets nothing inside a PID namespace signal its init, so init is gone
  only when the container was stopped or killed from outside. With init alive,
  a runtime that is dead, stopped, or cut off from the server can only be the
  doing of what runs inside;
- its filesystems, when the runtime could not write: /tmp is a tmpfs only the
  sandbox writes; the writable layer shares the host's disk, so that one is
  the agent's doing only when its own writes hold much of it.

`blame` turns that evidence into a `SandboxBroken` (kind POLICY, a specific
reason), or None when nothing rules out an outside cause: the caller then
reports INFRASTRUCTURE as before.
"""

from __future__ import annotations

import enum
import errno
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from prorl_server.errors import SandboxBroken, SandboxLimitExceeded
from prorl_server.sandbox.handle import ContainerHandle
from prorl_server.sandbox.procfs import pids_since

PROC = Path("/proc")
# task flag set from the start of a process's exit (include/linux/sched.h)
PF_EXITING = 0x4
RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM})
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# The container's writable layer is on the host's disk: a full disk is the
# agent's doing only when its own writes hold at least this much of it.
WRITABLE_LAYER_BLAME_BYTES = 1 << 30
WRITABLE_LAYER_BLAME_SHARE = 0.1


class RuntimeState(enum.Enum):
    RUNNING = "running"
    STOPPED = "stopped"
    """SIGSTOP (or a tracer): it cannot answer until continued."""
    DEAD = "dead"
    """The runtime is gone while the container still runs."""
    CONTAINER_GONE = "container_gone"
    """The container's init is gone: stopped or killed from outside."""
    UNKNOWN = "unknown"
    """Not observable from here (e.g. Podman in another PID namespace)."""


@dataclass(frozen=True)
class ProcessRef:
    """A host process, pinned by its start time so a reused pid is not mistaken for it."""

    pid: int
    start_time: int


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_ref(pid: int) -> ProcessRef | None:
    fields = _stat(pid)
    return ProcessRef(pid, int(fields[19])) if fields else None


def process_status(ref: ProcessRef) -> Literal["alive", "stopped", "gone"]:
    fields = _stat(ref.pid)
    if fields is None or int(fields[19]) != ref.start_time:
        return "gone"
    if fields[0] in ("Z", "X", "x") or int(fields[6]) & PF_EXITING:
        return "gone"
    return "stopped" if fields[0] in ("T", "t") else "alive"


@dataclass(frozen=True)
class HostView:
    """The container's init and its runtime as seen in the host's /proc (blocking reads
    of procfs: microseconds, fine on the event loop for `runtime_state`)."""

    init: ProcessRef
    runtime: ProcessRef

    @classmethod
    def find(cls, init_pid: int, marker: str) -> HostView | None:
        """Locate the runtime: the child of `init_pid` running the same command (it is
        forked, not exec'd), right after start-up, before the agent has run anything.
        None when `init_pid` is not ours to see (another PID namespace). Blocking."""
        init = process_ref(init_pid) if init_pid > 0 else None
        if init is None or marker not in _cmdline(init_pid):
            return None
        # Pids are handed out in order: the runtime, forked by init, comes soon after it.
        for entry in pids_since(init_pid):
            fields = _stat(entry)
            if fields and int(fields[1]) == init_pid and marker in _cmdline(entry):
                runtime = process_ref(entry)
                if runtime is not None:
                    return cls(init, runtime)
        return None

    def runtime_state(self) -> RuntimeState:
        if process_status(self.init) == "gone":
            return RuntimeState.CONTAINER_GONE
        return {
            "alive": RuntimeState.RUNNING,
            "stopped": RuntimeState.STOPPED,
            "gone": RuntimeState.DEAD,
        }[process_status(self.runtime)]

    def full_filesystems(self) -> dict[str, int]:
        """The container's filesystems among /tmp and / (the writable layer) that are
        (nearly) full, with their sizes in bytes. Blocking."""
        root = PROC / str(self.init.pid) / "root"
        sizes = {name: _size_if_full(path) for name, path in (("/tmp", root / "tmp"), ("/", root))}
        return {name: size for name, size in sizes.items() if size is not None}


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _size_if_full(path: Path) -> int | None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    full = free <= max(1 << 20, size // 50) or (stats.f_files > 0 and stats.f_favail == 0)
    return size if full else None


@dataclass(frozen=True)
class Symptom:
    """How a call failed: the connection ended ("closed"), no answer in time
    ("timeout"), or the runtime answered that it could not serve it ("refused",
    with the cause's errno)."""

    kind: Literal["closed", "timeout", "refused"]
    errno: int | None = None


@dataclass(frozen=True)
class Evidence:
    limits_hit: list[str] = field(default_factory=list)
    """e.g. ["pids"], ["memory"]"""
    runtime: RuntimeState = RuntimeState.UNKNOWN
    full_filesystems: list[str] = field(default_factory=list)
    """"/tmp" and "/" (the writable layer) when full; "/" only when the sandbox's own writes filled it."""


class SandboxInspector(Protocol):
    """The provider's view of one sandbox, for blame."""

    async def limits_hit(self) -> list[str]: ...

    def runtime_state(self) -> RuntimeState: ...

    async def full_filesystems(self) -> list[str]: ...

    async def describe(self) -> str: ...


class InspectableContainer(Protocol):
    """What a HostInspector asks of the container beyond /proc (the Podman provider's handle)."""

    async def limits_hit(self) -> list[str]: ...

    async def describe(self) -> str: ...

    async def writable_layer_bytes(self) -> int:
        """Bytes the sandbox's own writes hold in its writable layer; 0 when not known."""
        ...


class HostInspector:
    """A SandboxInspector for a container on this host (the Podman provider's)."""

    def __init__(
        self,
        view: HostView | None,
        container: InspectableContainer,
        *,
        run_in_thread: Callable[[Callable[[], dict[str, int]]], Awaitable[dict[str, int]]],
    ) -> None:
        self._view = view
        self._container = container
        self._thread = run_in_thread

    async def limits_hit(self) -> list[str]:
        return await self._container.limits_hit()

    def runtime_state(self) -> RuntimeState:
        return self._view.runtime_state() if self._view else RuntimeState.UNKNOWN

    async def full_filesystems(self) -> list[str]:
        view = self._view
        if view is None:
            return []
        full = await self._thread(view.full_filesystems)
        if "/" in full:
            written = await self._container.writable_layer_bytes()
            if written < min(WRITABLE_LAYER_BLAME_BYTES, full["/"] * WRITABLE_LAYER_BLAME_SHARE):
                del full["/"]  # the host's disk is full, but not by this sandbox
        return sorted(full)

    async def describe(self) -> str:
        return await self._container.describe()


class NullInspector:
    """A SandboxInspector that sees no processes and no filesystems (a sandbox that is
    not a container on this host, e.g. the test fake's): nothing is ever blamed on the
    agent but the limits its handle reports, and failures stay INFRASTRUCTURE."""

    def __init__(self, container: ContainerHandle | None = None) -> None:
        self._container = container

    async def limits_hit(self) -> list[str]:
        return await self._container.limits_hit() if self._container else []

    def runtime_state(self) -> RuntimeState:
        return RuntimeState.UNKNOWN

    async def full_filesystems(self) -> list[str]:
        return []

    async def describe(self) -> str:
        return await self._container.describe() if self._container else "not inspectable"


async def gather(inspector: SandboxInspector, symptom: Symptom) -> Evidence:
    """What blame needs for this symptom, and no more (a full disk only matters for ENOSPC)."""
    if symptom.kind == "refused":
        if symptom.errno in DISK_ERRNOS:
            return Evidence(full_filesystems=await inspector.full_filesystems())
        if symptom.errno in RESOURCE_ERRNOS:
            return Evidence(limits_hit=await inspector.limits_hit())
        return Evidence()
    return Evidence(limits_hit=await inspector.limits_hit(), runtime=inspector.runtime_state())


def blame(op: str, symptom: Symptom, evidence: Evidence) -> SandboxBroken | None:
    """The policy error for a failed call, or None when an outside cause is not ruled out."""
    if evidence.limits_hit and (symptom.kind != "refused" or symptom.errno in RESOURCE_ERRNOS):
        limit = "pids" if "pids" in evidence.limits_hit else evidence.limits_hit[0]
        return SandboxLimitExceeded(
            f"the sandbox stopped serving {op} after reaching its {' and '.join(evidence.limits_hit)} limit",
            reason=f"{limit}_limit",
        )
    if symptom.kind == "refused":
        if symptom.errno in DISK_ERRNOS and evidence.full_filesystems:
            where = " and ".join("its writable layer" if f == "/" else f for f in evidence.full_filesystems)
            return SandboxBroken(f"the sandbox could not serve {op}: the agent filled {where}", reason="disk_full")
        return None
    if evidence.runtime is RuntimeState.DEAD:
        return SandboxBroken(
            f"the sandbox runtime was killed from inside the sandbox (during {op}); the container still runs",
            reason="runtime_killed",
        )
    if evidence.runtime is RuntimeState.STOPPED:
        return SandboxBroken(
            f"the sandbox runtime was stopped from inside the sandbox (during {op}), e.g. by SIGSTOP",
            reason="runtime_stopped",
        )
    if evidence.runtime is RuntimeState.RUNNING and symptom.kind == "closed":
        return SandboxBroken(
            f"the sandbox runtime's connection was closed from inside the sandbox (during {op})",
            reason="runtime_socket_closed",
        )
    return None
