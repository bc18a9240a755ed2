"""Scale-out of a cluster: the same batch on one server, then on three sharing one PostgreSQL.

What it does, in one run (defaults: 72 math jobs of 10 model turns of 200 ms,
2 run slots per server):
- a throwaway PostgreSQL (started as tests/postgres.py does: Debian's server
  binaries, a temporary folder, a Unix socket only), a fresh database for each
  configuration; stopped and deleted at the end;
- a fake LLM of fixed latency in its own process (the scripted OpenAI-chat
  server over HTTP): model turns 1 to T-1 run Python in the job's sandbox
  (`p = a * b; print(p)`, then `print(p)`: names persist between calls),
  turn T calls finish with what the sandbox printed last, so a reward of 1
  proves the sandbox ran the code; every turn answers after --latency s;
- real `python -m prorl_server serve` processes, each with its own
  server.instance_id and its own Podman service (the server starts it as the
  sandbox user), the fake LLM as their only backend (llm.embedded.enabled =
  never), the same limits: phases.init, phases.run, phases.eval and
  cluster.claim_slots = --slots, a warm pool of --warm sandboxes so that init
  is an acquire; the cluster's timings (lease, heartbeat, poll) are the
  defaults;
- (a) one server, then (b) three servers on one database: each warms up
  (twice its slots in jobs), waits until its warm pools are full and it is
  idle, then ALL jobs go to server a through one RolloutStream. The wall time
  runs from the stream's start to the last `finished` event.

Printed per configuration: wall time, jobs/s, each server's share of the jobs
(from the store: the server that ran each one), the claim slots held during
the run (the store, sampled), the mean job's time by part (from each result's
timing) and the slot-bound floor (jobs x mean hold / slots); the CPU used,
by the whole machine (against its idle baseline measured first: the machine
may be shared) and by kind of process (sampled from /proc; --cpu-detail
lists the commands). Then the ratio of the wall times against its target
(>= 2.7x), taken apart into what the longer holds cost and what the cluster's
own work (claims, leases, streaming through server a) cost, and which of the
run phase and the machine's CPU was the bottleneck.

Sizing: the three servers of (b) share this machine's cores, where a real
cluster has a machine each. Every job costs about 0.3-0.4 s of CPU whatever
runs it, most of it the sandbox's life (container start for the warm pool,
the in-sandbox runtime, removal), so two cores run at most about 6 jobs/s;
past about 60% busy, tool calls and container removal slow down and the
jobs hold their slots longer. The defaults keep (b) near 40% busy (6 slots,
jobs of about 2.3 s) so that the run phase, waiting on the model, is the
bottleneck; more slots or shorter jobs show the machine's limit instead
(docs/benchmarks.md, "Cluster scale-out").

Exit status 1 unless every job of both configurations has exactly one result,
SUCCEEDED with reward 1, with its events numbered without a gap, no job was
rejected or run twice, the fake LLM answered exactly jobs x turns requests,
every server of (b) ran a share and is listed live by GetStats, and every
server exits 0 on SIGTERM leaving no container, cgroup, socket folder or
Podman service. The ratio is reported against its target (met or MISSED),
not made an exit condition: on a shared 2-core machine it moves with the
neighbours' load, which the output shows.

Usage: python bench/cluster.py [--jobs N] [--slots R] [--turns T] [--latency S] [--warm W] [--cpu-detail]
       (make bench-cluster)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import pwd
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
from google.protobuf.duration_pb2 import Duration

from bench.load import ServerProcess, leftover_paths
from prorl_client import Client, v1
from prorl_server.logging import configure_logging
from prorl_server.sandbox.podman import LABEL_SERVER
from tests.fakes.scripted_llm import Script, ScriptedLLMServer, ScriptedReply, tool_call_text, turn_index, user_prompt
from tests.postgres import PostgresCluster, throwaway_postgres

TARGET_RATIO = 2.7
CPU_BOUND_SHARE = 0.6
"""Above this share of the machine's CPU busy during (b), the three servers slow each other down."""
SERVERS = 3
SANDBOX_USER = "prorl"
SAMPLE_INTERVAL_S = 0.5
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MARKER = f"bcl{os.getpid()}-"
"""Starts this run's instance ids: names its containers, cgroups and Podman sockets."""


# --- the fake LLM (its own process) -----------------------------------------------------------


def policy(turns: int, latency_s: float) -> Script:
    """Turns 1..T-1: Python in the sandbox; turn T: finish with what the sandbox printed last."""

    def reply(messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn == 0:
            a, b = re.findall(r"\d+", user_prompt(messages))[:2]
            return ScriptedReply(tool_call_text("python", {"code": f"p = {a} * {b}\nprint(p)"}), delay_s=latency_s)
        if turn < turns - 1:
            return ScriptedReply(tool_call_text("python", {"code": "print(p)"}), delay_s=latency_s)
        found = TOOL_RESPONSE.findall(str(messages[-1].get("content", "")))
        answer = found[-1].strip() if found else ""
        return ScriptedReply(tool_call_text("finish", {"answer": answer}), delay_s=latency_s)

    return reply


async def serve_llm(turns: int, latency_s: float) -> None:
    """Prints the base URL, serves until stdin closes, then prints the request count."""
    server = ScriptedLLMServer(policy(turns, latency_s))
    await server.start()
    print(server.base_url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()
    print(json.dumps({"requests": len(server.requests)}), flush=True)


class FakeLLM:
    """This script run with --serve-llm, as a child process."""

    def __init__(self, turns: int, latency_s: float) -> None:
        self._argv = [__file__, "--serve-llm", "--turns", str(turns), "--latency", str(latency_s)]
        self._process: asyncio.subprocess.Process | None = None
        self.base_url = ""

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert self._process.stdout is not None
        async with asyncio.timeout(30):
            self.base_url = (await self._process.stdout.readline()).decode().strip()
        if not self.base_url.startswith("http://"):
            raise RuntimeError(f"the fake LLM did not start (it said {self.base_url!r})")

    async def stop(self) -> int:
        """Ends it; the requests it served."""
        process = self._process
        if process is None:
            return 0
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()
        try:
            async with asyncio.timeout(30):
                said = (await process.stdout.read()).decode()
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
            return 0
        with contextlib.suppress(ValueError, IndexError):
            return int(json.loads(said.strip().splitlines()[-1])["requests"])
        return 0


def make_request(prefix: str, index: int, turns: int) -> v1.RolloutRequest:
    a, b = 100 + index, 3 + index % 17
    request = v1.RolloutRequest(job_id=f"{prefix}-{index:04d}", handler="math")
    request.instance.update({"question": f"What is {a} * {b}?", "answer": str(a * b)})
    request.limits.max_turns = turns
    return request


# --- CPU accounting -------------------------------------------------------------------------


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    total = sum(values[:8])  # guest time is already in user
    return total - idle, total


SERVERS_KIND = "prorl servers"
OWN_KIND = "bench client, fake LLM"
POSTGRES_KIND = "PostgreSQL"
SANDBOX_KIND = "sandboxes (in their containers)"
SERVICE_KIND = "Podman services"
CONMON_KIND = "conmon"
HELPER_KIND = "Podman's helpers (runc, cleanup, ...)"
OTHERS_KIND = "not this bench's (other load)"


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class ProcessCpu:
    """CPU of the processes seen over a window, by kind: sampled, so a process that lives
    less than a sample interval (or its last interval) is not seen (it counts as unseen).

    This bench's processes are told apart from any other load on the machine: its
    servers and its own pids; its PostgreSQL (the postmaster and its children); its
    sandboxes (their cgroups are named after the servers' instance ids); the servers'
    Podman services and the containers' conmon (their command lines name the instance);
    and their descendants (runc, `podman container cleanup`, ...)."""

    marker: str
    """What this bench's instance ids start with."""
    server_pids: set[int]
    own_pids: set[int]
    postgres_pid: int | None
    first: dict[tuple[int, int], int] = field(default_factory=dict)
    last: dict[tuple[int, int], int] = field(default_factory=dict)
    kinds: dict[tuple[int, int], str] = field(default_factory=dict)
    commands: dict[tuple[int, int], str] = field(default_factory=dict)

    def sample(self, initial: bool = False) -> None:
        table: dict[int, tuple[str, int, int, int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            raw = _read(f"/proc/{entry}/stat")
            if not raw:
                continue
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            rest = raw[raw.rindex(")") + 2 :].split()
            # rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15, starttime 22.
            table[int(entry)] = (comm, int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[19]))
        known: dict[int, str] = {}
        for pid, (_comm, _ppid, ticks, start) in table.items():
            key = (pid, start)
            if key not in self.kinds:
                self.kinds[key] = self._kind(pid, table, known)
                self.commands[key] = table[pid][0]
                self.first[key] = ticks if initial else 0
            self.last[key] = ticks

    def _kind(self, pid: int, table: dict[int, tuple[str, int, int, int]], known: dict[int, str]) -> str:
        if pid in known:
            return known[pid]
        comm, ppid = table[pid][0], table[pid][1]
        kind = OTHERS_KIND
        if pid in self.server_pids:
            kind = SERVERS_KIND
        elif pid in self.own_pids:
            kind = OWN_KIND
        elif self.postgres_pid is not None and self.postgres_pid in (pid, ppid):
            kind = POSTGRES_KIND
        elif f"/{self.marker}" in _read(f"/proc/{pid}/cgroup"):
            kind = SANDBOX_KIND
        elif self.marker in _read(f"/proc/{pid}/cmdline"):
            kind = {"podman": SERVICE_KIND, "conmon": CONMON_KIND}.get(comm, HELPER_KIND)
        elif ppid in table and ppid != pid and ppid > 1:
            parent = self._kind(ppid, table, known)
            if parent not in (OTHERS_KIND, POSTGRES_KIND, OWN_KIND):
                kind = HELPER_KIND
        known[pid] = kind
        return kind

    def by_kind(self) -> dict[str, float]:
        """CPU seconds per kind over the window."""
        spent: dict[str, float] = {}
        for key, ticks in self.last.items():
            kind = self.kinds[key]
            spent[kind] = spent.get(kind, 0.0) + (ticks - self.first[key]) / CLOCK_TICKS
        return spent

    def by_command(self) -> dict[tuple[str, str], tuple[float, int]]:
        """(kind, command name) -> (CPU seconds over the window, processes)."""
        spent: dict[tuple[str, str], tuple[float, int]] = {}
        for key, ticks in self.last.items():
            seconds, count = spent.get((self.kinds[key], self.commands[key]), (0.0, 0))
            spent[(self.kinds[key], self.commands[key])] = (
                seconds + (ticks - self.first[key]) / CLOCK_TICKS,
                count + 1,
            )
        return spent


@dataclass
class CpuWindow:
    wall_s: float
    busy_s: float
    total_s: float
    kinds: dict[str, float]
    commands: dict[tuple[str, str], tuple[float, int]]

    @property
    def busy_share(self) -> float:
        return self.busy_s / self.total_s if self.total_s else 0.0


async def idle_baseline(seconds: float = 3.0) -> float:
    """Share of the machine's CPU busy while this bench does nothing (others' load)."""
    busy0, total0 = machine_ticks()
    await asyncio.sleep(seconds)
    busy1, total1 = machine_ticks()
    return (busy1 - busy0) / max(total1 - total0, 1)


# --- servers ----------------------------------------------------------------------------------


def server_settings(instance: str, url: str, llm_url: str, args: argparse.Namespace) -> dict[str, object]:
    return {
        "server.instance_id": instance,
        "server.log_level": "warning",
        "server.shutdown_grace_s": 10,
        "jobs.store": url,
        "llm.embedded.enabled": "never",
        "llm.backends": [{"id": "fake", "base_url": llm_url}],
        "phases.init": args.slots,
        "phases.run": args.slots,
        "phases.eval": args.slots,
        "cluster.claim_slots": args.slots,
        "sandbox.memory_mib": 128,
        "sandbox.tmp_mib": 64,
        "sandbox.warm_pools": [{"size": args.warm}],
    }


def podman_as_sandbox_user(*argv: str) -> subprocess.CompletedProcess[str]:
    uid = pwd.getpwnam(SANDBOX_USER).pw_uid
    environ = f"XDG_RUNTIME_DIR=/run/user/{uid}"
    command = ["runuser", "-u", SANDBOX_USER, "--", "env", environ, "podman", *argv]
    if os.geteuid() != 0:
        command = ["podman", *argv]
    return subprocess.run(command, capture_output=True, text=True, check=False, cwd="/", timeout=120)


def containers_of(instance: str) -> list[str]:
    listed = podman_as_sandbox_user("ps", "-a", "-q", "--filter", f"label={LABEL_SERVER}={instance}")
    return listed.stdout.split()


def podman_services_of(instance: str) -> list[int]:
    """`podman system service` processes of this server still running (their socket names it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if b"service" in argv and any(f"prorl-{instance}-".encode() in arg for arg in argv):
                    found.append(int(entry))
    return found


async def wait_ready(clients: list[Client], timeout_s: float = 180.0) -> None:
    """Until every server is idle with its warm pool full."""
    async with asyncio.timeout(timeout_s):
        while True:
            ready = 0
            for client in clients:
                stats = await client.get_stats()
                pools_full = all(pool.warm >= pool.target for pool in stats.pools) and len(stats.pools) > 0
                active = sum(phase.active + phase.queued for phase in stats.phases)
                if pools_full and not active and not stats.sandboxes_busy:
                    ready += 1
            if ready == len(clients):
                return
            await asyncio.sleep(0.25)


# --- one configuration --------------------------------------------------------------------


@dataclass
class Batch:
    results: dict[str, v1.RolloutResult]
    problems: list[str]
    events: int
    wall_s: float


@dataclass
class Outcome:
    servers: int
    batch: Batch
    shares: dict[str, int]
    held: dict[str, list[int]]
    cpu: CpuWindow
    exit_codes: dict[str, int | None]
    leftovers: list[str]
    log_lines: list[str]


async def run_batch(client: Client, requests: list[v1.RolloutRequest]) -> Batch:
    """Every request through one RolloutStream; problems: rejections, second results, missing
    results, a job's events not numbered 1, 2, 3, ... up to its `finished`, and any result
    other than SUCCEEDED with reward 1."""
    results: dict[str, v1.RolloutResult] = {}
    seqs: dict[str, list[int]] = {}
    problems: list[str] = []
    events = 0
    started = time.perf_counter()
    async for item in client.rollout_many(requests):
        events += 1
        if isinstance(item, v1.RolloutRejected):
            problems.append(f"{item.job_id} rejected: {item.message}")
            continue
        seqs.setdefault(item.job_id, []).append(item.seq)
        if item.HasField("finished"):
            if item.job_id in results:
                problems.append(f"{item.job_id}: a second result")
            results[item.job_id] = item.finished.result
    wall_s = time.perf_counter() - started
    missing = [request.job_id for request in requests if request.job_id not in results]
    if missing:
        problems.append(f"{len(missing)} jobs without a result, e.g. {missing[:3]}")
    for job_id, numbers in sorted(seqs.items()):
        if numbers != list(range(1, len(numbers) + 1)):
            problems.append(f"{job_id}: events numbered {numbers}")
    for job_id, result in sorted(results.items()):
        if (result.status, result.reward) != (v1.JOB_STATUS_SUCCEEDED, 1.0):
            status = v1.JobStatus.Name(result.status)
            problems.append(
                f"{job_id}: {status}, reward {result.reward:g} {result.failure.reason} {result.failure.message}"
            )
    return Batch(results, problems, events, wall_s)


async def sample_run(
    stop: asyncio.Event, url: str, held: dict[str, list[int]], cpu: ProcessCpu, interval_s: float
) -> None:
    """Every interval_s: the jobs each server holds (from the store), the processes' CPU."""
    conn = await asyncpg.connect(url)
    try:
        while not stop.is_set():
            rows = await conn.fetch(
                "SELECT server_id, count(*) AS n FROM jobs WHERE end_time IS NULL AND server_id IS NOT NULL "
                "GROUP BY server_id"
            )
            counts = {row["server_id"]: row["n"] for row in rows}
            for server_id, samples in held.items():
                samples.append(counts.get(server_id, 0))
            await asyncio.to_thread(cpu.sample)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await stop.wait()
    finally:
        await conn.close()


async def ran_by(url: str, prefix: str) -> tuple[dict[str, int], int]:
    """From the store: jobs per server that ran them; jobs run more than once (taken over)."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT server_id, count(*) AS n FROM jobs WHERE job_id LIKE $1 GROUP BY server_id", prefix + "-%"
        )
        again = await conn.fetchval("SELECT count(*) FROM jobs WHERE job_id LIKE $1 AND attempt > 1", prefix + "-%")
    finally:
        await conn.close()
    return {str(row["server_id"]): int(row["n"]) for row in rows}, int(again)


def batch_timeout_s(args: argparse.Namespace) -> float:
    """Three times what one server needs for the batch, and two minutes: a batch that takes longer hangs."""
    return float(args.jobs * args.turns * args.latency / args.slots * 3 + 120)


async def run_configuration(count: int, pg: PostgresCluster, llm: FakeLLM, args: argparse.Namespace) -> Outcome:
    """`count` servers on a fresh database: warm up, then every job through server A."""
    database = f"bench_cluster_{count}"
    await asyncio.to_thread(pg.client, "createdb", database)
    url = pg.url(database)
    names = [chr(ord("a") + index) for index in range(count)]
    ids = {name: f"{MARKER}{count}{name}" for name in names}
    servers = {name: ServerProcess(server_settings(ids[name], url, llm.base_url, args)) for name in names}
    for server in servers.values():
        server.stderr_tail = collections.deque()  # every line: at log level warning, only what went wrong
    clients: list[Client] = []
    try:
        began = time.perf_counter()
        await asyncio.gather(*(server.start(timeout_s=180) for server in servers.values()))
        clients = [Client.connect(server.address) for server in servers.values()]
        await wait_ready(clients)
        ready_s = time.perf_counter() - began
        warmup = [make_request(f"warmup{count}", i, args.turns) for i in range(2 * count * args.slots)]
        async with asyncio.timeout(batch_timeout_s(args)):
            warm = await run_batch(clients[0], warmup)
        if warm.problems:
            raise RuntimeError("the warm-up failed: " + "; ".join(warm.problems[:5]))
        await wait_ready(clients)
        print(
            f"\n[{count} server{'s' if count > 1 else ''}: up with full warm pools in {ready_s:.1f} s; "
            f"warm-up of {len(warmup)} jobs in {warm.wall_s:.1f} s; idle again after "
            f"{time.perf_counter() - began - ready_s - warm.wall_s:.1f} s]"
        )

        prefix = f"run{count}"
        requests = [make_request(prefix, i, args.turns) for i in range(args.jobs)]
        held: dict[str, list[int]] = {ids[name]: [] for name in names}
        cpu = ProcessCpu(
            marker=f"prorl-{MARKER}",
            server_pids={server.pid for server in servers.values()},
            own_pids={os.getpid(), llm.pid},
            postgres_pid=pg.postmaster_pid(),
        )
        cpu.sample(initial=True)
        busy0, total0 = machine_ticks()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_run(stop, url, held, cpu, args.sample))
        try:
            async with asyncio.timeout(batch_timeout_s(args)):
                batch = await run_batch(clients[0], requests)
        finally:
            stop.set()
            await sampler
        cpu.sample()
        busy1, total1 = machine_ticks()
        window = CpuWindow(
            wall_s=batch.wall_s,
            busy_s=(busy1 - busy0) / CLOCK_TICKS,
            total_s=(total1 - total0) / CLOCK_TICKS,
            kinds=cpu.by_kind(),
            commands=cpu.by_command(),
        )
        stored, again = await ran_by(url, prefix)
        if again:
            batch.problems.append(f"{again} jobs ran more than once (attempt > 1: taken over after a lost lease)")
        if count > 1:
            stats = await clients[-1].get_stats(include_cluster=True)
            live = sorted(summary.server_id for summary in stats.servers if summary.live and summary.runs_jobs)
            if live != sorted(ids.values()):
                batch.problems.append(f"GetStats(include_cluster) on the last server lists {live}")
    finally:
        for client in clients:
            await client.close()
        codes = await asyncio.gather(*(server.stop() for server in servers.values()))
        leftovers = await remove_leftovers(ids)
    await asyncio.to_thread(pg.client, "dropdb", "--force", database)
    by_name = {instance: name for name, instance in ids.items()}
    return Outcome(
        servers=count,
        batch=batch,
        shares={by_name.get(server_id, server_id): n for server_id, n in stored.items()},
        held={by_name[server_id]: samples for server_id, samples in held.items()},
        cpu=window,
        exit_codes=dict(zip(names, codes, strict=True)),
        leftovers=leftovers,
        log_lines=[
            f"{name}: {line}" for name, server in servers.items() for line in server.stderr_tail if notable(line)
        ],
    )


async def remove_leftovers(ids: dict[str, str]) -> list[str]:
    """What the stopped servers left (containers, cgroups, socket folders, Podman services);
    their containers are removed here."""
    leftovers: list[str] = []
    for name, instance in ids.items():
        containers = await asyncio.to_thread(containers_of, instance)
        if containers:
            leftovers.append(f"{name}: {len(containers)} containers")
            await asyncio.to_thread(podman_as_sandbox_user, "rm", "-f", *containers)
        leftovers += [f"{name}: {path}" for path in leftover_paths(instance)]
        leftovers += [f"{name}: Podman service pid {pid}" for pid in podman_services_of(instance)]
    return leftovers


def notable(line: str) -> bool:
    """A server's stderr line worth showing (its log level is warning): not the listening line, nor
    math-verify's notice that its own timeouts are off (the server bounds it from outside)."""
    return bool(line.strip()) and not line.startswith(("prorl-server listening on ", "Timeout is disabled as "))


# --- report -----------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def seconds(duration: Duration) -> float:
    return duration.ToNanoseconds() / 1e9


def mean_timing(results: dict[str, v1.RolloutResult]) -> dict[str, float]:
    parts = ("queue", "init", "sandbox_acquire", "run", "llm", "tools", "eval", "cleanup", "total")
    timings = [result.timing for result in results.values()]
    means = {part: statistics.fmean(seconds(getattr(t, part)) for t in timings) for part in parts}
    means["hold"] = means["init"] + means["run"] + means["eval"] + means["cleanup"]
    return means


def floor_s(outcome: Outcome, args: argparse.Namespace) -> float:
    """The wall time if every slot were held all the time: jobs x mean hold / slots."""
    return int(args.jobs) * mean_timing(outcome.batch.results)["hold"] / (outcome.servers * int(args.slots))


def report(outcome: Outcome, args: argparse.Namespace, cores: int) -> list[Check]:
    batch, slots = outcome.batch, outcome.servers * args.slots
    label = "1 server" if outcome.servers == 1 else f"{outcome.servers} servers"
    print(f"\n## ({'a' if outcome.servers == 1 else 'b'}) {label}, {slots} run slots in all, all jobs submitted to a")
    good = sum((r.status, r.reward) == (v1.JOB_STATUS_SUCCEEDED, 1.0) for r in batch.results.values())
    print(f"results {len(batch.results)}/{args.jobs}, SUCCEEDED with reward 1: {good}, stream items {batch.events}")
    print(f"wall time {batch.wall_s:.2f} s, {args.jobs / batch.wall_s:.2f} jobs/s")
    total = sum(outcome.shares.values()) or 1
    print(
        "jobs run by (the store): " + ", ".join(f"{n} {c} ({c / total:.0%})" for n, c in sorted(outcome.shares.items()))
    )
    held = ", ".join(
        f"{name} {statistics.fmean(samples or [0]):.2f}/{args.slots}" for name, samples in sorted(outcome.held.items())
    )
    print(f"claim slots held, mean over the run (store, every {args.sample:g} s): {held}")
    means = mean_timing(batch.results)
    print(
        "mean job: "
        f"queue {means['queue']:.2f} s | hold {means['hold']:.3f} s = init {means['init'] * 1e3:.0f} ms "
        f"(acquire {means['sandbox_acquire'] * 1e3:.0f}) + run {means['run'] * 1e3:.0f} ms "
        f"(LLM {means['llm'] * 1e3:.0f}, tools {means['tools'] * 1e3:.0f}) + eval {means['eval'] * 1e3:.0f} ms "
        f"+ cleanup {means['cleanup'] * 1e3:.0f} ms"
    )
    floor = floor_s(outcome, args)
    print(
        f"slot-bound floor (jobs x mean hold / slots): {floor:.2f} s, "
        f"{floor / batch.wall_s:.0%} of the wall time; run phase {means['run'] / means['hold']:.0%} of the hold"
    )
    cpu = outcome.cpu
    print(
        f"CPU: machine {cpu.busy_share:.0%} busy of {cores} cores ({cpu.busy_s:.1f} core-s over {cpu.wall_s:.1f} s, "
        f"{cpu.busy_s / args.jobs * 1e3:.0f} ms per job); by process kind (core-s): "
        + ", ".join(f"{kind} {value:.1f}" for kind, value in sorted(cpu.kinds.items(), key=lambda kv: -kv[1]))
        + f", unseen (short-lived) {max(cpu.busy_s - sum(cpu.kinds.values()), 0.0):.1f}"
    )
    if args.cpu_detail:
        ranked = sorted(cpu.commands.items(), key=lambda item: -item[1][0])
        for (kind, command), (spent, processes) in ranked[:15]:
            print(f"  {spent:6.2f} core-s  {processes:5d} processes  {command:<16} {kind}")
    tag = f" ({label})"
    checks = [
        Check(
            f"{args.jobs} distinct results, all SUCCEEDED with reward 1{tag}",
            not batch.problems,
            "; ".join(batch.problems[:5]) or "ok",
        ),
        Check(
            f"every server exited 0 on SIGTERM{tag}",
            all(c == 0 for c in outcome.exit_codes.values()),
            ", ".join(f"{n}: {c}" for n, c in outcome.exit_codes.items()),
        ),
        Check(
            f"no container, cgroup, socket folder or Podman service left{tag}",
            not outcome.leftovers,
            "; ".join(outcome.leftovers) or "none",
        ),
    ]
    if outcome.servers > 1:
        names = sorted(outcome.held)
        checks.append(
            Check(
                f"every server ran a share of the jobs{tag}",
                sorted(n for n in outcome.shares if outcome.shares[n]) == names,
                ", ".join(f"{n} {c}" for n, c in sorted(outcome.shares.items())),
            )
        )
    if outcome.log_lines:
        print(f"server log lines (level warning and above): {len(outcome.log_lines)}")
        for line in outcome.log_lines[:20]:
            print(f"  {line}")
    return checks


async def main(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    # SIGTERM (e.g. a CI timeout) ends the run the way Ctrl-C does: servers, PostgreSQL and the fake LLM stopped.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    cores = os.cpu_count() or 1
    print(
        f"# cluster scale-out, {cores} cores: {args.jobs} math jobs of {args.turns} model turns "
        f"({args.turns - 1} python tool calls, then finish), a fake LLM of {args.latency * 1e3:.0f} ms per turn"
    )
    print(
        f"# per server: phases.init/run/eval = cluster.claim_slots = {args.slots}, a warm pool of {args.warm}, "
        "its own Podman service; all jobs through one RolloutStream to server a"
    )
    baseline = await idle_baseline()
    print(f"# machine CPU busy before the bench (others' load): {baseline:.0%}")
    checks: list[Check] = []
    outcomes: list[Outcome] = []
    llm = FakeLLM(args.turns, args.latency)
    with throwaway_postgres(prefix="prorl-bench-pg-", max_connections=100) as pg:
        try:
            await llm.start()
            for count in (1, SERVERS):
                outcome = await run_configuration(count, pg, llm, args)
                outcomes.append(outcome)
                checks += report(outcome, args, cores)
        finally:
            requests = await llm.stop()
    one, many = outcomes
    ratio = one.batch.wall_s / many.batch.wall_s
    print(f"\n## scale-out: {SERVERS} servers against 1")
    print(f"wall time {one.batch.wall_s:.2f} s -> {many.batch.wall_s:.2f} s: {ratio:.2f}x "
          f"({args.jobs / one.batch.wall_s:.2f} -> {args.jobs / many.batch.wall_s:.2f} jobs/s); "
          f"target >= {TARGET_RATIO:g}x: {'met' if ratio >= TARGET_RATIO else 'MISSED'}")  # fmt: skip
    hold_one, hold_many = mean_timing(one.batch.results)["hold"], mean_timing(many.batch.results)["hold"]
    reach_one, reach_many = floor_s(one, args) / one.batch.wall_s, floor_s(many, args) / many.batch.wall_s
    print(
        f"  = {SERVERS} x {hold_one / hold_many:.3f} (a job's mean hold of its slot, {hold_one:.3f} s -> "
        f"{hold_many:.3f} s: the same work on a busier machine)\n"
        f"    x {reach_many / reach_one:.3f} (share of the slot-bound floor reached, {reach_one:.1%} -> "
        f"{reach_many:.1%}: claims, leases, streaming every job through server a)"
    )
    busy = many.cpu.busy_share
    run_share = mean_timing(many.batch.results)["run"] / hold_many
    if busy < CPU_BOUND_SHARE and run_share >= 0.8:
        print(
            f"bottleneck: the run phase (waiting on the model): with {SERVERS} servers the slots were held "
            f"{statistics.fmean(statistics.fmean(v or [0]) for v in many.held.values()) / args.slots:.0%} "
            f"of the time, the run phase is {run_share:.0%} of a job's hold, the machine's CPU {busy:.0%} busy"
        )
    else:
        others = many.cpu.kinds.get(OTHERS_KIND, 0.0) / many.cpu.total_s if many.cpu.total_s else 0.0
        by_others = f", {others:.0%} of the machine by other programs" if others >= 0.05 else ""
        print(
            f"bottleneck: the machine's CPU, shared by the {SERVERS} servers and their sandboxes ({busy:.0%} busy "
            f"over the run{by_others}): tool calls and container removal slow down and a job holds its slot "
            f"{hold_many / hold_one - 1:.0%} longer; that measures this machine, not the cluster"
        )
    expected = (2 * args.jobs + 2 * (1 + SERVERS) * args.slots) * args.turns
    checks.append(
        Check(
            "the fake LLM answered exactly jobs x turns requests (no retry, no turn run twice)",
            requests == expected,
            f"{requests} requests, {expected} expected (warm-ups included)",
        )
    )
    print("\n## criteria")
    for check in checks:
        print(f"{'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    return 0 if all(check.ok for check in checks) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Cluster scale-out benchmark (see the module docstring).")
    parser.add_argument("--jobs", type=int, default=72, help="jobs in the measured batch of each configuration")
    parser.add_argument("--slots", type=int, default=2, help="phases.init/run/eval and cluster.claim_slots per server")
    parser.add_argument("--turns", type=int, default=10, help="model turns per job (the last one calls finish)")
    parser.add_argument("--latency", type=float, default=0.2, help="seconds the fake LLM takes per turn")
    parser.add_argument("--warm", type=int, default=None, help="warm sandboxes per server (default: 2 x --slots)")
    parser.add_argument(
        "--cpu-detail", action="store_true", help="also print the commands that used the most CPU during each run"
    )
    parser.add_argument(
        "--sample", type=float, default=SAMPLE_INTERVAL_S, help="seconds between samples of the store and of /proc"
    )
    parser.add_argument("--serve-llm", action="store_true", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve_llm:
        asyncio.run(serve_llm(parsed.turns, parsed.latency))
        sys.exit(0)
    if parsed.turns < 2:
        parser.error("--turns must be at least 2 (a python call, then finish)")
    parsed.warm = 2 * parsed.slots if parsed.warm is None else parsed.warm
    if min(parsed.jobs, parsed.slots, parsed.warm) < 1:
        parser.error("--jobs, --slots and --warm must be at least 1")
    configure_logging(level="warning")
    try:
        sys.exit(asyncio.run(main(parsed)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit("interrupted: the servers, PostgreSQL and the fake LLM were stopped")
