"""The EventWriter (jobs/event_writer.py): running jobs' events reach the store in batches,
never after the job's `finished`, through store failures (within a cap), and at shutdown;
and a job killed mid-run comes back from the SQLite store with the events it had stored."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from prorl_client import v1
from prorl_server.agents.registry import default_registry
from prorl_server.config import load_settings
from prorl_server.jobs.event_log import EventLog
from prorl_server.jobs.event_writer import EventWriter
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.phases import phase_gates
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from prorl_server.jobs.store import FeedBounds, FeedPage, JobStore, StoredJob
from prorl_server.llm.router import BackendRouter
from prorl_server.sandbox.allocator import SandboxAllocator
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt
from tests.helpers import assert_eventually, math_request

SLOW = 60.0  # a flush interval no test waits for: only the event count or close() flush


class RecordingStore(JobStore):
    """Records `appended` and `finished` calls; fails `fail` calls of `appended`, or all while
    `down`; an `appended` call waits for `gate` when one is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []
        self.fail = 0
        self.down = False
        self.failures = 0
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def submitted(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def appended(self, job_id: str, events: Sequence[v1.RolloutEvent]) -> None:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.down or self.fail > 0:
            self.fail -= 1
            self.failures += 1
            raise ConnectionError("store unreachable")
        self.calls.append(("appended", job_id, [event.seq for event in events]))

    async def finished(
        self, job_id: str, status: int, end_time: float, result: v1.RolloutResult, events: list[v1.RolloutEvent]
    ) -> None:
        self.calls.append(("finished", job_id, [event.seq for event in events]))

    async def load(self, retain_s: float) -> list[StoredJob]:
        return []

    async def feed_bounds(self) -> FeedBounds:  # no feed: the writer never reads it
        return FeedBounds("recording", 0, 0)

    async def feed_page(self, after: int, limit: int, kinds: Sequence[str] = ()) -> FeedPage:
        return FeedPage([], after, 0)

    async def feed_trim(self, retain_s: float) -> int:
        return 0

    def written(self, job_id: str) -> list[int]:
        return [seq for kind, job, seqs in self.calls if kind == "appended" and job == job_id for seq in seqs]

    def appends(self) -> int:
        return sum(1 for kind, _, _ in self.calls if kind == "appended")


def grow(log: EventLog, count: int) -> None:
    for turn in range(count):
        log.append(tool_result=v1.ToolResult(turn=turn, name="python", output="x"))


@pytest_asyncio.fixture
async def store() -> RecordingStore:
    return RecordingStore()


async def test_many_events_go_in_few_batches(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=64, flush_interval_s=SLOW)
    logs = [EventLog("a"), EventLog("b")]
    for log in logs:
        writer.track(log)
    for _ in range(10):  # as jobs do: a few events, then the loop runs
        for log in logs:
            grow(log, 20)
        await asyncio.sleep(0)
    await assert_eventually(lambda: writer.pending < 64, message="no batch went at 64 events")
    assert 1 <= store.appends() <= 2 * (400 // 64 + 1)  # a call per job and batch of 64, not 400
    await writer.close()
    for log in logs:
        assert store.written(log.job_id) == list(range(1, 201))  # every event once, in order
    assert writer.dropped == 0


async def test_a_few_events_go_after_the_interval(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=64, flush_interval_s=0.05)
    log = EventLog("a")
    log.append(queued=v1.JobQueued())
    writer.track(log)  # the events so far, then the new ones
    grow(log, 2)
    await assert_eventually(lambda: store.written("a") == [1, 2, 3], message="the events were never written")
    assert store.appends() == 1
    await writer.close()


async def test_no_append_of_a_job_lands_after_its_finished(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=4, flush_interval_s=SLOW)
    log = EventLog("a")
    writer.track(log)
    store.gate = asyncio.Event()
    grow(log, 4)  # a batch goes, and waits in the store
    await asyncio.wait_for(store.entered.wait(), 5)
    grow(log, 3)  # pending behind it
    finishing = asyncio.create_task(writer.finish("a"))
    await asyncio.sleep(0.05)
    assert not finishing.done()  # waits for the append in flight
    store.gate.set()
    await finishing
    await store.finished("a", 0, time.time(), v1.RolloutResult(), log.events())
    grow(log, 2)  # no longer followed
    await writer.close()
    assert store.calls == [("appended", "a", [1, 2, 3, 4]), ("finished", "a", list(range(1, 8)))]


async def test_a_failing_store_is_retried_without_losing_events(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=8, flush_interval_s=0.01)
    log = EventLog("a")
    writer.track(log)
    store.fail = 3
    with capture_logs() as logs:
        for _ in range(5):
            grow(log, 10)
            await asyncio.sleep(0.01)
        await assert_eventually(lambda: store.written("a") == list(range(1, 51)), message="events were lost")
    assert store.failures == 3
    assert [entry["event"] for entry in logs].count("job_events_write_failed") == 1  # once per outage
    assert "job_events_store_recovered" in [entry["event"] for entry in logs]
    await writer.close()


async def test_beyond_the_cap_the_oldest_pending_events_are_dropped(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=5, flush_interval_s=0.01, max_pending=10)
    log = EventLog("a")
    writer.track(log)
    store.down = True
    with capture_logs() as logs:
        grow(log, 25)
        await assert_eventually(lambda: store.failures > 2, message="the store was not tried")
        assert writer.dropped == 15 and writer.pending <= 10
        store.down = False
        await assert_eventually(lambda: writer.pending == 0, message="the pending events were never written")
    assert store.written("a") == list(range(16, 26))  # the newest ten
    assert any(entry["event"] == "job_events_dropped" and entry["log_level"] == "error" for entry in logs)
    await writer.finish("a")
    await writer.close()


async def test_shutdown_writes_what_is_pending_and_ends_the_task(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=64, flush_interval_s=SLOW)
    log = EventLog("a")
    writer.track(log)
    grow(log, 5)
    task = writer._task
    assert task is not None
    await writer.close()
    assert task.done() and store.written("a") == [1, 2, 3, 4, 5]
    grow(log, 1)  # no longer followed
    assert writer.pending == 0 and store.appends() == 1


async def test_a_cancelled_writer_stops_following_and_reraises(store: RecordingStore) -> None:
    writer = EventWriter(store, flush_events=64, flush_interval_s=SLOW)
    log = EventLog("a")
    writer.track(log)
    grow(log, 3)
    task = writer._task
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    grow(log, 1)
    assert log._listeners == []
    await writer.close()


# --- the job manager on the SQLite store ----------------------------------------------------


class Server:
    """A JobManager on the fakes with a SQLite store; "hold" waits in its model turn."""

    def __init__(self, provider: FakeSandboxProvider, path: Path) -> None:
        self.release = asyncio.Event()
        self.backend = ScriptedChatBackend(self.script)
        self.router = BackendRouter(health_interval_s=0)
        self.router.add(self.backend)
        self.allocator = SandboxAllocator(provider, [])
        self.store = SQLiteJobStore(path)
        settings = load_settings(None, environ={}, overrides={"jobs": {"store": False}})
        pipeline = Pipeline(gates=phase_gates(init=4, run=4, eval=4), sandboxes=self.allocator, router=self.router)
        self.manager = JobManager(settings=settings, registry=default_registry(), pipeline=pipeline, store=self.store)

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        question = user_prompt(messages)
        wait = self.release if question == "hold" else None
        return ScriptedReply(tool_call_text("finish", {"answer": "42"}), wait_for=wait)

    async def stop(self) -> None:
        self.release.set()
        await self.manager.shutdown(0)
        await self.allocator.close()
        await self.router.close()
        await self.store.close()


@pytest_asyncio.fixture
async def servers(fake_provider: FakeSandboxProvider) -> AsyncIterator[list[Server]]:
    made: list[Server] = []
    yield made
    for server in reversed(made):
        await server.stop()


async def test_a_job_killed_mid_run_comes_back_with_its_events(
    servers: list[Server], fake_provider: FakeSandboxProvider, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.sqlite"
    first = Server(fake_provider, path)
    servers.append(first)
    await first.store.open()
    assert await first.manager.restore() == 0
    job, _ = first.manager.submit(math_request("hold", job_id="killed"))
    await assert_eventually(lambda: first.backend.in_flight == 1, message="the job never got held")
    # every event so far in the store (not only taken by the writer: it may still be writing them)
    await assert_eventually(lambda: job.events.durable_seq == job.events.last_seq >= 2, message="not all written")
    before = job.events.events()
    assert len(before) >= 2 and not job.finished

    # The first server is gone without a shutdown: a second one opens the same file.
    second = Server(fake_provider, path)
    servers.append(second)
    await second.store.open()
    assert await second.manager.restore() == 1
    again = second.manager.get("killed")
    assert again.status == v1.JOB_STATUS_FAILED and again.result is not None
    assert again.result.failure.reason == "interrupted"
    events = [event async for event in second.manager.watch("killed")]
    assert events[:-1] == before
    assert events[-1].HasField("finished") and events[-1].finished.result == again.result
    assert [event.seq for event in events] == list(range(1, len(before) + 2))

    # ...and that verdict is what the store now holds.
    (stored,) = await second.store.load(retain_s=3600)
    assert stored.result == again.result and stored.events == events


async def test_stored_events_with_a_gap_are_restored_up_to_it(
    servers: list[Server], fake_provider: FakeSandboxProvider, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.sqlite"
    store = SQLiteJobStore(path)
    await store.open()
    request = math_request("answer 7", "7", job_id="gap")
    await store.submitted("gap", 1, request, request.SerializeToString(deterministic=True), time.time())
    log = EventLog("gap")
    log.append(queued=v1.JobQueued())
    grow(log, 7)
    events = log.events()
    await store.appended("gap", events[:3] + events[5:])  # 4 and 5 dropped by the writer
    await store.appended("gap", events[:2])  # written twice: kept once
    await store.close()

    server = Server(fake_provider, path)
    servers.append(server)
    await server.store.open()
    assert await server.manager.restore() == 1
    restored = server.manager.get("gap").events.events()
    assert restored[:3] == events[:3]
    assert [event.seq for event in restored] == [1, 2, 3, 4] and restored[-1].HasField("finished")


async def test_a_job_whose_finished_event_was_stored_comes_back_finished(
    servers: list[Server], fake_provider: FakeSandboxProvider, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.sqlite"
    store = SQLiteJobStore(path)
    await store.open()
    request = math_request("answer 7", "7", job_id="done")
    await store.submitted("done", 1, request, request.SerializeToString(deterministic=True), time.time())
    log = EventLog("done")
    log.append(queued=v1.JobQueued())
    result = v1.RolloutResult(job_id="done", status=v1.JOB_STATUS_SUCCEEDED, reward=1.0)
    log.append(finished=v1.JobFinished(result=result))
    await store.appended("done", log.events())  # the server died before writing `finished`
    await store.close()

    server = Server(fake_provider, path)
    servers.append(server)
    await server.store.open()
    assert await server.manager.restore() == 1
    job = server.manager.get("done")
    assert job.status == v1.JOB_STATUS_SUCCEEDED and job.result == result
    assert job.events.events() == log.events()
