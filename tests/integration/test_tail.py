"""`prorl tail`: every finished trajectory that matches a filter, appended to a file exactly
once, whatever stops the tail or its server.

The real command runs as a child process against a real server on a fixed port over a SQLite
store (stopped and started again on the same port and store, as in a deploy); no Podman, no
model (a fake sandbox provider and a scripted LLM backend, as in tests/unit/jobs/test_subscribe.py).
Also: the start-up recovery of an output that holds more than its cursor file says (a kill
between the two writes), a cursor behind retention, Parquet without pyarrow, and the example
consumer of examples/consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]
import pytest
import pytest_asyncio
from prorl_client.runner import main
from prorl_client.tail_output import (
    JsonlSink,
    ParquetSink,
    Position,
    TailError,
    TailFilter,
    cursor_path,
    load_position,
    part_name,
    save_position,
)
from prorl_client.viewer import render
from pyarrow.dataset import dataset  # type: ignore[import-not-found,import-untyped,unused-ignore]

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.jobs.feed import decode_cursor, encode_cursor
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text
from tests.helpers import assert_eventually, math_request

REPO = Path(__file__).resolve().parents[2]
REPLAY_BUFFER = REPO / "examples" / "consumers" / "replay_buffer.py"


def script(hold: asyncio.Event) -> Any:
    """Right for questions with "even", wrong otherwise; after a short, varied wait, so that
    jobs finish over a while rather than all at once; questions with "hold" wait for `hold`."""

    def answer(messages: list[dict[str, Any]]) -> ScriptedReply:
        question = str(messages[-1]["content"])
        return ScriptedReply(
            tool_call_text("finish", {"answer": "42" if "even" in question else "7"}),
            delay_s=random.uniform(0, 0.2),
            wait_for=hold if "hold" in question else None,
        )

    return answer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Node:
    """A server on a fixed port over a SQLite store that outlives it: stopped and started
    again, it is the same service at the same address."""

    def __init__(self, tmp_path: Path, sandboxes: Path, **subscribe: Any) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.store_path = tmp_path / "jobs.sqlite"
        self.subscribe = subscribe
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"), root=sandboxes)
        self.server: ProrlServer | None = None
        self.client = Client.connect(self.address)
        self.submitted: list[str] = []
        self.hold = asyncio.Event()
        """Jobs whose question says "hold" stay in their model turn until it is set."""

    async def start(self) -> None:
        settings = load_settings(
            None,
            environ={},
            overrides={
                "server": {"port": self.port, "instance_id": "tail-test", "shutdown_grace_s": 0},
                "jobs": {"store": True, "store_path": str(self.store_path)},
                "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
                "subscribe": {"poll_interval_s": 0.05, **self.subscribe},
            },
        )
        self.server = ProrlServer(
            settings, sandbox_provider=self.provider, backends=[ScriptedChatBackend(script(self.hold), backend_id="s")]
        )
        await self.server.start()
        await self.client.close()
        self.client = Client.connect(self.address)  # a fresh channel: no reconnection backoff to wait out

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None

    async def close(self) -> None:
        await self.stop()
        await self.client.close()

    @property
    def store(self) -> SQLiteJobStore:
        assert self.server is not None and isinstance(self.server._mode.store, SQLiteJobStore)
        return self.server._mode.store

    async def submit(
        self,
        count: int,
        *,
        prefix: str,
        pause_s: float = 0.0,
        hold_every: int = 0,
        padding: int = 0,
        labels: dict[str, str] | None = None,
    ) -> None:
        """`count` jobs, labelled run=a and run=b in turn (or all with `labels`); half of each
        answer right; with hold_every=n, every n-th job waits for `hold`; `padding` characters
        more per question."""
        for index in range(count):
            job_id = f"{prefix}-{index}"
            held = " hold" if hold_every and index % hold_every == 0 else ""
            question = f"{'.' * padding}Q{index} {'even' if index % 4 < 2 else 'odd'}{held}"
            request = math_request(question, "42", job_id=job_id, labels=labels or {"run": "ab"[index % 2]})
            request.retry.max_restarts = 1
            await self.client.submit(request)
            self.submitted.append(job_id)
            await asyncio.sleep(pause_s)

    async def all_finished(self) -> dict[str, v1.Job]:
        jobs = {}
        for job_id in self.submitted:
            job = await self.client.get_job(job_id)
            if not job.HasField("result"):
                return {}
            jobs[job_id] = job
        return jobs


@pytest_asyncio.fixture
async def node(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    # The sandboxes' sockets are in their folders: a short path (AF_UNIX paths are short).
    node = Node(tmp_path, tmp_path_factory.mktemp("sb"))
    await node.start()
    yield node
    await node.close()
    assert node.provider.busy == 0


class TailProcess:
    """`prorl tail` as a child process; its standard error goes to a log beside its output.
    Never left running: `close` kills it."""

    def __init__(self, node: Node, out: Path, *args: str) -> None:
        self.args = ["--server", node.address, "--out", str(out), *args]
        self.log = out.with_name(out.name + ".log")
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0
        """Where the log of the latest start begins."""

    async def start(self, *extra: str) -> TailProcess:
        self.started_at = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("a") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "prorl_client.runner", "tail", *self.args, *extra,
                stdout=asyncio.subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        return self

    async def wait(self, timeout_s: float = 60) -> int:
        assert self.process is not None
        return await asyncio.wait_for(self.process.wait(), timeout_s)

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.wait()

    async def terminate(self) -> int:
        """SIGTERM once it follows (before, its signal handlers are not set yet)."""
        assert self.process is not None
        await assert_eventually(
            lambda: "following into" in self.stderr()[self.started_at :], message=f"not following:\n{self.stderr()}"
        )
        self.process.send_signal(signal.SIGTERM)
        return await self.wait()

    def stderr(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            await self.kill()


async def run_tail(node: Node, out: Path, *args: str) -> tuple[int, str]:
    """Run the tail to its end; (exit code, what it printed on standard error)."""
    tail = TailProcess(node, out, *args)
    tail.log.unlink(missing_ok=True)
    try:
        code = await (await tail.start()).wait()
    finally:
        await tail.close()
    return code, tail.stderr()


def read_output(out: Path) -> list[dict[str, Any]]:
    """The records of a tail's output: the complete lines of a JSONL file, the rows of a
    Parquet directory's parts."""
    if out.suffix == ".parquet":  # one dataset: the parts share one schema (temporary names are left out)
        rows: list[dict[str, Any]] = dataset(out, format="parquet").to_table().to_pylist() if out.exists() else []
        return rows
    if not out.exists():
        return []
    records = []
    for line in out.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n"):
            records.append(json.loads(line))
    return records


def assert_exactly_the_matching_jobs(records: list[dict[str, Any]], jobs: dict[str, v1.Job]) -> None:
    """Every finished run=a job once, as GetJob gives it; no other job; in the feed's order."""
    wanted = {job_id for job_id, job in jobs.items() if job.labels["run"] == "a"}
    ids = [record["job_id"] for record in records]
    assert sorted(ids) == sorted(wanted), (len(ids), len(set(ids)), len(wanted))
    for record in records:
        result = jobs[record["job_id"]].result
        assert record["status"] == v1.JobStatus.Name(result.status)
        assert record["reward"] == result.reward
        assert len(record["messages"]) == len(result.trajectory.messages)
        assert record["handler"] == "math" and dict(record["labels"]) == {"run": "a"}
        assert record["attempt"] >= 1
    positions = [decode_cursor(record["cursor"])[1] for record in records]
    assert positions == sorted(positions)


async def output_holds(out: Path, count: int, tail: TailProcess | None = None) -> None:
    try:
        await assert_eventually(lambda: len(read_output(out)) >= count, timeout_s=60)
    except AssertionError:
        raise AssertionError(
            f"{out} holds {len(read_output(out))} records, not {count}; the tail said:\n{tail.stderr() if tail else ''}"
        ) from None


@pytest.mark.parametrize("name", ["trajectories.jsonl", "trajectories.parquet"])
async def test_a_killed_tail_and_a_restarted_server_write_every_matching_job_exactly_once(
    node: Node, tmp_path: Path, name: str
) -> None:
    out = tmp_path / name
    flush = ["--flush-records", "3", "--flush-seconds", "0.2"]
    tail = TailProcess(node, out, "--label", "run=a", "--from", "oldest", "--retries", "40", *flush)
    await tail.start()
    try:
        # A kill -9 while records come in; started again at once.
        wave = asyncio.ensure_future(node.submit(24, prefix="one", pause_s=0.03))
        await output_holds(out, 3, tail)
        await tail.kill()
        await tail.start()
        await wave
        await output_holds(out, 12, tail)  # wave one's run=a jobs
        # Killed; jobs finish while it is down; started again.
        await tail.kill()
        await node.submit(24, prefix="two", hold_every=3)
        await tail.start()
        # The server stops while the tail follows and 8 jobs run (4 of them run=a); the same
        # server comes back at the same address.
        await output_holds(out, 12 + 8, tail)
        await node.stop()
        node.hold.set()
        await node.start()
        wave = asyncio.ensure_future(node.submit(24, prefix="three", pause_s=0.03))
        await output_holds(out, 12 + 12 + 3, tail)
        await tail.kill()
        await tail.start()
        await wave
        jobs: dict[str, v1.Job] = {}

        async def finished() -> bool:
            jobs.update(await node.all_finished())
            return bool(jobs)

        await assert_eventually(finished, timeout_s=60)
        wanted = sum(job.labels["run"] == "a" for job in jobs.values())
        await output_holds(out, wanted, tail)
        assert await tail.terminate() == 0, tail.stderr()
    finally:
        await tail.close()

    records = read_output(out)
    assert_exactly_the_matching_jobs(records, jobs)
    assert len(records) == 36 and {record["reward"] for record in records} == {0.0, 1.0}
    # the jobs the stop cut short, as the server ended them (and once)
    assert sum(record["status"] == "JOB_STATUS_CANCELLED" for record in records) == 4
    saved = json.loads(cursor_path(out).read_text())
    assert saved["records"] == len(records)
    if name.endswith(".parquet"):
        assert saved["parts"] == len(list(out.glob("part-*.parquet"))) > 1
        assert not list(out.glob(".*.tmp"))
        assert pq.read_table(out / part_name(0)).schema.field("token_ids").type.value_type.bit_width == 32
    else:
        assert saved["bytes"] == out.stat().st_size
        assert all(record["timeline"] == [] and record["sample"] is None for record in records)
        page = render(records)  # what `prorl view` draws from a `prorl run` file
        assert all(record["job_id"] in page for record in records)


@pytest.mark.parametrize("name", ["trajectories.jsonl", "trajectories.parquet"])
async def test_records_beyond_the_cursor_file_are_kept_and_not_written_again(
    node: Node, tmp_path: Path, name: str
) -> None:
    """A kill after the output was written but before the cursor file was: the tail goes on
    after the last complete record, and cuts off a line cut short."""
    await node.submit(12, prefix="j")
    await assert_eventually(node.all_finished, timeout_s=60)
    out = tmp_path / name
    first_save = tmp_path / "first.cursor"
    code, stderr = await run_tail(node, out, "--label", "run=a", "--from", "oldest", "--flush-records", "1",
                                  "--max-records", "1", "--quiet")  # fmt: skip
    assert code == 0, stderr
    shutil.copy(cursor_path(out), first_save)
    code, stderr = await run_tail(node, out, "--label", "run=a", "--flush-records", "1", "--max-records", "3",
                                  "--quiet")  # fmt: skip
    assert code == 0, stderr
    assert len(read_output(out)) == 4
    shutil.copy(first_save, cursor_path(out))  # as if killed before saving records 2 to 4
    if name.endswith(".jsonl"):
        with out.open("ab") as file:
            file.write(b'{"job_id": "cut-sh')  # and in the middle of writing a fifth
    else:
        (out / ".part-000004.parquet.tmp").write_bytes(b"PAR1 cut short")

    code, stderr = await run_tail(node, out, "--label", "run=a", "--until-idle", "2.5")

    assert code == 0, stderr
    assert "3 record(s) past its cursor file" in stderr
    assert_exactly_the_matching_jobs(read_output(out), await node.all_finished())
    assert json.loads(cursor_path(out).read_text())["records"] == 6
    if name.endswith(".jsonl"):
        assert out.read_bytes().endswith(b"}\n")


async def test_a_cursor_behind_retention_stops_the_tail_and_says_how_to_go_on(node: Node, tmp_path: Path) -> None:
    out = tmp_path / "trajectories.jsonl"
    await node.submit(4, prefix="early")
    await assert_eventually(node.all_finished, timeout_s=60)
    code, stderr = await run_tail(node, out, "--label", "run=a", "--from", "oldest", "--until-idle", "2.5")
    assert code == 0 and len(read_output(out)) == 2, stderr
    await node.submit(4, prefix="lost")
    await assert_eventually(node.all_finished, timeout_s=60)
    await asyncio.sleep(0.05)
    assert await node.store.feed_trim(0.01) > 0  # retention deletes what the tail has not read

    code, stderr = await run_tail(node, out, "--label", "run=a", "--until-idle", "1")

    assert code == 3
    assert "--from oldest" in stderr and "nothing was skipped" in stderr and "retention" in stderr
    assert len(read_output(out)) == 2  # as it was

    await node.submit(2, prefix="late")
    await assert_eventually(node.all_finished, timeout_s=60)
    code, stderr = await run_tail(node, out, "--label", "run=a", "--from", "oldest", "--until-idle", "2.5")
    assert code == 0, stderr
    assert "NOT in the output" in stderr  # the gap, said out loud
    ids = [record["job_id"] for record in read_output(out)]
    assert sorted(ids[:2]) == ["early-0", "early-2"] and ids[2:] == ["late-0"]


async def test_a_tail_that_stops_reading_is_ended_by_the_server_and_resumes_where_it_was(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, too_slow_endings: list[str]
) -> None:
    ended = too_slow_endings
    node = Node(tmp_path, tmp_path_factory.mktemp("sb"), max_lag_events=20, page_size=8)
    await node.start()
    out = tmp_path / "trajectories.jsonl"
    tail = TailProcess(node, out, "--label", "run=a")
    try:
        await tail.start()
        await assert_eventually(cursor_path(out).exists)
        assert tail.process is not None
        tail.process.send_signal(signal.SIGSTOP)  # reads nothing, the feed goes on
        # Waves of 5 matching trajectories of 400 KB, then non-matching jobs that move the head
        # past a send left pending, until the server ends the stream: gRPC's window and the
        # sockets' buffers fill up however much they take (4 MB here; more where tcp_wmem is raised).
        async with asyncio.timeout(180):
            for wave in itertools.count():
                await node.submit(10, prefix=f"big{wave}", padding=400_000)
                await assert_eventually(node.all_finished, timeout_s=60)
                await node.submit(10, prefix=f"more{wave}", labels={"run": "b"})
                with contextlib.suppress(AssertionError):
                    await assert_eventually(lambda: bool(ended), timeout_s=3)
                if ended:
                    break
        tail.process.send_signal(signal.SIGCONT)
        await assert_eventually(node.all_finished, timeout_s=60)
        jobs = await node.all_finished()
        await output_holds(out, sum(job.labels["run"] == "a" for job in jobs.values()))
        assert await tail.terminate() == 0, tail.stderr()
        assert_exactly_the_matching_jobs(read_output(out), jobs)
    finally:
        await tail.close()
        await node.close()


async def test_a_first_start_from_now_follows_only_what_comes_after_it(node: Node, tmp_path: Path) -> None:
    await node.submit(4, prefix="before")
    await assert_eventually(node.all_finished, timeout_s=60)
    out = tmp_path / "trajectories.jsonl"
    tail = await TailProcess(node, out, "--label", "run=a").start()
    try:
        await assert_eventually(cursor_path(out).exists)  # where it began is saved before any record
        await node.submit(4, prefix="after")
        await output_holds(out, 2)
        assert await tail.terminate() == 0
    finally:
        await tail.close()
    assert sorted(record["job_id"] for record in read_output(out)) == ["after-0", "after-2"]


async def test_sigterm_ends_the_tail_at_once_while_its_server_is_away(node: Node, tmp_path: Path) -> None:
    out = tmp_path / "trajectories.jsonl"
    tail = await TailProcess(node, out, "--label", "run=a").start()
    try:
        await assert_eventually(cursor_path(out).exists)
        await node.stop()  # the tail retries for minutes (--retries 20)
        began = time.monotonic()
        assert await tail.terminate() == 0, tail.stderr()
        assert time.monotonic() - began < 5
    finally:
        await tail.close()


async def test_a_tail_with_another_filter_refuses_the_output(node: Node, tmp_path: Path) -> None:
    out = tmp_path / "trajectories.jsonl"
    code, stderr = await run_tail(node, out, "--label", "run=a", "--until-idle", "0.5")
    assert code == 0, stderr
    code, stderr = await run_tail(node, out, "--label", "run=b", "--until-idle", "0.5")
    assert code == 1 and "use the same filter, or another --out" in stderr


# --- Start-up recovery, without a server -----------------------------------------------


def feed_cursor(position: int) -> str:
    return encode_cursor("store", position)


def jsonl_line(position: int) -> bytes:
    return json.dumps({"job_id": f"j{position}", "cursor": feed_cursor(position)}).encode() + b"\n"


def test_jsonl_recovery_keeps_complete_records_past_the_cursor_file_and_cuts_a_partial_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    lines = [jsonl_line(position) for position in (3, 5, 8)]
    out.write_bytes(b"".join(lines) + b'{"job_id": "j9", "cur')
    saved = Position(feed_cursor(3), len(lines[0]), 1)
    sink = JsonlSink(out)
    try:
        assert sink.recover(saved) == Position(feed_cursor(8), sum(map(len, lines)), 3)
    finally:
        sink.close()
    assert out.read_bytes() == b"".join(lines)


def test_jsonl_recovery_without_a_cursor_file_goes_on_after_the_last_record(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(jsonl_line(4) + jsonl_line(6))
    sink = JsonlSink(out)
    try:
        assert sink.recover(None) == Position(feed_cursor(6), out.stat().st_size, 2)
    finally:
        sink.close()
    only_a_cut = tmp_path / "cut.jsonl"
    only_a_cut.write_bytes(b'{"job_id"')
    sink = JsonlSink(only_a_cut)
    try:
        assert sink.recover(None) is None  # nothing complete: a first start
    finally:
        sink.close()
    assert only_a_cut.read_bytes() == b""


def test_jsonl_recovery_refuses_an_output_shorter_than_its_cursor_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(jsonl_line(1))
    with pytest.raises(TailError, match="truncated or replaced"):
        JsonlSink(out).recover(Position(feed_cursor(5), 10_000, 7))


def test_parquet_recovery_reads_parts_past_the_cursor_file_and_drops_unfinished_ones(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    sink = ParquetSink(out)
    assert sink.recover(None) is None
    for part, positions in enumerate([(1, 2), (4,), (6, 9)]):
        for position in positions:
            response = v1.FeedEvent(cursor=feed_cursor(position), attempt=1)
            response.event.job_id = f"j{position}"
            response.event.finished.result.job_id = f"j{position}"
            sink.append(response)
        assert sink.sync() == part + 1
    (out / ".part-000003.parquet.tmp").write_bytes(b"PAR1")

    assert ParquetSink(out).recover(Position(feed_cursor(2), 1, 2)) == Position(feed_cursor(9), 3, 5)
    assert not list(out.glob(".*.tmp"))
    (out / part_name(1)).unlink()
    with pytest.raises(TailError, match="without gaps"):
        ParquetSink(out).recover(None)


def test_a_cursor_file_of_another_filter_or_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl.cursor"
    wanted = TailFilter(labels=(("run", "a"),), statuses=("succeeded",))
    save_position(path, Position(feed_cursor(3), 10, 1), output_format="jsonl", wanted=wanted)
    assert load_position(path, output_format="jsonl", wanted=wanted) == Position(feed_cursor(3), 10, 1)
    with pytest.raises(TailError, match="same filter"):
        load_position(path, output_format="jsonl", wanted=TailFilter(labels=(("run", "b"),)))
    with pytest.raises(TailError, match="jsonl output"):
        load_position(path, output_format="parquet", wanted=wanted)


def test_parquet_without_pyarrow_says_which_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(TailError, match=r"pip install 'prorl-client\[parquet\]'"):
        ParquetSink(tmp_path / "out.parquet")
    assert main(["tail", "--out", str(tmp_path / "out.parquet")]) == 1  # before connecting to any server
    assert "pip install 'prorl-client[parquet]'" in capsys.readouterr().err


# --- The example consumers -------------------------------------------------------------


def docs_example(heading: str) -> str:
    """The Python block under a heading of docs/subscribe.md."""
    text = (REPO / "docs" / "subscribe.md").read_text()
    section = text[text.index(heading) :]
    return section[section.index("```python\n") + len("```python\n") : section.index("\n```\n")]


async def test_the_python_consumer_of_the_docs_counts_each_trajectory_once_across_restarts(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace: dict[str, Any] = {}
    exec(docs_example("## A consumer in Python"), namespace)
    state = tmp_path / "state.json"

    async def submit(prefix: str, count: int) -> None:
        for index in range(count):
            request = math_request(f"Q{index} {'even' if index % 2 else 'odd'}", "42", job_id=f"{prefix}-{index}")
            request.labels["run"] = "exp1"
            await node.client.submit(request)
            node.submitted.append(request.job_id)
        await assert_eventually(node.all_finished, timeout_s=60)

    async def consume_until(count: int) -> None:
        consumer = asyncio.ensure_future(namespace["mean_reward"](node.client, state))
        try:
            await assert_eventually(lambda: state.exists() and json.loads(state.read_text())["n"] >= count)
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer

    first = asyncio.ensure_future(consume_until(2))
    await assert_eventually(state.exists)  # the first progress mark: following from now
    await node.submit(2, prefix="other")  # labelled run=a and run=b: not counted
    await submit("x", 2)
    await first
    await submit("y", 2)  # while no consumer runs
    await consume_until(4)
    saved = json.loads(state.read_text())
    assert saved["n"] == 4 and saved["sum"] == 2.0
    assert "4 trajectories, mean reward 0.500" in capsys.readouterr().out


async def test_the_replay_buffer_example_counts_each_trajectory_once_across_restarts(
    node: Node, tmp_path: Path
) -> None:
    state = tmp_path / "replay.state.json"

    async def consume(count: int) -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(REPLAY_BUFFER), "--server", node.address, "--label", "run=a",
            "--state", str(state), "--stop-after", str(count),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 0, stderr.decode()
        return stdout.decode()

    first = asyncio.ensure_future(consume(3))
    await assert_eventually(state.exists)  # following from now
    await node.submit(12, prefix="r")
    printed = await first
    assert "math" in printed and "mean reward" in printed
    await assert_eventually(node.all_finished, timeout_s=60)
    printed = await consume(3)  # the other three run=a jobs, after the saved cursor
    jobs = await node.all_finished()
    rewards = [job.result.reward for job in jobs.values() if job.labels["run"] == "a"]
    assert f"math {sum(rewards) / len(rewards):.3f} (n=6)" in printed.splitlines()[-1]
