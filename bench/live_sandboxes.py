"""Many live sandboxes on one node: how many, at what cost, and what stops it first.

Sandboxes (the python image, the in-sandbox runtime as the container's init, the
server's cgroup limits) are started 16 at a time and kept alive until each level
(100, 300, 1,000 by default) is reached. At each level, with every sandbox alive and after a settling pause:
- the CPU the idle sandboxes' processes and their conmons use (over 5 s);
- `echo hi` round trips one at a time, spread over all live sandboxes, twice in a row in
  each (the first after the sandbox idled, the second right after: p50, p99);
- one `echo hi` in every live sandbox at once (64 in flight), and the CPU this
  process (the provider, as in the server) spent per command;
- this process's RSS, open file descriptors and threads; the Podman service's
  RSS; the processes the sandbox user and the containers' uids run; the host's
  available memory;
- the limits that would stop it (nofile of this process and of the Podman
  service, the sandbox user's nproc, kernel.pid_max, kernel.threads-max,
  kernel.keys.maxkeys, the runtime folder's tmpfs).
The first sandbox that cannot start ends the climb; its error is printed as
what stopped it. Every sandbox is removed at the end (and timed).

Usage: python bench/live_sandboxes.py [--levels 100,300,1000] [--echo N]
       (make bench-live)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_spec, percentile, podman_provider, summary_ms
from prorl_server.logging import configure_logging
from prorl_server.sandbox.base import Sandbox
from prorl_server.sandbox.podman.host_limits import capacities, read_host_facts

STARTS_AT_ONCE = 16
COMMANDS_IN_FLIGHT = 64


def _status_kib(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _meminfo_mib(field: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _uids_of_processes() -> dict[int, int]:
    """Processes (not threads) per real uid, read from /proc."""
    counts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            counts[uid] = counts.get(uid, 0) + 1
    return counts


def _podman_service_pid(user: str) -> int | None:
    uid = pwd.getpwnam(user).pw_uid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(command) > 2 and command[0].endswith(b"podman") and b"system" in command and b"service" in command:
            return int(entry)
    return None


def _limit(pid: int | None, name: str) -> str:
    if pid is None:
        return "?"
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith(name):
                return line[len(name) :].split()[0]
    except OSError:
        pass
    return "?"


def _sysctl(name: str) -> str:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return "?"


def _sandbox_ticks() -> int:
    """CPU jiffies used so far by the sandboxes' processes (the containers' mapped uids)
    and their conmons: other work on the machine is not counted."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        command, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if uid >= 100000 or command == "conmon":
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


async def sandboxes_busy(seconds: float) -> float:
    """The share of one core the idle sandboxes (and their conmons) use over `seconds`."""
    before = await asyncio.to_thread(_sandbox_ticks)
    await asyncio.sleep(seconds)
    after = await asyncio.to_thread(_sandbox_ticks)
    return (after - before) / os.sysconf("SC_CLK_TCK") / seconds


def node_figures(service_pid: int | None, user: str) -> dict[str, str]:
    sandbox_uid = pwd.getpwnam(user).pw_uid
    by_uid = _uids_of_processes()
    ours = sum(count for uid, count in by_uid.items() if uid == sandbox_uid)
    inside = sum(count for uid, count in by_uid.items() if uid >= 100000)  # the containers' mapped uids
    return {
        "this process RSS": f"{_status_kib('self', 'VmRSS') / 1024:.0f} MiB",
        "its fds": str(len(os.listdir("/proc/self/fd"))),
        "its threads": str(_status_kib("self", "Threads")),
        "Podman service RSS": f"{_status_kib(service_pid, 'VmRSS') / 1024:.0f} MiB" if service_pid else "?",
        "Podman service fds": str(len(os.listdir(f"/proc/{service_pid}/fd"))) if service_pid else "?",
        f"processes of {user} (conmon, the service)": str(ours),
        "processes in containers (mapped uids)": str(inside),
        "host memory available": f"{_meminfo_mib('MemAvailable') / 1024:.1f} GiB",
    }


def limits(service_pid: int | None, user: str) -> dict[str, str]:
    runtime_dir = f"/run/user/{pwd.getpwnam(user).pw_uid}"
    try:
        stats = os.statvfs(runtime_dir)
        used, size = (stats.f_blocks - stats.f_bfree) * stats.f_frsize, stats.f_blocks * stats.f_frsize
        run_fs = f"{used / 2**20:.0f} of {size / 2**20:.0f} MiB"
    except OSError:
        run_fs = "?"
    return {
        "nofile, this process": str(resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
        "nofile, Podman service": _limit(service_pid, "Max open files"),
        "nproc, Podman service (its user)": _limit(service_pid, "Max processes"),
        "kernel.pid_max": _sysctl("kernel.pid_max"),
        "kernel.threads-max": _sysctl("kernel.threads-max"),
        "kernel.keys.maxkeys": _sysctl("kernel.keys.maxkeys"),
        f"{runtime_dir} used": run_fs,
    }


async def echo_serial(sandboxes: list[Sandbox], count: int) -> tuple[list[float], list[float]]:
    """`echo hi` twice in a row in each of `count` sandboxes spread over all of them, one at a
    time: (the first commands, after the sandbox idled; the second ones, right after)."""
    first: list[float] = []
    second: list[float] = []
    for index in range(count):
        sandbox = sandboxes[(index * 7919) % len(sandboxes)]
        for samples in (first, second):
            started = time.perf_counter()
            result = await sandbox.bash("echo hi", timeout_s=60)
            samples.append(time.perf_counter() - started)
            assert result.output == "hi\n", result
    return first, second


async def echo_everywhere(sandboxes: list[Sandbox]) -> tuple[float, float]:
    """(wall s, CPU ms of this process per command) for one `echo hi` in every sandbox."""
    gate = asyncio.Semaphore(COMMANDS_IN_FLIGHT)

    async def one(sandbox: Sandbox) -> None:
        async with gate:
            result = await sandbox.bash("echo hi", timeout_s=120)
            assert result.output == "hi\n", result

    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(sandbox) for sandbox in sandboxes))
    return time.perf_counter() - started, (time.process_time() - cpu) * 1000 / len(sandboxes)


async def start_up_to(provider, live: list[Sandbox], level: int) -> str | None:  # type: ignore[no-untyped-def]
    """Start sandboxes until `level` are alive; the first error that stops it, or None."""
    gate = asyncio.Semaphore(STARTS_AT_ONCE)
    errors: list[str] = []

    async def one() -> None:
        async with gate:
            if errors:
                return
            try:
                sandbox = await provider.create(default_spec())
            except Exception as exc:  # what stops the climb is the finding
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            live.append(sandbox)

    await asyncio.gather(*(one() for _ in range(level - len(live))))
    return errors[0] if errors else None


async def main(args: argparse.Namespace) -> None:
    levels = [int(level) for level in args.levels.split(",")]
    user = "prorl"
    print(f"# live sandboxes on one node: {os.cpu_count()} cores, {_meminfo_mib('MemTotal') / 1024:.1f} GiB;"
          f" load average {os.getloadavg()[0]:.1f} at the start\n")  # fmt: skip
    live: list[Sandbox] = []
    async with podman_provider(threads=32) as provider:
        service_pid = _podman_service_pid(user)
        print("limits:", "; ".join(f"{k} {v}" for k, v in limits(service_pid, user).items()))
        allowed = capacities(read_host_facts(user))
        print("idle sandboxes each limit allows (the start-up check's estimate):",
              "; ".join(f"{k} {v}" for k, v in sorted(allowed.items(), key=lambda item: item[1])))  # fmt: skip
        print("at start:", "; ".join(f"{k} {v}" for k, v in node_figures(service_pid, user).items()), "\n")
        stopped: str | None = None
        try:
            for level in levels:
                started = time.perf_counter()
                stopped = await start_up_to(provider, live, level)
                took = time.perf_counter() - started
                print(f"## {len(live)} live sandboxes (asked {level}); started in {took:.1f} s")
                if live:
                    await asyncio.sleep(args.settle)  # the start-up's stragglers (podman cleanup, conmon) end
                    busy = await sandboxes_busy(5.0)
                    print(f"idle, all of them alive: their processes use {busy:.1%} of one core"
                          f" (load average {os.getloadavg()[0]:.1f})")  # fmt: skip
                    first, again = await echo_serial(live, args.echo)
                    wall, cpu_ms = await echo_everywhere(live)
                    print(f"echo hi, one at a time over all of them, first after idling: {summary_ms(first)}")
                    print(f"                                   the same sandbox again: {summary_ms(again)}")
                    print(f"echo hi in every one ({COMMANDS_IN_FLIGHT} in flight): {wall:.2f} s,"
                          f" {cpu_ms:.2f} ms of this process's CPU per command")  # fmt: skip
                    print("; ".join(f"{k} {v}" for k, v in node_figures(service_pid, user).items()))
                    idled, hot = percentile(first, 50) * 1000, percentile(again, 50) * 1000
                    print(f"p50 {idled:.2f} ms after idling, {hot:.2f} ms again (target < 5 ms)\n")
                if stopped:
                    print(f"stopped at {len(live)} sandboxes by: {stopped}")
                    print("limits then:", "; ".join(f"{k} {v}" for k, v in limits(service_pid, user).items()))
                    break
        finally:
            started = time.perf_counter()
            gate = asyncio.Semaphore(STARTS_AT_ONCE)

            async def close(sandbox: Sandbox) -> None:
                async with gate:
                    await sandbox.close()

            count = len(live)
            await asyncio.gather(*(close(sandbox) for sandbox in live), return_exceptions=True)
            print(f"removed {count} sandboxes in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    configure_logging(level="warning")
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="100,300,1000", help="live sandboxes to reach, in order")
    parser.add_argument("--echo", type=int, default=300, help="serial echo round trips per level")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds between reaching a level and measuring")
    asyncio.run(main(parser.parse_args()))
