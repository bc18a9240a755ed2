"""The host limits that decide how many sandboxes one node holds, checked when the
Podman provider starts.

Measured with `make bench-live` (docs/benchmarks.md): an idle sandbox is three
processes of the containers' one host uid (the runtime as init, the runtime,
its bash), one conmon of the sandbox user, about 15 MiB of memory and one file
descriptor of the server. Every sandbox's processes run under the same mapped
host uid, so RLIMIT_NPROC counts all of them together: past the ceiling a
`fork` fails in whichever sandbox asks next, a failure no job could be blamed
for. The check says, at start-up, which limit a node reaches first and what to
change; it raises the server's own open-files limit where the hard limit allows.
"""

from __future__ import annotations

import pwd
import re
import resource
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

USER_NPROC_CEILING = 16384
"""RLIMIT_NPROC of every sandbox (containers.conf default_ulimits too): the ceiling for
all sandboxes together, since they share one host uid; pids per sandbox is the cgroup's
job. Half of this kernel's default pid_max (32768), so sandboxes cannot take the host's
last process ids."""
IDLE_PROCESSES = 3
IDLE_MIB = 16
SERVER_FDS = 256
"""Descriptors the server needs besides one per sandbox (gRPC, the store, the model)."""


@dataclass(frozen=True)
class HostFacts:
    pid_max: int
    keys_maxkeys: int
    keyring_off: bool
    """`keyring = false` in the sandbox user's containers.conf: runc then gives a
    container no session keyring (else each takes one of kernel.keys.maxkeys)."""
    nofile_soft: int
    nofile_hard: int
    memory_mib: int


def _int_file(path: str, default: int) -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _memory_mib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def keyring_off(containers_conf: Path) -> bool:
    """Whether the [containers] table of a containers.conf sets `keyring = false`."""
    try:
        text = containers_conf.read_text()
    except OSError:
        return False
    table = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("["):
            table = line.strip("[] ")
        elif table == "containers" and re.fullmatch(r"keyring\s*=\s*false", line):
            return True
    return False


def read_host_facts(sandbox_user: str) -> HostFacts:
    """The facts from /proc and the sandbox user's containers.conf (blocking: files)."""
    try:
        home = Path(pwd.getpwnam(sandbox_user).pw_dir)
    except KeyError:
        home = Path.home()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return HostFacts(
        pid_max=_int_file("/proc/sys/kernel/pid_max", 32768),
        keys_maxkeys=_int_file("/proc/sys/kernel/keys/maxkeys", 200),
        keyring_off=keyring_off(home / ".config/containers/containers.conf"),
        nofile_soft=soft,
        nofile_hard=hard,
        memory_mib=_memory_mib(),
    )


def capacities(facts: HostFacts) -> dict[str, int]:
    """Idle sandboxes each limit allows on this host (the smallest is reached first)."""
    unlimited = 1 << 31
    hard = facts.nofile_hard if facts.nofile_hard != resource.RLIM_INFINITY else unlimited
    return {
        "memory": facts.memory_mib // IDLE_MIB,
        "nproc": USER_NPROC_CEILING // IDLE_PROCESSES,
        "pid_max": facts.pid_max // (IDLE_PROCESSES + 1),
        "nofile": max(hard - SERVER_FDS, 0),
        "maxkeys": unlimited if facts.keyring_off else facts.keys_maxkeys,
    }


_FIXES = {
    "memory": "an idle sandbox takes about {mib} MiB: lower sandbox.max_sandboxes or add memory",
    "nproc": (
        "every sandbox's processes share one host uid, whose process ceiling is {nproc} "
        "({idle} idle processes a sandbox): past it a fork fails in whichever sandbox asks; "
        "lower sandbox.max_sandboxes"
    ),
    "pid_max": "raise kernel.pid_max (sysctl -w kernel.pid_max=4194304)",
    "nofile": "the server holds one descriptor per sandbox: raise its hard open-files limit (ulimit -Hn)",
    "maxkeys": (
        "runc gives every container a session keyring and kernel.keys.maxkeys allows {keys}: set "
        "`keyring = false` under [containers] in the sandbox user's ~/.config/containers/containers.conf "
        "(scripts/setup_host.sh does), or raise kernel.keys.maxkeys"
    ),
}


def limit_problems(facts: HostFacts, max_sandboxes: int) -> list[str]:
    """One message per limit that `max_sandboxes` (0: no cap) would run into, with its fix.
    With no cap, only the keyring quota is named: it fails starts at a few hundred."""
    problems = []
    for name, allowed in capacities(facts).items():
        too_many = max_sandboxes > allowed if max_sandboxes else (name == "maxkeys" and allowed < 1 << 31)
        if too_many:
            fix = _FIXES[name].format(mib=IDLE_MIB, nproc=USER_NPROC_CEILING, idle=IDLE_PROCESSES, keys=allowed)
            held = f"sandbox.max_sandboxes = {max_sandboxes}" if max_sandboxes else "no sandbox.max_sandboxes"
            problems.append(f"{held}, but on this host {name} allows about {allowed} sandboxes: {fix}")
    return problems


def raise_nofile(facts: HostFacts, max_sandboxes: int) -> int:
    """Raise this process's soft open-files limit toward what the sandboxes need (up to
    the hard limit); the soft limit now."""
    wanted = (max_sandboxes or 4096) + SERVER_FDS
    if facts.nofile_hard != resource.RLIM_INFINITY:
        wanted = min(wanted, facts.nofile_hard)
    if wanted <= facts.nofile_soft:
        return facts.nofile_soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, facts.nofile_hard))
    except (ValueError, OSError):  # not ours to raise here: the check reports the limit
        return facts.nofile_soft
    return wanted


def check_host_limits(sandbox_user: str, max_sandboxes: int) -> list[str]:
    """Log the host's sandbox capacity and each limit `max_sandboxes` would run into
    (blocking: call it in a thread). Returns the problems logged."""
    facts = read_host_facts(sandbox_user)
    soft = raise_nofile(facts, max_sandboxes)
    allowed = capacities(facts)
    first = min(allowed, key=lambda name: allowed[name])
    log.info("sandbox_capacity", first_limit=first, sandboxes=allowed[first], nofile=soft)
    problems = limit_problems(facts, max_sandboxes)
    for problem in problems:
        log.warning("sandbox_host_limit", problem=problem)
    return problems
