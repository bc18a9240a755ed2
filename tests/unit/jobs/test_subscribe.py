"""Subscribe (the event feed) through a real server on a real port and the real client, with
a SQLite job store; no Podman, no model (a fake sandbox provider and a scripted LLM backend):
filters, cursors that resume exactly after an event (also after a server restart), progress
marks, the errors a consumer can get (bad filter or cursor, a cursor behind retention, no
store, falling behind) and what the feed leaves out (gateway API keys). A consumer that stops
reading altogether is shown on the servicer with a context whose writes stop completing
(over a real connection that takes megabytes of gRPC window first: bench/feed.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import pytest_asyncio

from prorl_client import Client, RpcError, v1
from prorl_server.api.rollout_servicer import RolloutServicer
from prorl_server.app import ProrlServer
from prorl_server.config import SubscribeSettings, load_settings
from prorl_server.errors import ConsumerTooSlow
from prorl_server.jobs.feed import MAX_RESPONSE_BYTES, OLDEST, RESUME_CURSOR_KEY, Feed, batches_of, decode_cursor
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from prorl_server.jobs.store import FeedEntry, feed_copy
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text
from tests.helpers import assert_eventually, math_request


def answer(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Right for questions ending in "even", wrong otherwise: both statuses and rewards occur."""
    question = str(messages[-1]["content"])
    return ScriptedReply(tool_call_text("finish", {"answer": "42" if "even" in question else "7"}))


class Served:
    """A server over a SQLite store at `path` (kept across restarts)."""

    def __init__(self, path: Path, **subscribe: Any) -> None:
        self.path = path
        self.subscribe = subscribe
        self.provider = FakeSandboxProvider(instance_id=instance_id("fake"))
        self.server: ProrlServer | None = None
        self.client = Client.connect("")

    async def start(self, *, store: bool = True) -> None:
        settings = load_settings(
            None,
            environ={},
            overrides={
                "server": {"port": 0, "instance_id": "feed-test", "shutdown_grace_s": 0},
                "jobs": {"store": store, "store_path": str(self.path)},
                "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
                "subscribe": {"poll_interval_s": 0.05, **self.subscribe},
            },
        )
        self.server = ProrlServer(
            settings, sandbox_provider=self.provider, backends=[ScriptedChatBackend(answer, backend_id="s")]
        )
        await self.server.start()
        await self.client.close()
        self.client = Client.connect(self.server.address)

    async def stop(self) -> None:
        await self.client.close()
        if self.server is not None:
            await self.server.stop()
            self.server = None

    async def run(self, count: int, *, prefix: str, **fields: Any) -> list[v1.RolloutResult]:
        async def one(index: int) -> v1.RolloutResult:
            question = f"Q{index} {'even' if index % 2 == 0 else 'odd'}"
            request = math_request(question, "42", job_id=f"{prefix}-{index}", **fields)
            events = [event async for event in self.client.rollout(request)]
            return events[-1].finished.result

        return list(await asyncio.gather(*(one(index) for index in range(count))))


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    served = Served(tmp_path / "jobs.sqlite")
    await served.start()
    yield served
    await served.stop()
    assert served.provider.busy == 0


async def collect(stream: AsyncIterator[v1.FeedEvent], until: Any, timeout_s: float = 30) -> list[Any]:
    """Items of `stream` until `until(items)` holds."""
    seen: list[v1.FeedEvent] = []

    async def read() -> None:
        async for response in stream:
            seen.append(response)
            if until(seen):
                return

    await asyncio.wait_for(read(), timeout_s)
    return seen


def events_of(responses: list[v1.FeedEvent]) -> list[v1.RolloutEvent]:
    return [response.event for response in responses if response.HasField("event")]


def finished_count(count: int) -> Any:
    return lambda seen: sum(response.event.HasField("finished") for response in seen) >= count


async def test_a_filtered_stream_gets_every_matching_event_once_in_store_order(served: Served) -> None:
    client = served.client
    finished_a = client.subscribe(labels={"run": "a"}, event_kinds=["finished"])
    everything_g = client.subscribe(group_ids=["g"])
    first = [await anext(finished_a), await anext(everything_g)]
    assert all(not response.HasField("event") and response.cursor for response in first)  # where each began
    reading_a = asyncio.ensure_future(collect(finished_a, finished_count(6)))
    reading_g = asyncio.ensure_future(collect(everything_g, finished_count(4)))
    results_a = await served.run(6, prefix="a", labels={"run": "a"})
    results_g = await served.run(4, prefix="g", group_id="g", labels={"run": "b"})
    got_a, got_g = await reading_a, await reading_g

    assert {event.job_id for event in events_of(got_a)} == {f"a-{index}" for index in range(6)}
    assert [event.WhichOneof("kind") for event in events_of(got_a)] == ["finished"] * 6
    tagged = [(r.handler, r.group_id, dict(r.labels)) for r in got_a if r.HasField("event")]
    assert tagged == [("math", "", {"run": "a"})] * 6  # the job's tags, as the filter saw them
    assert sorted(event.finished.result.reward for event in events_of(got_a)) == sorted(
        result.reward for result in results_a
    )
    assert {result.reward for result in results_a} == {0.0, 1.0}
    # every event of the group's jobs, each once and in each job's order, exactly as Watch replays them
    for index in range(4):
        job_id = f"g-{index}"
        watched = [event async for event in client.watch(job_id)]
        assert [event for event in events_of(got_g) if event.job_id == job_id] == watched
    assert {event.job_id for event in events_of(got_g)} == {f"g-{index}" for index in range(4)}
    assert len(results_g) == 4
    positions = [decode_cursor(response.cursor)[1] for response in got_g]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    await finished_a.aclose()
    await everything_g.aclose()


async def test_a_backlog_comes_in_batches_each_with_the_cursor_of_its_last_event(tmp_path: Path) -> None:
    served = Served(tmp_path / "jobs.sqlite", page_size=16)
    await served.start()
    try:
        await served.run(6, prefix="b")
        assert served.server is not None
        async with grpc.aio.insecure_channel(served.server.address) as channel:  # the wire, not the client
            call = v1.RolloutServiceStub(channel).Subscribe(v1.SubscribeRequest(after_cursor=OLDEST))
            batches: list[v1.SubscribeResponse] = []
            async for response in call:
                batches.append(response)
                if sum(item.event.HasField("finished") for b in batches for item in b.events) == 6:
                    break
            call.cancel()
        assert not batches[0].events  # the start mark
        sizes = [len(response.events) for response in batches[1:]]
        assert max(sizes) == 16 and all(0 < size <= 16 for size in sizes), sizes
        assert all(response.cursor == response.events[-1].cursor for response in batches[1:])
        flat = [item for response in batches for item in response.events]
        # the client yields the same events, one by one
        one_by_one = await collect(served.client.subscribe(after_cursor=OLDEST), finished_count(6))
        assert [item for item in one_by_one if item.HasField("event")] == flat
    finally:
        await served.stop()


def test_a_response_stays_within_a_mebibyte_labels_and_all_and_a_larger_event_comes_alone() -> None:
    labels = {f"key-{index:03}": "v" * 250 for index in range(64)}  # 16 KB of labels on every event

    def entry(position: int, size: int) -> FeedEntry:
        return FeedEntry(
            position=position,
            job_id="j",
            attempt=1,
            kind="model_turn",
            status=v1.JOB_STATUS_RUNNING,
            handler="math",
            group_id="g",
            labels=labels,
            store_time=0.0,
            event=v1.RolloutEvent(
                job_id="j", seq=position, model_turn=v1.ModelTurn(text="x" * size)
            ).SerializeToString(),
        )

    sizes = [10] * 100 + [400_000, 400_000, 400_000, 3_000_000, 10, 10]
    batches = list(batches_of("store", (entry(index + 1, size) for index, size in enumerate(sizes))))
    responses = [v1.SubscribeResponse(events=batch, cursor=batch[-1].cursor) for _, batch in batches]
    for (last, batch), response in zip(batches, responses, strict=True):
        assert decode_cursor(batch[-1].cursor) == ("store", last)
        assert response.ByteSize() <= MAX_RESPONSE_BYTES or len(batch) == 1, (len(batch), response.ByteSize())
    # the small events' labels alone fill a response: they are split although each event is tiny
    assert [len(batch) for _, batch in batches][:2] == [len(batches[0][1]), 100 - len(batches[0][1])]
    assert 50 < len(batches[0][1]) < 100
    big = [
        index
        for index, (_, batch) in enumerate(batches)
        if any(len(i.event.model_turn.text) == 3_000_000 for i in batch)
    ]
    assert len(batches[big[0]][1]) == 1  # the event over the limit comes alone
    assert [item.event.seq for _, batch in batches for item in batch] == list(range(1, len(sizes) + 1))


async def test_resuming_after_a_cursor_gives_the_rest_exactly_once(served: Served) -> None:
    await served.run(5, prefix="r")
    full = await collect(served.client.subscribe(after_cursor=OLDEST), finished_count(5))
    everything = events_of(full)
    # each event takes one position: a job's whole log rewritten at its end takes none more
    positions = [decode_cursor(response.cursor)[1] for response in full if response.HasField("event")]
    assert positions == list(range(1, len(everything) + 1))
    for cut in (1, len(full) // 2, len(full) - 2):
        wanted = len(events_of(full[cut + 1 :]))
        rest = await collect(
            served.client.subscribe(after_cursor=full[cut].cursor),
            lambda seen, wanted=wanted: len(events_of(seen)) >= wanted,
        )
        assert events_of(full[: cut + 1]) + events_of(rest) == everything
    # statuses as of the event: SUCCEEDED gives finished events only (a wrong answer still succeeds, reward 0)
    succeeded = await collect(
        served.client.subscribe(after_cursor=OLDEST, statuses=[v1.JOB_STATUS_SUCCEEDED]),
        lambda seen: len(events_of(seen)) >= 5,
    )
    assert {event.WhichOneof("kind") for event in events_of(succeeded)} == {"finished"}


async def test_a_cursor_survives_a_server_restart(served: Served) -> None:
    await served.run(3, prefix="before")
    seen = await collect(served.client.subscribe(after_cursor=OLDEST, event_kinds=["finished"]), finished_count(3))
    cursor = seen[-1].cursor
    await served.stop()
    await served.start()
    await served.run(2, prefix="after")
    rest = await collect(served.client.subscribe(after_cursor=cursor, event_kinds=["finished"]), finished_count(2))
    assert sorted(event.job_id for event in events_of(rest)) == ["after-0", "after-1"]


async def test_progress_marks_let_a_consumer_of_rare_events_save_its_place(served: Served) -> None:
    stream = served.client.subscribe(handlers=["no-such-handler"])
    start = await anext(stream)
    await served.run(2, prefix="p")
    mark = await asyncio.wait_for(anext(stream), 10)
    assert not mark.HasField("event")
    assert decode_cursor(mark.cursor)[1] > decode_cursor(start.cursor)[1]
    await stream.aclose()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"event_kinds": ["finish"]}, "unknown kind"),
        ({"statuses": [v1.JOB_STATUS_UNSPECIFIED]}, "JOB_STATUS_UNSPECIFIED"),
        ({"after_cursor": "not a cursor"}, "is not a cursor"),
        ({"after_cursor": "b3RoZXI6Mw"}, "another job store"),  # "other:3"
    ],
)
async def test_bad_filters_and_cursors_are_invalid_argument(
    served: Served, fields: dict[str, Any], needle: str
) -> None:
    with pytest.raises(RpcError) as caught:
        await anext(served.client.subscribe(**fields))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in caught.value.details


async def test_a_cursor_behind_retention_is_out_of_range(served: Served) -> None:
    await served.run(2, prefix="old")
    # every event of both jobs stored (a rollout's stream may end before its last write)
    stored = await collect(served.client.subscribe(after_cursor=OLDEST), finished_count(2))
    start = stored[0]  # the start mark, before the oldest event
    assert not start.HasField("event")
    assert served.server is not None
    store = served.server._mode.store
    assert isinstance(store, SQLiteJobStore)
    await asyncio.sleep(0.05)
    assert await store.feed_trim(0.01) > 0
    with pytest.raises(RpcError) as caught:
        await anext(served.client.subscribe(after_cursor=start.cursor))
    assert caught.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert "retention" in caught.value.details and caught.value.resume_cursor == start.cursor
    # "oldest" still works: from what is kept
    assert await anext(served.client.subscribe(after_cursor=OLDEST))


async def test_without_a_job_store_subscribe_is_failed_precondition(tmp_path: Path) -> None:
    served = Served(tmp_path / "unused.sqlite")
    await served.start(store=False)
    try:
        with pytest.raises(RpcError) as caught:
            await anext(served.client.subscribe())
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "jobs.store" in caught.value.details
    finally:
        await served.stop()


PADDING = {f"pad-{index:02}": "p" * 256 for index in range(64)}
"""Labels of about 17 kB, which every FeedEvent of the job carries."""


async def test_a_consumer_that_falls_behind_gets_resource_exhausted_and_a_cursor(tmp_path: Path) -> None:
    served = Served(tmp_path / "jobs.sqlite", max_lag_events=20, page_size=8)
    await served.start()
    ended = asyncio.Event()
    jobs = 0

    async def produce() -> None:
        """Jobs until the stream ends. However much gRPC's windows and the sockets' buffers
        take (megabytes on loopback), they fill up and the server's sends start to wait; a
        fixed number of jobs may all fit, and the stream would then never end."""
        nonlocal jobs
        while not ended.is_set():
            await served.run(8, prefix=f"slow{jobs}", labels=PADDING)
            jobs += 8

    producing = asyncio.ensure_future(produce())
    try:
        stream = served.client.subscribe()
        received = [await anext(stream)]
        with pytest.raises(RpcError) as caught:
            async with asyncio.timeout(120):
                async for item in stream:
                    received.append(item)
                    await asyncio.sleep(0.05)  # a consumer far slower than the jobs' events
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_lag_events" in caught.value.details
        ended.set()
        await producing
        # the last response delivered: the last received, or the one before when the send under
        # way was given up but still reached the client (a duplicate on resuming, never a gap).
        # Responses hold at most page_size (8) events, so it is among the last 16 cursors (a
        # response's own cursor is its last event's, here).
        assert caught.value.resume_cursor in {item.cursor for item in received[-16:]}
        # resuming from the last cursor received gives the rest (a fast reader now), nothing twice
        total = await collect(served.client.subscribe(after_cursor=OLDEST), finished_count(jobs))
        rest = await collect(
            served.client.subscribe(after_cursor=received[-1].cursor),
            lambda seen: len(events_of(received)) + len(events_of(seen)) >= len(events_of(total)),
        )
        assert events_of(received) + events_of(rest) == events_of(total)
    finally:
        ended.set()
        producing.cancel()
        await asyncio.gather(producing, return_exceptions=True)
        await served.stop()


def test_the_feed_copy_of_a_gateway_event_has_no_api_key() -> None:
    event = v1.RolloutEvent(job_id="j", seq=3, gateway_opened=v1.GatewayOpened(path="/jobs/j", api_key="secret"))
    seq, kind, status, data = feed_copy(event)
    copy = v1.RolloutEvent.FromString(data)
    assert (seq, kind, status) == (3, "gateway_opened", v1.JOB_STATUS_RUNNING)
    assert copy.gateway_opened.api_key == "" and copy.gateway_opened.path == "/jobs/j"
    assert event.gateway_opened.api_key == "secret"  # the job's own log keeps it


async def test_closing_a_stream_releases_the_poller(served: Served) -> None:
    stream = served.client.subscribe()
    await anext(stream)
    assert served.server is not None and served.server._feed is not None
    feed = served.server._feed
    await assert_eventually(lambda: feed._streams == 1)
    await stream.aclose()
    await assert_eventually(lambda: feed._streams == 0 and feed._poller is None)


async def store_job(store: SQLiteJobStore, job_id: str, count: int) -> None:
    """A job with `count` events, written to the store as a server writes them."""
    await store.submitted(job_id, 1, math_request("q", job_id=job_id), b"", time.time())
    await store.appended(job_id, [v1.RolloutEvent(job_id=job_id, seq=seq) for seq in range(1, count + 1)])


class StalledContext:
    """A gRPC context whose consumer stopped reading: the first `accepted` writes go through,
    later ones never complete (the transport's window is full)."""

    def __init__(self, accepted: int) -> None:
        self.accepted = accepted
        self.written: list[v1.SubscribeResponse] = []  # the wire's messages: batches of events
        self.blocked = asyncio.Event()

    async def write(self, response: v1.SubscribeResponse) -> None:
        if len(self.written) >= self.accepted:
            self.blocked.set()
            await asyncio.Event().wait()
        self.written.append(response)


async def test_a_consumer_that_stops_reading_is_ended_once_events_pile_up(tmp_path: Path) -> None:
    store = SQLiteJobStore(tmp_path / "jobs.sqlite")
    await store.open()
    feed = Feed(store, SubscribeSettings(max_lag_events=10, poll_interval_s=0.02))
    servicer = RolloutServicer(cast(Any, None), feed)
    context = StalledContext(accepted=2)

    try:
        await store_job(store, "first", 2)
        subscription = asyncio.ensure_future(
            servicer.Subscribe(v1.SubscribeRequest(after_cursor=OLDEST), cast(Any, context))
        )
        await assert_eventually(lambda: len(context.written) == 2)  # the start mark, a batch of both events
        await store_job(store, "second", 1)
        await asyncio.wait_for(context.blocked.wait(), 10)  # the next send does not complete
        assert not subscription.done()  # little lag: a stalled consumer costs nothing, and is kept
        await store_job(store, "more", 30)
        with pytest.raises(ConsumerTooSlow) as caught:
            await asyncio.wait_for(subscription, 10)
        assert caught.value.metadata[RESUME_CURSOR_KEY] == context.written[-1].cursor  # the last delivered
        assert [[item.event.seq for item in response.events] for response in context.written] == [[], [1, 2]]
        await assert_eventually(lambda: feed._streams == 0)
    finally:
        await feed.close()
        await store.close()


class LateContext:
    """A gRPC context whose second write (the first batch) completes just when the feed's
    head next moves: in the same turn of the event loop as the verdict on it. Later writes
    take a moment, as over a wire."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.written: list[v1.SubscribeResponse] = []

    async def write(self, response: v1.SubscribeResponse) -> None:
        if len(self.written) == 1:
            await self.feed._moved.wait()
        else:
            await asyncio.sleep(0.01)
        self.written.append(response)


async def test_a_send_that_completes_as_the_lag_limit_passes_does_not_end_the_stream_later(tmp_path: Path) -> None:
    """The verdict "too slow" is on the send pending when the head moved. If that send
    completes after all, the next send is judged afresh: the stream goes on, rather than
    ending at the next send with the old verdict and a cursor older than what was delivered."""
    store = SQLiteJobStore(tmp_path / "jobs.sqlite")
    await store.open()
    feed = Feed(store, SubscribeSettings(max_lag_events=10, poll_interval_s=0.02))
    servicer = RolloutServicer(cast(Any, None), feed)
    context = LateContext(feed)

    try:
        await store_job(store, "first", 2)
        subscription = asyncio.ensure_future(
            servicer.Subscribe(v1.SubscribeRequest(after_cursor=OLDEST), cast(Any, context))
        )
        await assert_eventually(lambda: len(context.written) == 1)  # the batch waits
        await store_job(store, "more", 30)  # 30 events of lag: the verdict on it is "too slow", as it goes through
        await assert_eventually(lambda: len(context.written) == 3 or subscription.done())
        assert not subscription.done()
        assert [[item.event.seq for item in response.events] for response in context.written] == [
            [],
            [1, 2],
            list(range(1, 31)),
        ]
        subscription.cancel()
        await asyncio.gather(subscription, return_exceptions=True)
        await assert_eventually(lambda: feed._streams == 0)
    finally:
        await feed.close()
        await store.close()


class BatchesStub:
    """A RolloutService stub whose Subscribe replays given responses (the wire's batches)."""

    def __init__(self, responses: list[v1.SubscribeResponse]) -> None:
        self.responses = responses

    def Subscribe(self, request: v1.SubscribeRequest, metadata: Any = None) -> AsyncIterator[v1.SubscribeResponse]:  # noqa: N802
        async def replay() -> AsyncIterator[v1.SubscribeResponse]:
            for response in self.responses:
                yield response

        return replay()


async def test_the_client_yields_a_batch_event_by_event_then_a_mark_past_it_when_the_cursor_is_further() -> None:
    def item(cursor: str, seq: int) -> v1.FeedEvent:
        return v1.FeedEvent(cursor=cursor, event=v1.RolloutEvent(job_id="j", seq=seq))

    responses = [
        v1.SubscribeResponse(cursor="c0"),  # the start mark
        v1.SubscribeResponse(cursor="c2", events=[item("c1", 1), item("c2", 2)]),
        v1.SubscribeResponse(cursor="c9", events=[item("c3", 3)]),  # read past non-matching events up to c9
    ]
    client = Client.connect("127.0.0.1:1")
    client._rollouts = cast(Any, BatchesStub(responses))
    try:
        got = [(item.cursor, item.event.seq if item.HasField("event") else None) async for item in client.subscribe()]
    finally:
        await client.close()
    assert got == [("c0", None), ("c1", 1), ("c2", 2), ("c3", 3), ("c9", None)]


async def test_events_the_server_stores_wake_its_streams_without_waiting_for_the_poll(tmp_path: Path) -> None:
    served = Served(tmp_path / "jobs.sqlite", poll_interval_s=600)  # the poll alone would take ten minutes
    await served.start()
    try:
        stream = served.client.subscribe(event_kinds=["finished"])
        await anext(stream)  # the start mark: the stream is open and its poller has read the head
        await served.run(2, prefix="n")
        got = await collect(stream, finished_count(2), timeout_s=60)
        assert sorted(event.job_id for event in events_of(got)) == ["n-0", "n-1"]
    finally:
        await served.stop()


async def test_a_store_that_cannot_be_read_at_the_start_is_unavailable_and_follow_feed_goes_on(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served.server is not None and served.server._feed is not None
    store = served.server._feed._store
    assert store is not None
    working = store.feed_bounds
    failures = [2]

    async def flaky() -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise sqlite3.OperationalError("database is locked")
        return await working()

    monkeypatch.setattr(store, "feed_bounds", flaky)
    with pytest.raises(RpcError) as caught:
        await anext(served.client.subscribe())
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE  # not INTERNAL: a consumer retries it
    assert "cannot be read now" in caught.value.details
    # one more failure, then the store answers: follow_feed subscribes again by itself
    stream = served.client.follow_feed(backoff_s=0.01)
    start = await anext(stream)
    assert start.cursor and not start.HasField("event") and failures == [0]
    await stream.aclose()
