"""Sandbox benchmark: tool-call round trip, warm vs cold acquire, mass start-up, idle memory.

Everything is measured in one run on this machine, side by side:
- `echo hi` round trip through our in-sandbox runtime (Unix socket), through
  `podman exec` (podman-py, same container) and through SWE-ReX's bash session
  (its LocalRuntime, on the host: no container in its path at all);
- acquiring a sandbox from a warm pool vs creating and starting one cold;
- seconds until 50 and until 100 sandboxes started at once all answer a
  health check;
- memory per idle sandbox (PSS of its processes, runtime included, plus the
  conmon that supervises it).

Usage: python bench/sandbox.py [--echo N]   (make bench-sandbox)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_spec, percentile, podman_provider, summary_ms
from prorl_server.logging import configure_logging
from prorl_server.sandbox.allocator import SandboxAllocator
from prorl_server.sandbox.base import Sandbox


async def echo_ours(sandbox: Sandbox, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        result = await sandbox.bash("echo hi", timeout_s=10)
        samples.append(time.perf_counter() - started)
        assert result.output == "hi\n", result
    return samples


async def echo_podman_exec(provider, container_name: str, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    container = await provider.call(lambda: provider.client.containers.get(container_name))
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        code, output = await provider.call(lambda: container.exec_run(["echo", "hi"], demux=True))
        samples.append(time.perf_counter() - started)
        assert code == 0 and output[0] == b"hi\n", (code, output)
    return samples


async def echo_swerex(n: int) -> list[float] | None:
    try:
        from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
        from swerex.runtime.local import LocalRuntime
    except ImportError:
        return None
    runtime = LocalRuntime()
    await runtime.create_session(CreateBashSessionRequest())
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        result = await runtime.run_in_session(BashAction(command="echo hi"))
        samples.append(time.perf_counter() - started)
        assert "hi" in result.output
    await runtime.close()
    return samples


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def memory_of(pid: int) -> tuple[float, float]:
    """PSS in MiB of the container's process tree and of its conmon (blocking)."""
    conmon = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return sum(pss_kib(p) for p in tree(pid)) / 1024, pss_kib(conmon) / 1024


async def idle_memory_mib(provider, names: list[str]) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(inside the sandbox, conmon) PSS per idle sandbox, averaged."""
    inside, supervisor = [], []
    for name in names:
        container = await provider.call(lambda name=name: provider.client.containers.get(name))
        await provider.call(container.reload)
        sandbox_mib, conmon_mib = await asyncio.to_thread(memory_of, int(container.attrs["State"]["Pid"]))
        inside.append(sandbox_mib)
        supervisor.append(conmon_mib)
    return sum(inside) / len(inside), sum(supervisor) / len(supervisor)


async def mass_start(provider, count: int) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    sandboxes = await asyncio.gather(*(provider.create(default_spec()) for _ in range(count)))
    await asyncio.gather(*(sandbox.health() for sandbox in sandboxes))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(sandbox.close() for sandbox in sandboxes))
    return elapsed


async def mass_start_bare(provider, count: int) -> float:  # type: ignore[no-untyped-def]
    """The floor: Podman alone starting `sleep infinity` containers (no runtime, limits or mounts;
    an init only so that removal does not wait 10 s for `sleep` to ignore SIGTERM)."""
    from prorl_server.sandbox.podman import LABEL_MANAGED, LABEL_SERVER

    labels = {LABEL_MANAGED: "1", LABEL_SERVER: provider._options.instance_id}

    def start_one() -> object:
        container = provider.client.containers.create(
            "localhost/prorl-python:latest",
            command=["sleep", "infinity"],
            network_mode="none",
            labels=labels,
            init=True,
        )
        container.start()
        return container

    started = time.perf_counter()
    containers = await asyncio.gather(*(provider.call(start_one) for _ in range(count)))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(provider.call(lambda c=c: c.remove(force=True)) for c in containers))
    return elapsed


async def main(args: argparse.Namespace) -> None:
    print(f"# sandbox benchmark, {os.cpu_count()} cores\n")
    async with podman_provider(threads=32) as provider:
        sandbox = await provider.create(default_spec())
        assert sandbox.mode == "runtime"
        await echo_ours(sandbox, 20)  # warm-up
        ours = await echo_ours(sandbox, args.echo)
        execs = await echo_podman_exec(provider, sandbox.id, max(args.echo // 4, 20))
        swerex = await echo_swerex(max(args.echo // 10, 20))
        print("## `echo hi` round trip")
        print(f"ours (runtime, unix socket)   {summary_ms(ours)}")
        print(f"podman exec (podman-py)       {summary_ms(execs)}")
        if swerex:
            print(f"SWE-ReX bash session (local)  {summary_ms(swerex)}")
        print(f"ratio p50: podman exec / ours = {percentile(execs, 50) / percentile(ours, 50):.0f}x", end="")
        if swerex:
            print(f", SWE-ReX / ours = {percentile(swerex, 50) / percentile(ours, 50):.0f}x")
        else:
            print("  (swe-rex not installed: pip install swe-rex)")

        memory_names = [sandbox.id]
        idle = [await provider.create(default_spec()) for _ in range(4)]
        memory_names += [s.id for s in idle]
        inside, conmon = await idle_memory_mib(provider, memory_names)
        print("\n## memory per idle sandbox (PSS)")
        print(f"inside the container (init + runtime): {inside:.1f} MiB; conmon on the host: {conmon:.1f} MiB;"
              f" total {inside + conmon:.1f} MiB")  # fmt: skip
        for extra in [sandbox, *idle]:
            await extra.close()

        print("\n## acquire: warm pool vs cold start")
        pools = SandboxAllocator(provider, [(default_spec(), 4)])
        pools.start()
        warm, cold = [], []
        for _ in range(args.acquire):
            while not pools.stats()[0].warm:  # noqa: ASYNC110 - polling the pool's public stats
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            taken = await pools.acquire(default_spec())
            warm.append(time.perf_counter() - started)
            await taken.close()
            started = time.perf_counter()
            fresh = await provider.create(default_spec(cpus=0.5))
            await fresh.health()
            cold.append(time.perf_counter() - started)
            await fresh.close()
        await pools.close()
        print(f"warm acquire   {summary_ms(warm)}")
        print(f"cold start     {summary_ms(cold)}")
        print(f"ratio p50: cold / warm = {percentile(cold, 50) / percentile(warm, 50):.0f}x")

        print("\n## sandboxes started at once until all answer a health check")
        for count in (50, 100):
            ours_s = await mass_start(provider, count)
            bare_s = await mass_start_bare(provider, count)
            print(f"{count:4d} sandboxes: {ours_s:6.2f} s   (Podman alone, bare `sleep` containers: {bare_s:5.2f} s)")


if __name__ == "__main__":
    configure_logging(level="warning")
    parser = argparse.ArgumentParser()
    parser.add_argument("--echo", type=int, default=1000, help="echo round trips through our runtime")
    parser.add_argument("--acquire", type=int, default=30, help="warm and cold acquisitions")
    asyncio.run(main(parser.parse_args()))
