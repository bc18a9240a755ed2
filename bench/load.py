"""Load run: many jobs through one RolloutStream, many sandboxes at once, an instant fake LLM.

What it measures (defaults: 1,000 jobs, 64 concurrent sandboxes):
- the server runs as its own process (`python -m prorl_server serve`), so its
  open file descriptors and RSS are read from /proc/<pid> without the
  client's; it uses a Podman service this script starts as the sandbox user
  (like bench/common.py), which outlives the server so leftovers can be
  counted after it stops;
- the fake LLM is the scripted OpenAI-chat server, in this process, answering
  at once: turn 1 runs `print(a * b)` in the job's sandbox through the python
  tool, turn 2 calls finish with whatever the sandbox printed, so a reward of
  1 proves the sandbox ran the code;
- a warm-up batch of `concurrency` jobs, then the baseline: open fds and
  VmRSS of the server once it is idle again;
- then every job in ONE RolloutStream call; every 0.5 s a sampler counts the
  sandboxes of the server (socket folders: from the start of the creation to
  the end of the removal), its containers that exist in Podman (label), the
  sandboxes jobs hold (GetStats), and reads the server's fds and RSS;
- when idle again (same procedure as the baseline): fds and RSS, containers
  left, then again after SIGTERM (containers, cgroups, socket folders).

Pass criteria: every job has exactly one result, SUCCEEDED with reward 1;
no rejection; the peak of concurrent sandboxes is exactly `concurrency`
(sandbox.max_sandboxes: reached, never exceeded, in Podman either); fds
back within FD_MARGIN of the baseline; RSS within RSS_MARGIN_MIB; no
container, cgroup or socket folder left. Exit status 1 when one fails.

Usage: python bench/load.py [--jobs N] [--concurrency C]   (make bench-load)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podman import PodmanClient

from prorl_client import Client, v1
from prorl_server.logging import configure_logging
from prorl_server.sandbox.podman import LABEL_SERVER
from prorl_server.sandbox.podman.service import PodmanService
from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply, tool_call_text, turn_index, user_prompt

FD_MARGIN = 8
RSS_MARGIN_MIB = 64.0
SAMPLE_INTERVAL_S = 0.5
# Idle time before fds and RSS are read: beyond aiohttp's keep-alive (15 s, swept every 15 s),
# so that pooled connections to the LLM are closed at both readings.
SETTLE_S = 35.0
STATE_DIR = Path("/var/lib/prorl")
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


def script(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Turn 1: compute in the sandbox; turn 2: submit what the sandbox printed."""
    if turn_index(messages) == 0:
        a, b = re.findall(r"\d+", user_prompt(messages))[:2]
        return ScriptedReply(tool_call_text("python", {"code": f"print({a} * {b})"}))
    found = TOOL_RESPONSE.search(str(messages[-1].get("content", "")))
    return ScriptedReply(tool_call_text("finish", {"answer": found.group(1).strip() if found else ""}))


def make_request(prefix: str, index: int) -> v1.RolloutRequest:
    a, b = 100 + index, 3 + index % 17
    request = v1.RolloutRequest(job_id=f"{prefix}-{index:05d}", handler="math")
    request.instance.update({"question": f"What is {a} * {b}?", "answer": str(a * b)})
    request.limits.max_turns = 4
    return request


@dataclass
class ProcessSample:
    fds: int
    rss_mib: float


def fd_kind(target: str) -> str:
    if target.startswith(("socket:", "pipe:")):
        return target.split(":")[0]
    return target if target.startswith("anon_inode:") else "file"


def sample_process(pid: int) -> ProcessSample:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return ProcessSample(len(os.listdir(f"/proc/{pid}/fd")), rss_kib / 1024)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class ServerProcess:
    """`python -m prorl_server serve` with --set flags; stderr drained, its tail kept."""

    def __init__(self, settings: dict[str, object]) -> None:
        self._settings = settings
        self._process: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.address = ""

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def start(self, timeout_s: float = 120.0) -> None:
        flags: list[str] = []
        for key, value in self._settings.items():
            flags += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
        environ = {name: value for name, value in os.environ.items() if not name.startswith("PRORL_")}
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prorl_server", "serve", "--port", "0", *flags,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            cwd="/", env=environ,
        )  # fmt: skip
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._drain = asyncio.create_task(self._drain_stderr(listening))
        try:
            async with asyncio.timeout(timeout_s):
                self.address = await listening
        except BaseException:
            await self.stop()
            raise

    async def _drain_stderr(self, listening: asyncio.Future[str]) -> None:
        assert self._process is not None and self._process.stderr is not None
        async for raw in self._process.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.stderr_tail.append(line)
            if line.startswith("prorl-server listening on ") and not listening.done():
                listening.set_result(line.split()[-1])
        if not listening.done():
            listening.set_exception(RuntimeError("the server exited before listening:\n" + self.tail()))

    def tail(self) -> str:
        return "\n".join(self.stderr_tail)

    async def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM, wait for the exit (SIGKILL after timeout_s); the exit code."""
        process = self._process
        if process is None:
            return None
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._drain is not None:
            with contextlib.suppress(Exception):
                await self._drain
        return process.returncode


@dataclass
class Peaks:
    containers: int = 0
    folders: int = 0
    held: int = 0
    fds: int = 0
    rss_mib: float = 0.0
    container_samples: list[int] = field(default_factory=list)


async def count_containers(podman: PodmanClient, instance: str) -> int:
    found = await asyncio.to_thread(podman.containers.list, all=True, filters={"label": f"{LABEL_SERVER}={instance}"})
    return len(found)


async def sample_until_stopped(
    stop: asyncio.Event, peaks: Peaks, podman: PodmanClient, instance: str, client: Client, pid: int
) -> None:
    while not stop.is_set():
        peaks.container_samples.append(await count_containers(podman, instance))
        peaks.containers = max(peaks.containers, peaks.container_samples[-1])
        peaks.folders = max(peaks.folders, socket_folders(instance))
        peaks.held = max(peaks.held, (await client.get_stats()).sandboxes_busy)
        server = sample_process(pid)
        peaks.fds, peaks.rss_mib = max(peaks.fds, server.fds), max(peaks.rss_mib, server.rss_mib)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class BatchOutcome:
    results: dict[str, v1.RolloutResult] = field(default_factory=dict)
    duplicates: int = 0
    rejected: list[str] = field(default_factory=list)
    events: int = 0
    wall_s: float = 0.0


async def run_batch(client: Client, requests: list[v1.RolloutRequest]) -> BatchOutcome:
    outcome = BatchOutcome()
    started = time.perf_counter()
    async for item in client.rollout_many(requests):
        outcome.events += 1
        if isinstance(item, v1.RolloutRejected):
            outcome.rejected.append(f"{item.job_id}: {item.message}")
        elif item.HasField("finished"):
            result = item.finished.result
            outcome.duplicates += result.job_id in outcome.results
            outcome.results[result.job_id] = result
    outcome.wall_s = time.perf_counter() - started
    return outcome


def batch_problems(outcome: BatchOutcome, requests: list[v1.RolloutRequest]) -> list[str]:
    wanted = {request.job_id for request in requests}
    problems = [f"rejected {text}" for text in outcome.rejected[:5]]
    if outcome.duplicates:
        problems.append(f"{outcome.duplicates} duplicate results")
    missing, extra = wanted - outcome.results.keys(), outcome.results.keys() - wanted
    if missing or extra:
        problems.append(f"{len(missing)} results missing, {len(extra)} unknown job ids")
    bad = [r for r in outcome.results.values() if r.status != v1.JOB_STATUS_SUCCEEDED or r.reward != 1.0]
    problems += [
        f"{r.job_id}: {v1.JobStatus.Name(r.status)} reward {r.reward} {r.failure.reason} {r.failure.message[:200]}"
        for r in bad[:5]
    ]
    if len(bad) > 5:
        problems.append(f"... {len(bad)} jobs not SUCCEEDED with reward 1 in all")
    return problems


async def wait_idle(client: Client, podman: PodmanClient, instance: str, timeout_s: float = 120.0) -> None:
    """Until no job runs and no container of this server exists, then SETTLE_S more."""
    async with asyncio.timeout(timeout_s):
        while True:
            stats = await client.get_stats()
            active = sum(phase.active + phase.queued for phase in stats.phases)
            if not active and not stats.sandboxes_busy and not await count_containers(podman, instance):
                break
            await asyncio.sleep(0.25)
    await asyncio.sleep(SETTLE_S)


def socket_folders(instance: str) -> int:
    """Sandboxes the server has from the start of their creation until their removal is done:
    each has a socket folder for that long (made before Podman creates the container)."""
    with contextlib.suppress(FileNotFoundError):
        return len(os.listdir(STATE_DIR / "sockets" / instance))
    return 0


def leftover_paths(instance: str) -> list[str]:
    groups = [str(p) for c in ("memory", "pids", "cpu") for p in Path("/sys/fs/cgroup", c).glob(f"prorl-{instance}*")]
    sockets = STATE_DIR / "sockets" / instance
    return groups + ([str(sockets)] if sockets.exists() else [])


def socket_names(pid: int) -> dict[str, str]:
    """ "socket:[inode]" -> what it is connected to (TCP ports; Unix: its or its peer's path)."""
    names: dict[str, str] = {}
    rows = [
        line.split()
        for table in ("tcp", "tcp6")
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
    ]
    listening = {row[1].split(":")[1] for row in rows if row[3] == "0A"}
    for row in rows:
        local, remote = (address.split(":")[1] for address in row[1:3])
        if row[3] == "0A":
            name = f"tcp listening :{int(local, 16)}"
        elif local in listening:
            name = f"tcp accepted on :{int(local, 16)}"
        else:
            name = f"tcp to :{int(remote, 16)}"
        names[f"socket:[{row[9]}]"] = name
    paths: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) > 7:
            paths[parts[6]] = re.sub(r"[0-9a-f]{12}", "<id>", parts[7])
    listing = subprocess.run(["ss", "-xan"], capture_output=True, text=True, check=False).stdout
    for line in listing.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[0].startswith("u_"):
            path = paths.get(parts[5]) or paths.get(parts[7]) or "unnamed"
            names.setdefault(f"socket:[{parts[5]}]", f"unix {path}")
    return names


def describe_fds(pid: int) -> collections.Counter[str]:
    """Open fds of `pid` by what they are."""
    names = socket_names(pid)
    found: collections.Counter[str] = collections.Counter()
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(fd_dir / entry)
            found[names.get(target, fd_kind(target))] += 1
    return found


def counter_delta(before: collections.Counter[str], after: collections.Counter[str]) -> str:
    changed = {name: after[name] - before[name] for name in sorted(set(before) | set(after))}
    return ", ".join(f"{name} {delta:+d}" for name, delta in changed.items() if delta) or "none"


@contextlib.asynccontextmanager
async def scripted_llm() -> AsyncIterator[ScriptedLLMServer]:
    llm = ScriptedLLMServer(script)
    await llm.start()
    try:
        yield llm
    finally:
        await llm.stop()


async def main(args: argparse.Namespace) -> int:
    instance = f"bench-load-{os.getpid()}"
    concurrency, retain = args.concurrency, args.retain
    print(
        f"# load run, {os.cpu_count()} cores: {args.jobs} jobs, {concurrency} concurrent sandboxes, instance {instance}"
    )
    print(f"# store on (SQLite in a temporary folder), jobs.retain_finished={retain}, sandboxes of 128 MiB")
    print(f"# sandbox.max_sandboxes, phases.init/run/eval and sandbox.podman_threads: {concurrency}\n")
    checks: list[Check] = []
    store_dir = tempfile.mkdtemp(prefix="prorl-bench-load-")
    service = PodmanService(user="prorl", name=instance)
    await service.start()
    podman = PodmanClient(base_url=service.url, timeout=120)
    try:
        async with scripted_llm() as llm:
            server = ServerProcess(
                {
                    "server.instance_id": instance,
                    "server.log_level": "warning",
                    "server.shutdown_grace_s": 30,
                    "sandbox.podman_socket": service.url,
                    "sandbox.memory_mib": 128,
                    "sandbox.tmp_mib": 64,
                    "sandbox.podman_threads": concurrency,
                    "sandbox.max_sandboxes": concurrency,
                    "phases.init": concurrency,
                    "phases.run": concurrency,
                    "phases.eval": concurrency,
                    "jobs.store": args.store,
                    "jobs.store_path": str(Path(store_dir) / "jobs.sqlite"),
                    "jobs.retain_finished": retain,
                    "llm.backends": [{"id": "scripted", "base_url": llm.base_url}],
                    "llm.embedded.enabled": "never",
                }
            )
            await server.start()
            try:
                async with Client.connect(server.address) as client:
                    checks += await measure(args, client, server, podman, instance, llm)
            finally:
                code = await server.stop()
            left = await count_containers(podman, instance)
            paths = leftover_paths(instance)
            print(f"\nafter SIGTERM: exit code {code}, containers left {left}, cgroups/socket folders left {paths}")
            checks.append(Check("server exited 0 on SIGTERM", code == 0, f"exit code {code}"))
            checks.append(Check("no container left after the stop", left == 0, f"{left} containers"))
            checks.append(Check("no cgroup or socket folder left", not paths, ", ".join(paths) or "none"))
            if code != 0:
                print(server.tail())
    finally:
        with contextlib.suppress(Exception):
            for container in podman.containers.list(all=True, filters={"label": f"{LABEL_SERVER}={instance}"}):
                container.remove(force=True)
        podman.close()  # type: ignore[no-untyped-call]
        await service.stop()
        shutil.rmtree(store_dir, ignore_errors=True)
    print("\n## criteria")
    for check in checks:
        print(f"{'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    return 0 if all(check.ok for check in checks) else 1


async def measure(
    args: argparse.Namespace,
    client: Client,
    server: ServerProcess,
    podman: PodmanClient,
    instance: str,
    llm: ScriptedLLMServer,
) -> list[Check]:
    checks: list[Check] = []
    idle = sample_process(server.pid)
    print(f"server started: {idle.fds} fds, RSS {idle.rss_mib:.1f} MiB")
    warmup = [make_request("warmup", i) for i in range(args.warmup)]
    warm = await run_batch(client, warmup)
    problems = batch_problems(warm, warmup)
    print(f"warm-up: {len(warm.results)}/{len(warmup)} results in {warm.wall_s:.1f} s")
    checks.append(Check("warm-up batch: all SUCCEEDED with reward 1", not problems, "; ".join(problems) or "ok"))
    await wait_idle(client, podman, instance)
    before, before_fds = sample_process(server.pid), describe_fds(server.pid)
    print(f"baseline (idle after the warm-up): {before.fds} fds, RSS {before.rss_mib:.1f} MiB")
    print(
        f"  its fds (gRPC {server.address}, LLM :{llm.port}): "
        + ", ".join(f"{n} {c}" for n, c in sorted(before_fds.items()))
    )

    for round_index in range(args.rounds):
        checks += await measured_round(args, round_index, client, server, podman, instance, llm, before, before_fds)
    return checks


async def measured_round(
    args: argparse.Namespace,
    round_index: int,
    client: Client,
    server: ServerProcess,
    podman: PodmanClient,
    instance: str,
    llm: ScriptedLLMServer,
    before: ProcessSample,
    before_fds: collections.Counter[str],
) -> list[Check]:
    """One RolloutStream of args.jobs jobs, sampled; then the server idle again against the baseline."""
    checks: list[Check] = []
    tag = f" (round {round_index + 1})" if args.rounds > 1 else ""
    requests = [make_request(f"load{round_index}", i) for i in range(args.jobs)]
    peaks, stop = Peaks(), asyncio.Event()
    llm_before = len(llm.requests)
    sampler = asyncio.create_task(sample_until_stopped(stop, peaks, podman, instance, client, server.pid))
    try:
        outcome = await run_batch(client, requests)
    finally:
        stop.set()
        await sampler
    problems = batch_problems(outcome, requests)
    good = sum(r.status == v1.JOB_STATUS_SUCCEEDED and r.reward == 1.0 for r in outcome.results.values())
    nonzero = [n for n in peaks.container_samples if n]
    mean = sum(nonzero) / max(len(nonzero), 1)
    print(f"\n## {args.jobs} jobs through one RolloutStream{tag}")
    print(f"results {len(outcome.results)}/{args.jobs}, SUCCEEDED with reward 1: {good}, stream items {outcome.events}")
    print(f"LLM requests {len(llm.requests) - llm_before}")
    print(f"wall time {outcome.wall_s:.1f} s, throughput {args.jobs / outcome.wall_s:.2f} jobs/s")
    print(f"sandboxes being created, alive or being removed (socket folders): peak {peaks.folders}")
    print(f"containers in Podman (sampled every {SAMPLE_INTERVAL_S:g} s): peak {peaks.containers}, mean {mean:.1f}")
    print(f"sandboxes held by jobs (GetStats): peak {peaks.held}")
    print(f"server: peak {peaks.fds} fds, peak RSS (VmHWM, whole life) {peak_rss_mib(server.pid):.1f} MiB")
    checks.append(
        Check(
            f"{args.jobs} distinct results, all SUCCEEDED with reward 1{tag}",
            not problems,
            "; ".join(problems) or "ok",
        )
    )
    checks.append(
        Check(
            f"concurrent sandboxes reached sandbox.max_sandboxes={args.concurrency} and never exceeded it{tag}",
            peaks.folders == args.concurrency and peaks.containers <= args.concurrency,
            f"peak {peaks.folders} sandboxes, {peaks.containers} containers in Podman",
        )
    )

    await wait_idle(client, podman, instance)
    after, after_fds = sample_process(server.pid), describe_fds(server.pid)
    left = await count_containers(podman, instance)
    fd_delta, rss_delta = after.fds - before.fds, after.rss_mib - before.rss_mib
    print(f"idle after the run: {after.fds} fds ({fd_delta:+d}: {counter_delta(before_fds, after_fds)})")
    print(f"idle after the run: RSS {after.rss_mib:.1f} MiB ({rss_delta:+.1f} MiB), containers {left}")
    checks.append(
        Check(
            f"fds within {FD_MARGIN} of the baseline{tag}",
            fd_delta <= FD_MARGIN,
            f"{before.fds} -> {after.fds} ({fd_delta:+d})",
        )
    )
    checks.append(
        Check(
            f"RSS within {RSS_MARGIN_MIB:g} MiB of the baseline{tag}",
            rss_delta <= RSS_MARGIN_MIB,
            f"{before.rss_mib:.1f} -> {after.rss_mib:.1f} MiB ({rss_delta:+.1f})",
        )
    )
    checks.append(Check(f"no container left (server idle){tag}", left == 0, f"{left} containers"))
    return checks


if __name__ == "__main__":
    configure_logging(level="warning")
    parser = argparse.ArgumentParser(description="Load run of the rollout service (see the module docstring).")
    parser.add_argument("--jobs", type=int, default=1000, help="jobs in the measured RolloutStream")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="sandbox.max_sandboxes, phase limits and Podman threads of the server",
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up jobs (default: --concurrency)")
    parser.add_argument("--retain", type=int, default=None, help="jobs.retain_finished (default: --warmup)")
    parser.add_argument("--rounds", type=int, default=1, help="measured RolloutStreams, one after the other")
    parser.add_argument(
        "--store", action=argparse.BooleanOptionalAction, default=True, help="the durable job store (jobs.store)"
    )
    parsed = parser.parse_args()
    parsed.warmup = parsed.concurrency if parsed.warmup is None else parsed.warmup
    parsed.retain = parsed.warmup if parsed.retain is None else parsed.retain
    sys.exit(asyncio.run(main(parsed)))
