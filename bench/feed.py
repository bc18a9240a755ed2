"""Subscribe (the event feed): how fast and how late events reach consumers, and what a slow
consumer costs the server.

The server is this script run with --serve, as a child process (so /proc/<pid> is the
server's own): a ProrlServer over a SQLite job store in a temporary folder, the fake
sandbox provider of tests/fakes (each sandbox a local process running the real in-sandbox
runtime; no Podman) and the scripted LLM in process, answering at once: turns 1 to T-1 run
`print(...)` in the sandbox through the python tool, turn T calls finish. A job stores 3T + 6
events (queued, three phase starts, T model turns, T tool calls, T tool results, the
evaluation, finished), so the model is never what the feed waits for, and the many turns per
job keep the sandboxes' share of the CPU down. Settings go as `prorl-server serve` takes them
(--set SECTION.FIELD=VALUE).

What it measures, in one run:
1. Throughput: the same batch (--jobs jobs, submitted --concurrency at a time with Submit) on
   two fresh servers, with phases.run = --light (jobs running at once) and 64 (the
   default); the subscribe.* settings are the defaults. On each, two consumers subscribed from
   now, side by side: `finished` events only, and every event; each subscribes again after its
   last cursor if its stream ends with RESOURCE_EXHAUSTED (counted). Per consumer: events,
   the rate the store took them (over the batch: first to last store_time of all events), the
   rate delivered while the batch ran (received before its end), how long the rest took, and
   the delivery delay (receive time - the event's store_time) p50/p95/max. The CPU of
   the server process, of its sandboxes (its reaped children), of this process and of the
   rest of the machine (shared: others' load shows there; it is also measured before).
   Then, on the second server, idle: a catch-up read of the whole retained feed from
   "oldest" on a fresh stream, every event and `finished` only.
2. Memory: two more fresh servers, the same --mem-jobs batch, phases.run = --light and
   subscribe.max_lag_events = --max-lag on both: VmRSS of the server from /proc/<pid>/status
   every 0.1 s, (a) with no subscriber, (b) with one consumer of every event that reads one
   event per --slow-ms (on a channel of its own without BDP probing, see memory()) and ends
   with RESOURCE_EXHAUSTED; start (idle after a warm-up, before the batch), peak, end (the
   batch done, the slow consumer ended, --settle s later).

Checks (exit status 1 when one fails): every job SUCCEEDED with reward 1; each consumer got
each of its events once, in order (cursor positions that only grow), the every-event one each
job's events 1..n, the finished-only one every job's `finished`; the catch-up reads got the
same events as the live consumers; the slow consumer ended with RESOURCE_EXHAUSTED and a
non-empty cursor, not beyond the last event it received; every server exited 0 on SIGTERM.

Usage: python bench/feed.py [--jobs N] [--turns T] [--concurrency C] [--light R] [--mem-jobs N]
       [--max-lag M] [--slow-ms MS] [--settle S]   (make bench-feed)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.common import percentile
from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings, parse_assignments
from prorl_server.jobs.feed import OLDEST, decode_cursor
from prorl_server.logging import configure_logging
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import Script, ScriptedChatBackend, ScriptedReply, tool_call_text, turn_index

RSS_INTERVAL_S = 0.1
SLOW_END_TIMEOUT_S = 90.0
LISTENING = "prorl-server listening on "
LOOP = "bench-feed loop "
"""Starts the server process's once-a-second line: time, p50 and max of one event-loop iteration."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of one process so far, its threads included; and of its
    children that ended (the server's: its sandboxes' runtimes, reaped)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # fields[0] is stat's field 3
    own = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return own, (int(fields[13]) + int(fields[14])) / CLOCK_TICKS


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(values[:8])
    return (total - values[3] - values[4]) / CLOCK_TICKS, total / CLOCK_TICKS


@dataclass
class Cpu:
    """CPU used over a window: the server process, its sandboxes (children that ended), this
    process (the consumers), the machine."""

    server_s: float = 0.0
    sandboxes_s: float = 0.0
    bench_s: float = 0.0
    busy_s: float = 0.0
    total_s: float = 0.0

    @classmethod
    def now(cls, server_pid: int) -> Cpu:
        busy, total = machine_busy_s()
        own = os.times()
        return cls(*process_cpu_s(server_pid), own.user + own.system, busy, total)

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(
            self.server_s - other.server_s,
            self.sandboxes_s - other.sandboxes_s,
            self.bench_s - other.bench_s,
            self.busy_s - other.busy_s,
            self.total_s - other.total_s,
        )

    def others_s(self) -> float:
        return max(self.busy_s - self.server_s - self.sandboxes_s - self.bench_s, 0.0)


# --- the server (this script with --serve, a child process) -------------------------------------


def policy(turns: int) -> Script:
    """Turns 1..T-1: a python call; turn T: finish with the right answer."""

    def reply(messages: list[dict[str, Any]]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn < turns - 1:
            return ScriptedReply(tool_call_text("python", {"code": f"print({turn} * 7)"}))
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}))

    return reply


async def serve(folder: Path, turns: int, assignments: list[str]) -> None:
    """Serves until SIGTERM; prints the listening line `prorl-server serve` prints."""
    overrides: dict[str, Any] = {
        "server": {"port": 0, "instance_id": f"bench-feed-{os.getpid()}", "shutdown_grace_s": 0},
        "jobs": {"store": True, "store_path": str(folder / "jobs.sqlite")},
        "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
    }
    for section, values in parse_assignments(assignments).items():
        overrides.setdefault(section, {}).update(values)
    settings = load_settings(None, environ={}, overrides=overrides)
    configure_logging(level=settings.server.log_level)
    provider = FakeSandboxProvider(instance_id=settings.server.instance_id, root=folder)
    server = ProrlServer(settings, sandbox_provider=provider, backends=[ScriptedChatBackend(policy(turns))])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    print(f"{LISTENING}{server.address}", file=sys.stderr, flush=True)
    monitor = asyncio.create_task(watch_loop())
    try:
        await stop.wait()
    finally:
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
        await server.stop()


async def watch_loop() -> None:
    """Every second, a line on stderr: how long one iteration of the event loop took (the time
    from yielding to being resumed, sampled 20 times a second): p50 and max. Every step of a
    coroutine, a Subscribe stream's included, waits that long."""
    while True:
        samples = []
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            began = time.perf_counter()
            await asyncio.sleep(0)
            samples.append(time.perf_counter() - began)
            await asyncio.sleep(0.05)
        print(
            f"{LOOP}{time.time():.3f} {percentile(samples, 50) * 1e3:.3f} {max(samples) * 1e3:.3f}",
            file=sys.stderr,
            flush=True,
        )


class ServerProcess:
    """This script with --serve; stderr drained, its tail kept; its folder deleted at stop."""

    def __init__(self, turns: int, assignments: list[str]) -> None:
        self._argv = [__file__, "--serve", "--turns", str(turns)]
        for assignment in assignments:
            self._argv += ["--set", assignment]
        self._process: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None
        self.folder = Path(tempfile.mkdtemp(prefix="prorl-bench-feed-"))
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self.loop: list[tuple[float, float, float]] = []
        """(time, p50, max) of one event-loop iteration in the server, once a second."""
        self.address = ""

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def start(self, timeout_s: float = 60.0) -> None:
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, *self._argv, "--folder", str(self.folder),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
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
            if line.startswith(LOOP):
                at, p50, most = map(float, line[len(LOOP) :].split())
                self.loop.append((at, p50 / 1e3, most / 1e3))
                continue
            self.stderr_tail.append(line)
            if line.startswith(LISTENING) and not listening.done():
                listening.set_result(line.split()[-1])
        if not listening.done():
            listening.set_exception(RuntimeError("the server exited before listening:\n" + "\n".join(self.stderr_tail)))

    async def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait for the exit (SIGKILL after timeout_s); the exit code. Deletes the folder."""
        process = self._process
        code = None
        if process is not None:
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
            code = process.returncode
        shutil.rmtree(self.folder, ignore_errors=True)
        return code


@contextlib.asynccontextmanager
async def running(turns: int, assignments: list[str]) -> AsyncIterator[tuple[ServerProcess, Client, list[int | None]]]:
    """A started server and a client; the exit code lands in the list once it stopped."""
    server = ServerProcess(turns, assignments)
    code: list[int | None] = []
    await server.start()
    client = Client.connect(server.address)
    try:
        yield server, client, code
    finally:
        await client.close()
        code.append(await server.stop())
        notable = [line for line in server.stderr_tail if notable_line(line)]
        if notable:
            print(f"[server with {' '.join(assignments)}: {len(notable)} log lines of level warning or above]")
            for line in notable[-5:]:
                print(f"  {line[:200]}")


def notable_line(line: str) -> bool:
    """A server's stderr line worth showing (its log level is warning): not the listening line, nor
    math-verify's notice that its own timeouts are off (the server bounds it from outside)."""
    return bool(line.strip()) and not line.startswith((LISTENING, "Timeout is disabled as "))


# --- jobs ----------------------------------------------------------------------------------------


def make_request(prefix: str, index: int, turns: int) -> v1.RolloutRequest:
    request = v1.RolloutRequest(job_id=f"{prefix}-{index:05d}", handler="math")
    request.instance.update({"question": "What is 6 * 7?", "answer": "42"})
    request.limits.max_turns = turns
    return request


async def submit_all(client: Client, requests: list[v1.RolloutRequest], concurrency: int) -> None:
    """Submits every job, `concurrency` Submit calls at a time."""
    pending = iter(requests)

    async def worker() -> None:
        for request in pending:
            await client.submit(request)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


# --- consumers -----------------------------------------------------------------------------------


@dataclass
class Received:
    """What one consumer got: per event, (position, job_id, seq, kind, receive - store_time,
    receive - event time, receive time)."""

    name: str
    events: list[tuple[int, str, int, str, float, float, float]] = field(default_factory=list)
    last_cursor: str = ""
    ended: RpcError | None = None
    ended_at: float = 0.0
    """time.time() when `ended` was raised."""
    resumed: int = 0
    """Streams that ended with RESOURCE_EXHAUSTED, followed by a Subscribe after the last cursor."""

    def add(self, response: v1.FeedEvent) -> None:
        self.last_cursor = response.cursor
        if not response.HasField("event"):
            return
        now = time.time()
        event = response.event
        self.events.append(
            (
                decode_cursor(response.cursor)[1],
                event.job_id,
                event.seq,
                str(event.WhichOneof("kind")),
                now - response.store_time.ToNanoseconds() / 1e9,
                now - event.time.ToNanoseconds() / 1e9,
                now,
            )
        )

    def finished(self) -> int:
        return sum(kind == "finished" for _, _, _, kind, _, _, _ in self.events)

    def store_times(self) -> list[float]:
        return [received - delay for *_, delay, _, received in self.events]

    def problems(self) -> list[str]:
        found = []
        positions = [position for position, *_ in self.events]
        if positions != sorted(positions) or len(set(positions)) != len(positions):
            found.append(f"{self.name}: cursor positions out of order or repeated")
        keys = [(job_id, seq) for _, job_id, seq, *_ in self.events]
        if len(set(keys)) != len(keys):
            found.append(f"{self.name}: {len(keys) - len(set(keys))} events received twice")
        return found


async def consume(
    client: Client, received: Received, until: Callable[[Received], bool], started: asyncio.Event, **filter: Any
) -> None:
    """Reads from now into `received` until `until` holds; `started` is set at the first message. A
    stream that ends with RESOURCE_EXHAUSTED is followed by another after the last cursor received."""
    while True:
        try:
            async with contextlib.aclosing(client.subscribe(after_cursor=received.last_cursor, **filter)) as stream:
                async for response in stream:
                    received.add(response)
                    started.set()
                    if until(received):
                        return
        except RpcError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            received.resumed += 1


async def catch_up(client: Client, last_position: int, **filter: Any) -> tuple[Received, float]:
    """Reads from "oldest" up to `last_position`; what it got and how long it took."""
    received = Received("catch-up, " + ("finished only" if filter else "every event"))
    began = time.perf_counter()
    async with contextlib.aclosing(client.subscribe(after_cursor=OLDEST, **filter)) as stream:
        async for response in stream:
            received.add(response)
            if decode_cursor(response.cursor)[1] >= last_position:
                break
    return received, time.perf_counter() - began


async def slow_consumer(client: Client, received: Received, delay_s: float, started: asyncio.Event) -> None:
    """Every event, one event per delay_s, until the stream ends (RESOURCE_EXHAUSTED, we expect)."""
    try:
        async with contextlib.aclosing(client.subscribe()) as stream:
            async for response in stream:
                received.add(response)
                started.set()
                await asyncio.sleep(delay_s)
    except RpcError as exc:
        received.ended, received.ended_at = exc, time.time()


# --- phase 1: throughput -------------------------------------------------------------------------


@dataclass
class Throughput:
    run_slots: int
    wall_s: float
    batch: tuple[float, float]
    """First and last store_time of the batch's events."""
    finished_only: Received
    every: Received
    catch_up: list[tuple[Received, float]]
    cpu: Cpu
    loop: list[tuple[float, float, float]]
    """The server's event-loop iterations, once a second (ServerProcess.loop)."""
    problems: list[str]
    exit_code: int | None = None

    def loop_during_batch(self) -> tuple[float, float, float]:
        """p50 over the batch's seconds of their p50s, the worst second's p50, the longest iteration."""
        first, last = self.batch
        seconds = [(p50, most) for at, p50, most in self.loop if first <= at <= last + 1.0]
        if not seconds:
            return 0.0, 0.0, 0.0
        return percentile([p50 for p50, _ in seconds], 50), max(p50 for p50, _ in seconds), max(m for _, m in seconds)


async def throughput(args: argparse.Namespace, run_slots: int, catching_up: bool) -> Throughput:
    """One batch on a fresh server with phases.run = run_slots, two consumers following it."""
    requests = [make_request(f"tp{run_slots}", i, args.turns) for i in range(args.jobs)]
    finished_only, every = Received("finished only"), Received("every event")
    problems: list[str] = []
    catch: list[tuple[Received, float]] = []
    settings = ["server.log_level=warning", f"phases.run={run_slots}"]
    async with running(args.turns, settings) as (server, client, code):
        await wait_ready(client)
        starts = [asyncio.Event(), asyncio.Event()]
        consumers = [
            asyncio.create_task(
                consume(client, finished_only, lambda r: r.finished() >= args.jobs, starts[0], event_kinds=["finished"])
            ),
            asyncio.create_task(consume(client, every, lambda r: r.finished() >= args.jobs, starts[1])),
        ]
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*(start.wait() for start in starts))
            began, cpu_before = time.perf_counter(), Cpu.now(server.pid)
            await submit_all(client, requests, args.concurrency)
            async with asyncio.timeout(max(120.0, args.jobs * 0.5)):
                await asyncio.gather(*consumers)
            wall_s, cpu = time.perf_counter() - began, Cpu.now(server.pid) - cpu_before
        finally:
            for task in consumers:
                task.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)
        problems += await check_results(client, requests)
        if catching_up:
            last = every.events[-1][0]
            catch = [await catch_up(client, last), await catch_up(client, last, event_kinds=["finished"])]
    store_times = every.store_times()
    # a job's events are numbered 1..n, its `finished` the last: the every-event consumer got all of them
    last_seq = {job_id: seq for _, job_id, seq, kind, *_ in every.events if kind == "finished"}
    got = sorted((job_id, seq) for _, job_id, seq, *_ in every.events)
    if len(last_seq) != args.jobs or got != sorted((j, s) for j, n in last_seq.items() for s in range(1, n + 1)):
        problems.append(f"phases.run={run_slots}, every-event consumer: {len(got)} events, not each job's 1..n")
    if finished_only.finished() != args.jobs or len(finished_only.events) != args.jobs:
        problems.append(
            f"phases.run={run_slots}, finished-only consumer: {len(finished_only.events)} events, {args.jobs} expected"
        )
    for received in (finished_only, every):
        problems += received.problems()
    if catch and [e[:4] for e in catch[0][0].events] != [e[:4] for e in every.events]:
        problems.append("the catch-up read did not get the every-event consumer's events")
    if catch and [e[:4] for e in catch[1][0].events] != [e[:4] for e in finished_only.events]:
        problems.append("the finished-only catch-up read did not get the finished-only consumer's events")
    return Throughput(
        run_slots=run_slots,
        wall_s=wall_s,
        batch=(min(store_times), max(store_times)),
        finished_only=finished_only,
        every=every,
        catch_up=catch,
        cpu=cpu,
        loop=server.loop,
        problems=problems,
        exit_code=code[0] if code else None,
    )


async def wait_ready(client: Client) -> None:
    async with asyncio.timeout(30):
        await client.wait_ready()


async def check_results(client: Client, requests: list[v1.RolloutRequest]) -> list[str]:
    """Every job SUCCEEDED with reward 1 (GetJob)."""
    bad = []
    for request in requests:
        job = await client.get_job(request.job_id)
        if job.status != v1.JOB_STATUS_SUCCEEDED or job.result.reward != 1.0:
            bad.append(f"{request.job_id}: {v1.JobStatus.Name(job.status)} reward {job.result.reward}")
    return [f"{len(bad)} jobs did not succeed with reward 1: {', '.join(bad[:3])}"] if bad else []


# --- phase 2: memory -----------------------------------------------------------------------------


@dataclass
class Memory:
    label: str
    start_mib: float
    peak_mib: float
    end_mib: float
    batch_s: float
    slow_ended_s: float | None
    """When the slow consumer got the end of its stream, from the batch's start."""
    samples: int
    slow: Received | None
    problems: list[str]
    exit_code: int | None = None


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def sample_rss(pid: int, into: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        into.append(rss_mib(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_INTERVAL_S)


async def memory(args: argparse.Namespace, label: str, slow: bool) -> Memory:
    settings = ["server.log_level=warning", f"phases.run={args.light}", f"subscribe.max_lag_events={args.max_lag}"]
    requests = [make_request(f"mem{int(slow)}", i, args.turns) for i in range(args.mem_jobs)]
    received = Received("slow") if slow else None
    problems: list[str] = []
    async with running(args.turns, settings) as (server, client, code):
        await wait_ready(client)
        warm = [make_request(f"warm{int(slow)}", i, args.turns) for i in range(args.concurrency)]
        await submit_all(client, warm, args.concurrency)
        await wait_done(client, warm)
        await asyncio.sleep(args.settle)
        start = rss_mib(server.pid)
        samples: list[float] = [start]
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(server.pid, samples, stop))
        reader: asyncio.Task[None] | None = None
        began, began_at = time.perf_counter(), time.time()
        # The slow consumer's own channel without BDP probing: its flow-control window stays at
        # gRPC's initial 64 KiB. With probing (the default), the window of a client that reads
        # slowly can grow until it holds the whole backlog, sent and counted as delivered by the
        # server: the server then ends the stream on time, but the consumer reads that backlog
        # (a minute and more at 20 events/s) before it sees the status.
        slow_client = Client.connect(server.address, options=[("grpc.http2.bdp_probe", 0)])
        try:
            if received is not None:
                started = asyncio.Event()
                reader = asyncio.create_task(slow_consumer(slow_client, received, args.slow_ms / 1e3, started))
                async with asyncio.timeout(30):
                    await started.wait()
            await submit_all(client, requests, args.concurrency)
            await wait_done(client, requests)
            batch_s = time.perf_counter() - began
            if reader is not None:
                try:
                    async with asyncio.timeout(SLOW_END_TIMEOUT_S):
                        await reader
                except TimeoutError:
                    problems.append(
                        f"the slow consumer's stream had not ended {SLOW_END_TIMEOUT_S:g} s after the batch"
                    )
            await asyncio.sleep(args.settle)
        finally:
            stop.set()
            await sampler
            if reader is not None and not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            await slow_client.close()
        end = rss_mib(server.pid)
        problems += await check_results(client, requests)
    if received is not None:
        problems += received.problems()
        ended = received.ended
        if ended is None or ended.code != grpc.StatusCode.RESOURCE_EXHAUSTED or not ended.resume_cursor:
            problems.append(f"the slow consumer did not end with RESOURCE_EXHAUSTED and a cursor: {ended!r}")
        elif decode_cursor(ended.resume_cursor)[1] > decode_cursor(received.last_cursor)[1]:
            problems.append("the slow consumer's resume cursor is beyond the last event it received")
    return Memory(
        label=label,
        start_mib=start,
        peak_mib=max(samples),
        end_mib=end,
        batch_s=batch_s,
        slow_ended_s=received.ended_at - began_at if received is not None and received.ended else None,
        samples=len(samples),
        slow=received,
        problems=problems,
        exit_code=code[0] if code else None,
    )


async def wait_done(client: Client, requests: list[v1.RolloutRequest]) -> None:
    """Until every job ended (GetJob, every 0.2 s: no stream to the server but the consumers')."""
    ended = (v1.JOB_STATUS_SUCCEEDED, v1.JOB_STATUS_FAILED, v1.JOB_STATUS_CANCELLED, v1.JOB_STATUS_TIMED_OUT)
    async with asyncio.timeout(max(120.0, len(requests) * 0.5)):
        for request in requests:
            while True:
                if (await client.get_job(request.job_id)).status in ended:
                    break
                await asyncio.sleep(0.2)


# --- report --------------------------------------------------------------------------------------


def ms(samples: list[float], q: float) -> str:
    return f"{percentile(samples, q) * 1e3:7.0f}"


def report_throughput(results: list[Throughput], args: argparse.Namespace) -> None:
    print(
        f"\n## throughput: {args.jobs} jobs of {args.turns} turns ({3 * args.turns + 6} events each), submitted "
        f"{args.concurrency} at a time, on a fresh server per row: phases.run = jobs running at once (64 is the "
        "default); subscribe.* defaults (poll_interval_s 0.25, page_size 256, max_lag_events 10000)"
    )
    for result in results:
        first, last = result.batch
        cpu = result.cpu
        median, worst, longest = result.loop_during_batch()
        print(
            f"phases.run={result.run_slots}: the store took {len(result.every.events)} events in {last - first:.1f} s: "
            f"{len(result.every.events) / (last - first):.0f} events/s; CPU over the batch: machine "
            f"{cpu.busy_s / cpu.total_s:.0%} busy (in cores: server process {cpu.server_s / result.wall_s:.2f}, "
            f"its sandboxes {cpu.sandboxes_s / result.wall_s:.2f}, this process (both consumers) "
            f"{cpu.bench_s / result.wall_s:.2f}, the rest {cpu.others_s() / result.wall_s:.2f}); one iteration of "
            f"the server's event loop (p50 of each second, over the batch): median {median * 1e3:.1f} ms, worst "
            f"second {worst * 1e3:.1f} ms, longest {longest * 1e3:.0f} ms"
        )
    print(
        "| jobs at once | consumer | events | stored/s | delivered/s while the batch ran | by the batch's end "
        "| the rest within | delay p50 | p95 | max | ended (RESOURCE_EXHAUSTED), resumed |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        first, last = result.batch
        for received in (result.finished_only, result.every):
            delays = [event[4] for event in received.events]
            by_end = sum(event[6] <= last for event in received.events)
            rest = max(event[6] for event in received.events) - last
            print(
                f"| {result.run_slots} | {received.name} | {len(received.events)} "
                f"| {len(received.events) / (last - first):.0f} | {by_end / (last - first):.0f} "
                f"| {by_end / len(received.events):.0%} | {max(rest, 0.0):.1f} s "
                f"| {ms(delays, 50)} ms | {ms(delays, 95)} ms | {ms(delays, 100)} ms | {received.resumed} |"
            )
    for result in results:
        for received, seconds in result.catch_up:
            print(
                f"{received.name}, from oldest (a fresh stream over the retained feed, the server idle): "
                f"{len(received.events)} events in {seconds:.2f} s, {len(received.events) / seconds:.0f} events/s"
            )


def report_memory(results: list[Memory], args: argparse.Namespace) -> None:
    print(
        f"\n## server memory (VmRSS every {RSS_INTERVAL_S:g} s): {args.mem_jobs} jobs on a fresh server each, "
        f"--set phases.run={args.light} --set subscribe.max_lag_events={args.max_lag} on both"
    )
    print("| server | RSS start | peak | end | batch | the slow consumer's stream ended at |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        at = "-" if result.slow_ended_s is None else f"{result.slow_ended_s:.1f} s"
        print(
            f"| {result.label} | {result.start_mib:.1f} MiB | {result.peak_mib:.1f} MiB | {result.end_mib:.1f} MiB "
            f"| {result.batch_s:.1f} s | {at} |"
        )
    for result in results:
        if result.slow is None:
            continue
        ended = result.slow.ended
        got = len(result.slow.events)
        if ended is None:
            print(f"slow consumer: {got} events, the stream did not end")
            continue
        position = decode_cursor(ended.resume_cursor)[1] if ended.resume_cursor else 0
        again = sum(event[0] > position for event in result.slow.events)
        print(
            f"slow consumer ({args.slow_ms} ms per event): {got} events, then {ended.code.name} with resume cursor "
            f"{ended.resume_cursor or '(none)'} (position {position}; the last event received: "
            f"{decode_cursor(result.slow.last_cursor)[1]}; events received after the resume cursor, which a resume "
            f"from it would give again: {again}): {ended.details[:110]}..."
        )


async def idle_baseline(seconds: float = 2.0) -> float:
    busy0, total0 = machine_busy_s()
    await asyncio.sleep(seconds)
    busy1, total1 = machine_busy_s()
    return (busy1 - busy0) / (total1 - total0)


async def main(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    print(
        f"# Subscribe bench, {os.cpu_count()} cores: server = this script --serve (SQLite store, fake sandbox "
        "provider, scripted LLM in process answering at once), its own process"
    )
    print(f"# machine CPU busy before the bench (others' load, 2 s): {await idle_baseline():.0%}")
    began = time.perf_counter()
    results = [await throughput(args, args.light, False), await throughput(args, 64, True)]
    report_throughput(results, args)
    memories = [await memory(args, "(a) no subscriber", False), await memory(args, "(b) one slow consumer", True)]
    report_memory(memories, args)
    checks = [
        (
            "throughput: all jobs succeeded, each consumer got its events once, in order",
            [problem for result in results for problem in result.problems],
        )
    ]
    for m in memories:
        checks.append(
            (f"memory {m.label}: all jobs succeeded" + (", the slow consumer ended" if m.slow else ""), m.problems)
        )
    checks += [
        (
            "every server exited 0 on SIGTERM",
            [
                f"exit {code}"
                for code in [*(r.exit_code for r in results), *(m.exit_code for m in memories)]
                if code != 0
            ],
        ),
    ]
    print(f"\n## criteria (run of {time.perf_counter() - began:.0f} s)")
    for name, problems in checks:
        print(f"{'FAIL' if problems else 'PASS'}  {name}{': ' + '; '.join(problems[:5]) if problems else ''}")
    return 1 if any(problems for _, problems in checks) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Subscribe benchmark (see the module docstring).")
    parser.add_argument("--jobs", type=int, default=200, help="jobs in each throughput batch")
    parser.add_argument("--turns", type=int, default=24, help="model turns per job (3T + 6 events a job)")
    parser.add_argument("--concurrency", type=int, default=32, help="Submit calls at a time")
    parser.add_argument(
        "--light", type=int, default=8, help="phases.run of the first throughput server and of the memory servers"
    )
    parser.add_argument("--mem-jobs", type=int, default=150, help="jobs in each memory batch")
    parser.add_argument("--max-lag", type=int, default=1000, help="subscribe.max_lag_events of the memory servers")
    parser.add_argument("--slow-ms", type=int, default=50, help="the slow consumer's pause after each event")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds idle before the start and end readings")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.serve:
        asyncio.run(serve(parsed.folder, parsed.turns, parsed.set))
        sys.exit(0)
    if parsed.turns < 2 or min(parsed.jobs, parsed.mem_jobs, parsed.concurrency) < 1:
        parser.error("--turns must be at least 2; --jobs, --mem-jobs and --concurrency at least 1")
    configure_logging(level="warning")
    try:
        sys.exit(asyncio.run(main(parsed)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit("interrupted: the servers were stopped")
