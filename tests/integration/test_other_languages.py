"""Go and C++ trainers: clients built from proto/ with Debian's toolchains, run against a live server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.jobs.feed import decode_cursor
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from tests.adversarial.test_gateway_hostile import RAW_CALLS, LeanBackend
from tests.conftest import make_settings, server_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index, user_prompt
from tests.helpers import assert_eventually, math_request

pytestmark = [pytest.mark.podman, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def add_numbers(messages: list[dict[str, Any]]) -> ScriptedReply:
    a, b = map(int, re.findall(r"\d+", user_prompt(messages))[:2])
    return ScriptedReply(tool_call_text("finish", {"answer": str(a + b)}))


async def run(*command: str, timeout_s: float = 900) -> tuple[int, str]:
    """The command's exit code and output. The bound is pytest's own: the builds compile (a
    cold Go cache, the C++ stubs), and on a busy machine that is minutes."""
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(timeout_s):
        output, _ = await process.communicate()
    return process.returncode or 0, output.decode()


@pytest.mark.parametrize("language", ["go", "cpp"])
async def test_client_streams_events_and_rewards(language: str, scripted_llm, start_server) -> None:
    code, output = await run("bash", str(EXAMPLES / language / "build.sh"))
    assert code == 0, output
    llm = await scripted_llm(add_numbers)
    server, _ = await start_server(llm.base_url)
    binary = str(EXAMPLES / language / "bin" / "rollout-client")
    command = [binary, "-server", server.address, "-tasks", "3"] if language == "go" else [binary, server.address, "3"]

    code, output = await run(*command)

    assert code == 0, output
    rewards = re.findall(r"^reward (\S+) (\S+)$", output, re.MULTILINE)
    assert len(rewards) == 3 and all(float(reward) == 1.0 for _, reward in rewards), output
    for job, _ in rewards:
        events = re.findall(rf"^{re.escape(job)} #\d+ ", output, re.MULTILINE)
        assert len(events) >= 4, output  # queued, phase started x3, model turn, ..., finished


async def test_go_cluster_client_submits_watches_and_gets_rewards(scripted_llm, start_server) -> None:
    code, output = await run("bash", str(EXAMPLES / "go" / "build.sh"))
    assert code == 0, output
    llm = await scripted_llm(add_numbers)
    server, _ = await start_server(llm.base_url)

    code, output = await run(str(EXAMPLES / "go" / "bin" / "cluster-client"), "-targets", server.address, "-tasks", "3")

    assert code == 0, output
    rewards = re.findall(r"^reward (\S+) (\S+)$", output, re.MULTILINE)
    assert len(rewards) == 3 and all(float(reward) == 1.0 for _, reward in rewards), output
    for job, _ in rewards:
        seqs = [int(seq) for seq in re.findall(rf"^{re.escape(job)} #(\d+) \w+$", output, re.MULTILINE)]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 4, output  # each event once, in order
        assert re.search(rf"^{re.escape(job)} #{seqs[-1]} finished$", output, re.MULTILINE), output
    assert re.search(r"^resumed 0$", output, re.MULTILINE), output  # one server, never lost


# --- the Go feed consumer (Subscribe) ---------------------------------------------------------------

FEED_CONSUMER = EXAMPLES / "go" / "bin" / "feed-consumer"


def add_in_sandbox(padding: int = 0) -> Callable[[list[dict[str, Any]]], ScriptedReply]:
    """Turn 1 adds the question's two numbers in the sandbox, turn 2 answers the sum; each
    reply after 0.2 s, with `padding` characters of thought before its tool call (big events)."""

    def reply(messages: list[dict[str, Any]]) -> ScriptedReply:
        a, b = map(int, re.findall(r"\d+", user_prompt(messages))[:2])
        thought = "Adding. " * (padding // 8)
        if turn_index(messages) == 0:
            return ScriptedReply(thought + tool_call_text("python", {"code": f"print({a} + {b})"}), delay_s=0.2)
        return ScriptedReply(thought + tool_call_text("finish", {"answer": str(a + b)}), delay_s=0.2)

    return reply


def feed_job(job_id: str, index: int, *, group: str, run: str, right: bool = True) -> v1.RolloutRequest:
    """A math job in `group` labelled run=`run`; its expected answer is wrong unless `right`."""
    a, b = index, index + 10
    return math_request(
        f"What is {a} + {b}?", str(a + b if right else a + b + 1), job_id=job_id, group_id=group, labels={"run": run}
    )


class FeedConsumer:
    """examples/go/bin/feed-consumer as a child process: its JSON lines and its log read as they come."""

    def __init__(self, server: str, cursor_file: Path, *flags: str) -> None:
        self.argv = [str(FEED_CONSUMER), "-server", server, "-cursor-file", str(cursor_file), *flags]
        self.lines: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        self._reading: asyncio.Future[Any] | None = None

    async def start(self) -> FeedConsumer:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self._reading = asyncio.gather(self._read(self.process.stdout, True), self._read(self.process.stderr, False))
        return self

    async def _read(self, pipe: asyncio.StreamReader, events: bool) -> None:
        async for raw in pipe:
            if events:
                self.lines.append(json.loads(raw))
            else:
                self.log.append(raw.decode().rstrip())

    def said(self) -> str:
        return "\n".join(self.log)

    async def wait(self, timeout_s: float = 60) -> int:
        """Its exit status, once it stopped by itself (killed after timeout_s: the test fails)."""
        assert self.process is not None and self._reading is not None
        try:
            async with asyncio.timeout(timeout_s):
                code = await self.process.wait()
        except TimeoutError:
            await self.kill()
            raise AssertionError(f"the consumer did not stop within {timeout_s} s:\n{self.said()}") from None
        await self._reading
        return code

    async def stop(self) -> int:
        """SIGTERM, as an operator stops it; its exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return await self.wait()

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._reading is not None:
            with contextlib.suppress(Exception):
                await self._reading


@contextlib.asynccontextmanager
async def consumers() -> AsyncIterator[Callable[..., Awaitable[FeedConsumer]]]:
    """Starts FeedConsumers (server, cursor file, flags); none is left running after the block."""
    started: list[FeedConsumer] = []

    async def start(server: str, cursor_file: Path, *flags: str) -> FeedConsumer:
        consumer = await FeedConsumer(server, cursor_file, *flags).start()
        started.append(consumer)
        return consumer

    try:
        yield start
    finally:
        for consumer in started:
            await consumer.kill()


async def feed_of(client: Client, job_ids: list[str]) -> list[tuple[v1.Job, list[v1.RolloutEvent]]]:
    """Each job (GetJob) with its whole log (Watch), once every job ended."""
    ended = []
    for job_id in job_ids:
        events = [event async for event in client.watch(job_id)]  # to the job's end
        ended.append((await client.get_job(job_id), events))
    return ended


def status_as_of(job: v1.Job, event: v1.RolloutEvent) -> int:
    kind = event.WhichOneof("kind")
    return {"queued": v1.JOB_STATUS_QUEUED, "finished": job.status}.get(str(kind), v1.JOB_STATUS_RUNNING)


def assert_exactly(runs: list[FeedConsumer], expected: list[tuple[str, int, str]], rewards: dict[str, float]) -> None:
    """The consumer's runs, one after the other, printed each expected event once, in the
    feed's order (cursors that only grow)."""
    lines = [line for consumer in runs for line in consumer.lines]
    said = "\n".join(consumer.said() for consumer in runs)
    got = [(line["job_id"], line["seq"], line["kind"]) for line in lines]
    assert len(got) == len(set(got)), f"printed twice: {sorted({e for e in got if got.count(e) > 1})}\n{said}"
    assert sorted(got) == sorted(expected), f"got {sorted(got)}\nexpected {sorted(expected)}\n{said}"
    positions = [decode_cursor(line["cursor"])[1] for line in lines]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    for job_id in {job_id for job_id, _, _ in got}:
        seqs = [seq for job, seq, _ in got if job == job_id]
        assert seqs == sorted(seqs), f"{job_id} out of order: {seqs}"
    for line in lines:
        assert line["attempt"] == 1 and line["store_time"]
        if line["kind"] == "finished":
            assert line["reward"] == rewards[line["job_id"]], line


async def test_go_feed_consumers_get_exactly_their_events_and_go_on_from_a_cursor_file(
    scripted_llm, start_server, tmp_path: Path
) -> None:
    code, output = await run("bash", str(EXAMPLES / "go" / "build.sh"))
    assert code == 0, output
    llm = await scripted_llm(add_in_sandbox())
    server, client = await start_server(
        llm.base_url,
        jobs={"store": True, "store_path": str(tmp_path / "jobs.sqlite")},
        subscribe={"poll_interval_s": 0.05},
    )
    a_cursor, b_cursor = tmp_path / "a.cursor", tmp_path / "b.cursor"
    # a: the finished events of the run=x jobs (a model turn's status is RUNNING: left out)
    a_filter = ["-label", "run=x", "-kinds", "model_turn,finished", "-status", "succeeded", "-max-events", "6"]
    b_filter = ["-group", "b", "-handler", "math"]  # every event of group b
    jobs = {"a": [f"a-{i}" for i in range(6)], "b": [f"b-{i}" for i in range(6)]}

    async def submit(wave: range) -> None:
        for i in wave:
            await client.submit(feed_job(f"a-{i}", i, group="a", run="x", right=i % 2 == 0))
            await client.submit(feed_job(f"b-{i}", i, group="b", run="y"))

    async with consumers() as start:
        a = await start(server.address, a_cursor, *a_filter)
        b_first = await start(server.address, b_cursor, *b_filter)
        # the first message of each stream (a progress mark where it began) is saved before any event
        await assert_eventually(lambda: a_cursor.exists() and b_cursor.exists(), message="no cursor saved")
        await submit(range(3))
        await assert_eventually(lambda: len(b_first.lines) >= 4, message=f"b printed nothing:\n{b_first.said()}")
        assert await b_first.stop() == 0, b_first.said()
        assert "stopped (signal)" in b_first.said()
        # while b is down: its group's first jobs end, the next ones start
        await submit(range(3, 6))
        for job_id in jobs["b"][:3]:
            async for _ in client.watch(job_id):  # to its end
                pass
        b_again = await start(server.address, b_cursor, *b_filter, "-idle", "3s")
        ended = await feed_of(client, jobs["a"] + jobs["b"])
        assert await a.wait() == 0, a.said()
        assert await b_again.wait() == 0, b_again.said()

    assert "stopped (-max-events 6 reached)" in a.said()
    assert "going on after the cursor saved in" in b_again.said() and "stopped (idle for 3s)" in b_again.said()
    rewards = {job.job_id: events[-1].finished.result.reward for job, events in ended}
    assert {rewards[f"a-{i}"] for i in range(6)} == {0.0, 1.0}  # wrong answers succeed with reward 0
    expected_a = [
        (event.job_id, event.seq, str(event.WhichOneof("kind")))
        for job, events in ended
        for event in events
        if job.labels.get("run") == "x"
        and event.WhichOneof("kind") in ("model_turn", "finished")
        and status_as_of(job, event) == v1.JOB_STATUS_SUCCEEDED
    ]
    expected_b = [
        (event.job_id, event.seq, str(event.WhichOneof("kind")))
        for job, events in ended
        for event in events
        if job.group_id == "b" and job.handler == "math"
    ]
    assert len(expected_a) == 6
    assert_exactly([a], expected_a, rewards)
    # b's two runs together: every event of group b once, the second going on where the first stopped
    assert b_first.lines and b_again.lines
    assert_exactly([b_first, b_again], expected_b, rewards)
    saved = decode_cursor(b_cursor.read_text().strip())[1]  # the last event or a later progress mark
    assert saved >= decode_cursor(b_again.lines[-1]["cursor"])[1]


async def test_go_feed_consumer_resumes_after_falling_behind_or_losing_its_server_and_stops_behind_retention(
    scripted_llm, start_server, tmp_path: Path, too_slow_endings: list[str]
) -> None:
    code, output = await run("bash", str(EXAMPLES / "go" / "build.sh"))
    assert code == 0, output
    llm = await scripted_llm(add_in_sandbox(padding=2000))  # ~10 kB of events per job
    store = {"store": True, "store_path": str(tmp_path / "jobs.sqlite")}
    feed = {"poll_interval_s": 0.05, "max_lag_events": 50}
    server, client = await start_server(llm.base_url, jobs=store, subscribe=feed)
    cursor_file = tmp_path / "c.cursor"
    job_ids: list[str] = []

    async def run_jobs(count: int, client: Client) -> None:
        new = [f"j-{len(job_ids) + i}" for i in range(count)]
        for i, job_id in enumerate(new):
            await client.submit(feed_job(job_id, i, group="g", run="z"))
        for job_id in new:
            async for _ in client.watch(job_id):  # to its end
                pass
        job_ids.extend(new)

    async with consumers() as start:
        consumer = await start(server.address, cursor_file, "-idle", "4s", "-retries", "10")
        await assert_eventually(cursor_file.exists, message="no cursor saved")
        # stopped (SIGSTOP) while jobs run: their events overflow gRPC's flow-control window, the
        # server's sends wait, and the stream falls more than max_lag_events behind. 20 jobs
        # (~200 kB) overflow grpc-go's default window; more waves where the window is larger.
        assert consumer.process is not None
        consumer.process.send_signal(signal.SIGSTOP)
        try:
            for _wave in range(5):
                await run_jobs(20, client)
                with contextlib.suppress(AssertionError):
                    await assert_eventually(lambda: bool(too_slow_endings), timeout_s=2)
                if too_slow_endings:
                    break
            assert too_slow_endings, "the stopped consumer's stream was never ended"
        finally:
            consumer.process.send_signal(signal.SIGCONT)
        ended = await feed_of(client, job_ids)
        await assert_eventually(lambda: len(consumer.lines) >= sum(len(events) for _, events in ended), timeout_s=30)
        # its server goes away; another one on the same address and store takes over
        port = server.port
        await server.stop()
        again, client = await start_server(llm.base_url, jobs=store, subscribe=feed, server={"port": port})
        await run_jobs(3, client)
        assert await consumer.wait() == 0, consumer.said()

        said = consumer.said()
        assert re.search(r"stream ended with ResourceExhausted .*the server's resume cursor: \"\w+\"", said), said
        assert re.search(r"stream ended with Unavailable .*the server's resume cursor: \"\"", said), said
        # (the server's cursor may be one behind the consumer's: a send given up on may still arrive)
        ended = await feed_of(client, job_ids)
        every = [(event.job_id, event.seq, str(event.WhichOneof("kind"))) for _, events in ended for event in events]
        rewards = {job.job_id: events[-1].finished.result.reward for job, events in ended}
        assert_exactly([consumer], every, rewards)

        # behind retention: a clear message and status 3; the cursor file is left as it was
        assert isinstance(again._mode.store, SQLiteJobStore)
        assert await again._mode.store.feed_trim(1.0) > 0  # every event: the consumer stopped after 4 s idle
        old = tmp_path / "old.cursor"
        old.write_text(consumer.lines[0]["cursor"] + "\n")
        late = await start(again.address, old)
        assert await late.wait() == 3, late.said()
        assert "deleted by the server's retention" in late.said() and "-from oldest" in late.said()
        assert old.read_text() == consumer.lines[0]["cursor"] + "\n"


async def test_go_feed_consumer_reads_the_result_of_a_program_whose_last_call_is_8_mb(
    podman_url: str, tmp_path: Path
) -> None:
    """A `command` job's program sends a last model call of 8 MB (before issue 30: an
    8,000,766-byte result); the Go feed consumer, on grpc-go's default limits (4 MiB to
    receive), reads every event of the job, its finished result among them, through Subscribe."""
    code, output = await run("bash", str(EXAMPLES / "go" / "build.sh"))
    assert code == 0, output
    backend = LeanBackend()  # a scripted fake in process: answers "42", keeps only each call's size
    settings = make_settings(
        podman_url,
        None,
        jobs={"store": True, "store_path": str(tmp_path / "jobs.sqlite")},
        subscribe={"poll_interval_s": 0.05},
        llm={"embedded": {"enabled": "never"}, "health_interval_s": 0},
    )
    server = ProrlServer(settings, backends=[backend])
    await server.start()
    try:
        program = RAW_CALLS + '[(status, _)] = wave(1, 8_000_000)\nassert status == 200, status\nprint("42")\n'
        request = v1.RolloutRequest(job_id="big-last-call", handler="command")
        request.instance.update(
            {
                "program": {"argv": ["python3", "agent.py"], "files": {"agent.py": program}},
                "verifier": "math",
                "task": {"question": "What is 6 * 7?", "answer": "42"},
            }
        )
        async with Client.connect(server.address) as client:
            await client.submit(request)
            events = [event async for event in client.watch(request.job_id)]
        result = events[-1].finished.result
        assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0, result.failure
        assert backend.sizes and backend.sizes[-1] >= 8_000_000  # the call really carried 8 MB

        async with consumers() as start:
            consumer = await start(server.address, tmp_path / "c.cursor", "-from", "oldest", "-idle", "3s")
            assert await consumer.wait() == 0, consumer.said()
        assert "ResourceExhausted" not in consumer.said(), consumer.said()
        printed = [(line["job_id"], line["seq"], line["kind"]) for line in consumer.lines]
        assert printed == [(event.job_id, event.seq, str(event.WhichOneof("kind"))) for event in events]
        finished = consumer.lines[-1]
        assert finished["status"] == "JOB_STATUS_SUCCEEDED" and finished["reward"] == 1.0, finished
    finally:
        await server.stop()
    assert not server_containers(podman_url, settings.server.instance_id)
