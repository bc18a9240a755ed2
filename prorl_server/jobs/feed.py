"""Subscribe: the events of every job that match a filter, from the store's event feed.

The feed (store.py) holds a copy of every stored event at a position that only
grows, in the order the store received it. A subscription reads it page by page
(one page in memory at a time) from a starting point, sends the events its
filter matches, in batches (one response for the matches of a page, split
when larger than MAX_RESPONSE_BYTES), then waits for the head to move and reads
on. Every response and every event in it carries a cursor: the store's id and a
position. Resuming after a cursor, on this server after a restart or on any
server sharing the store, gives each matching event exactly once, in order.

Starting points: "" (from now: the head when the call arrives), "oldest" (the
oldest event kept) or a cursor. The first message of every stream is a
progress mark at the starting point, so that a consumer can save where it
began before any event comes; later marks are sent, at most once a second,
when the stream has caught up and read past events that did not match.

Ending a stream (the cursor in the trailing metadata `prorl-resume-cursor`, the
last one sent):
- RESOURCE_EXHAUSTED (ConsumerTooSlow): the consumer has fallen behind. The lag
  of a stream is how far the head is ahead of the last event of the response it
  is sending; the stream ends when the lag exceeds the smallest lag it has had
  by more than `subscribe.max_lag_events`. A consumer reading a long backlog is
  not ended for the backlog, only for losing ground. Nothing is buffered for a subscriber but
  the page it is sending (and what gRPC's flow-control window holds), so a slow
  consumer costs the server no memory; ending it frees its share of the store.
- OUT_OF_RANGE: events after the cursor were deleted by retention
  (`subscribe.retain_s`), at the start or while the stream was behind.

One poller per server reads the feed's head while any stream is open, every
`subscribe.poll_interval_s`, and at once (at most every MIN_POLL_GAP_S) when this
server's own jobs stored events (`nudge`), and wakes the streams waiting for it.
Trimming runs at start and every tenth of the retention (at most hourly).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import time
from collections.abc import AsyncGenerator, Iterable, Iterator
from dataclasses import dataclass

import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from prorl_client import v1
from prorl_server.config import SubscribeSettings
from prorl_server.errors import ConsumerTooSlow, FailedPrecondition, InvalidArgument, OutOfRange, Unavailable
from prorl_server.jobs.store import FeedBounds, FeedEntry, JobStore

log = structlog.get_logger(__name__)

OLDEST = "oldest"
RESUME_CURSOR_KEY = "prorl-resume-cursor"
EVENT_KINDS = frozenset(field.name for field in v1.RolloutEvent.DESCRIPTOR.oneofs_by_name["kind"].fields)
PROGRESS_INTERVAL_S = 1.0
MAX_TRIM_INTERVAL_S = 3600.0
MIN_POLL_GAP_S = 0.05
MAX_RESPONSE_BYTES = 1 << 20
"""A response's encoded size stays within this (an event larger than it comes alone), far
below the 4 MiB that gRPC clients accept by default; a page (subscribe.page_size events)
bounds the number of its events."""
FRAMING_BYTES = 8
"""A field's tag and length prefix, at most (for the sizes counted here)."""


def encode_cursor(store_id: str, position: int) -> str:
    return base64.urlsafe_b64encode(f"{store_id}:{position}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, int]:
    """(store id, position); InvalidArgument for anything a server did not make."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        store_id, _, position = raw.rpartition(":")
        found = int(position)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        found, store_id = -1, ""
    if not store_id or found < 0:
        raise InvalidArgument(
            f"after_cursor {cursor[:64]!r} is not a cursor: pass the `cursor` of a SubscribeResponse or FeedEvent, "
            f'"" (from now) or "{OLDEST}"'
        )
    return store_id, found


@dataclass(frozen=True)
class Filter:
    """A validated EventFilter."""

    handlers: frozenset[str]
    group_ids: frozenset[str]
    labels: dict[str, str]
    statuses: frozenset[int]
    kinds: tuple[str, ...]

    @classmethod
    def of(cls, message: v1.EventFilter) -> Filter:
        unknown = sorted(set(message.event_kinds) - EVENT_KINDS)
        if unknown:
            raise InvalidArgument(
                f"filter.event_kinds: unknown kind(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(EVENT_KINDS))}"
            )
        statuses = set(message.statuses)
        if v1.JOB_STATUS_UNSPECIFIED in statuses:
            raise InvalidArgument("filter.statuses: JOB_STATUS_UNSPECIFIED is not a status; leave it out")
        return cls(
            handlers=frozenset(message.handlers),
            group_ids=frozenset(message.group_ids),
            labels=dict(message.labels),
            statuses=frozenset(statuses),
            kinds=tuple(sorted(set(message.event_kinds))),
        )

    def matches(self, entry: FeedEntry) -> bool:
        return (
            (not self.handlers or entry.handler in self.handlers)
            and (not self.group_ids or entry.group_id in self.group_ids)
            and all(entry.labels.get(key) == value for key, value in self.labels.items())
            and (not self.statuses or entry.status in self.statuses)
            and (not self.kinds or entry.kind in self.kinds)
        )


class Feed:
    """The subscriptions of one server, over its job store."""

    def __init__(self, store: JobStore | None, settings: SubscribeSettings) -> None:
        self._store = store
        self._settings = settings
        self._head = 0
        self._moved = asyncio.Event()
        self._nudged = asyncio.Event()
        self._streams = 0
        self._poller: asyncio.Task[None] | None = None
        self._trimmer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._store is not None and self._trimmer is None:
            self._trimmer = asyncio.create_task(self._trim_forever(), name="feed-trim")

    async def close(self) -> None:
        for task in (self._poller, self._trimmer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._poller = self._trimmer = None

    # --- the head ------------------------------------------------------------------------

    def nudge(self) -> None:
        """This server stored events: read the head now rather than at the next poll (events
        other servers store are seen at the poll)."""
        self._nudged.set()

    async def _poll(self) -> None:
        assert self._store is not None
        while self._streams > 0:
            self._nudged.clear()
            try:
                head = (await self._store.feed_bounds()).head
            except Exception as exc:  # the store is down: streams wait, the poller goes on
                log.warning("feed_poll_failed", error=str(exc))
            else:
                if head != self._head:
                    self._head = head
                    self._moved.set()
                    self._moved = asyncio.Event()
            await asyncio.sleep(MIN_POLL_GAP_S)  # nudges in a burst: one read
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(self._settings.poll_interval_s - MIN_POLL_GAP_S, 0.0)):
                    await self._nudged.wait()
        self._poller = None

    def _open_stream(self, head: int) -> None:
        self._streams += 1
        self._head = max(self._head, head)
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll(), name="feed-poll")

    async def _beyond(self, position: int) -> None:
        while self._head <= position:
            await self._moved.wait()

    async def _trim_forever(self) -> None:
        assert self._store is not None
        interval = min(self._settings.retain_s / 10, MAX_TRIM_INTERVAL_S)
        while True:
            try:
                deleted = await self._store.feed_trim(self._settings.retain_s)
                if deleted:
                    log.info("feed_trimmed", deleted=deleted)
            except Exception as exc:
                log.warning("feed_trim_failed", error=str(exc))
            await asyncio.sleep(interval)

    # --- subscriptions -------------------------------------------------------------------

    def _start(self, after_cursor: str, bounds: FeedBounds) -> int:
        if after_cursor == "":
            return bounds.head
        if after_cursor == OLDEST:
            return bounds.trimmed
        store_id, position = decode_cursor(after_cursor)
        if store_id != bounds.store_id:
            raise InvalidArgument(
                "after_cursor was made by another job store (a server with its own store, or a store "
                'created since): start again with "" (from now) or "oldest"'
            )
        if position > bounds.head:
            raise InvalidArgument(f"after_cursor is ahead of the feed (position {position} > {bounds.head})")
        if position < bounds.trimmed:
            raise self._expired(bounds.store_id, position, bounds.trimmed)
        return position

    def _expired(self, store_id: str, position: int, trimmed: int) -> OutOfRange:
        return OutOfRange(
            f"events after this cursor were deleted by retention (subscribe.retain_s = "
            f'{self._settings.retain_s:g} s; {trimmed - position} of them); resume from "{OLDEST}" '
            "and accept the gap, or from now",
            reason="cursor_expired",
            metadata={RESUME_CURSOR_KEY: encode_cursor(store_id, position)},
        )

    async def subscribe(self, message: v1.EventFilter, after_cursor: str) -> Subscription:
        """One Subscribe call's subscription, checked (bad filters and cursors raise here,
        before anything is sent); `close()` it when the stream ends."""
        if self._store is None:
            raise FailedPrecondition(
                "this server keeps no job store (setting jobs.store = false), so it has no event feed to "
                "subscribe to; give it a store",
                reason="no_job_store",
            )
        wanted = Filter.of(message)
        try:
            bounds = await self._store.feed_bounds()
        except Exception as exc:
            log.warning("feed_read_failed", error=str(exc))
            raise Unavailable(
                f"the job store cannot be read now ({type(exc).__name__}); subscribe again shortly, from your "
                "last cursor"
            ) from None
        start = self._start(after_cursor, bounds)
        self._open_stream(bounds.head)
        return Subscription(self, self._store, wanted, bounds.store_id, start)

    def _close_stream(self) -> None:
        self._streams -= 1


class Subscription:
    """The state of one stream: what it has read, sent and is sending.

    The caller sends each response of `responses()` and calls `delivered()` once
    the transport took it; while a send is pending, `overrun()` resolves when the
    consumer has lost too much ground (so that a consumer that stopped reading is
    ended too, not only one that reads slowly)."""

    def __init__(self, feed: Feed, store: JobStore, wanted: Filter, store_id: str, start: int) -> None:
        self._feed = feed
        self._store = store
        self._wanted = wanted
        self._store_id = store_id
        self._settings = feed._settings
        self._sent = start
        """The position of the last response delivered: where a resumed stream goes on."""
        self._sending: int | None = None
        self._least_lag: int | None = None
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._feed._close_stream()

    def cursor(self) -> str:
        return encode_cursor(self._store_id, self._sent)

    def delivered(self) -> None:
        if self._sending is not None:
            self._sent, self._sending = self._sending, None

    def _lost_ground(self, position: int) -> int:
        lag = max(self._feed._head - position, 0)
        self._least_lag = lag if self._least_lag is None else min(self._least_lag, lag)
        return lag - self._least_lag

    def too_slow(self, lost: int) -> ConsumerTooSlow:
        return ConsumerTooSlow(
            f"this subscriber fell {lost} events further behind the feed than it was "
            f"(subscribe.max_lag_events = {self._settings.max_lag_events}); resume from the cursor of the last "
            f"event you processed (or the trailing metadata `{RESUME_CURSOR_KEY}`, the last response delivered), "
            "with a faster consumer or a narrower filter",
            metadata={RESUME_CURSOR_KEY: self.cursor()},
        )

    async def overrun(self) -> int:
        """Resolves, with the ground lost, once a pending send has lost more than
        max_lag_events of ground; never while nothing is pending. The verdict is on the send
        pending then: if that send completes after all, the caller judges the next afresh."""
        while True:
            await self._feed._moved.wait()
            if self._sending is not None:
                lost = self._lost_ground(self._sending)
                if lost > self._settings.max_lag_events:
                    return lost

    async def responses(self) -> AsyncGenerator[v1.SubscribeResponse, None]:
        """Progress mark at the start, then batches of matching events and later marks
        (module docstring)."""
        settings, store_id = self._settings, self._store_id
        scanned = self._sent
        self._sending = scanned
        yield v1.SubscribeResponse(cursor=encode_cursor(store_id, scanned))
        last_message = time.monotonic()
        while True:
            try:
                page = await self._store.feed_page(scanned, settings.page_size, self._wanted.kinds)
            except Exception as exc:
                log.warning("feed_read_failed", error=str(exc))
                raise Unavailable(
                    f"the job store cannot be read now ({type(exc).__name__}); resume from the cursor of the last "
                    f"event you processed (or the trailing metadata `{RESUME_CURSOR_KEY}`)",
                    metadata={RESUME_CURSOR_KEY: self.cursor()},
                ) from None
            if page.trimmed > scanned:
                raise self._feed._expired(store_id, self._sent, page.trimmed)
            for last, batch in batches_of(store_id, (e for e in page.entries if self._wanted.matches(e))):
                lost = self._lost_ground(last)
                if lost > settings.max_lag_events:
                    raise self.too_slow(lost)
                self._sending = last
                yield v1.SubscribeResponse(events=batch, cursor=encode_cursor(store_id, last))
                last_message = time.monotonic()
            scanned = page.scanned
            if len(page.entries) == settings.page_size:
                continue  # more to read now
            if scanned > self._sent:
                wait = PROGRESS_INTERVAL_S - (time.monotonic() - last_message)
                if wait <= 0:
                    self._sending = scanned
                    yield v1.SubscribeResponse(cursor=encode_cursor(store_id, scanned))
                    last_message = time.monotonic()
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._feed._beyond(scanned), wait)
                    continue
            await self._feed._beyond(scanned)


def batches_of(store_id: str, entries: Iterable[FeedEntry]) -> Iterator[tuple[int, list[v1.FeedEvent]]]:
    """The entries as FeedEvents in runs of one response each, with the position of each
    run's last entry: a run's encoded size (cursor, labels and all) stays within
    MAX_RESPONSE_BYTES; an event larger than that comes alone."""
    batch: list[v1.FeedEvent] = []
    size = last = 0
    for entry in entries:
        item = _feed_event(store_id, entry)
        item_size = item.ByteSize() + FRAMING_BYTES
        if batch and size + item_size > MAX_RESPONSE_BYTES:
            yield last, batch
            batch, size = [], 0
        if not batch:
            size = FRAMING_BYTES + len(item.cursor)  # the response's own cursor
        batch.append(item)
        size += item_size
        last = entry.position
    if batch:
        yield last, batch


def _feed_event(store_id: str, entry: FeedEntry) -> v1.FeedEvent:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(entry.store_time * 1e9))
    return v1.FeedEvent(
        cursor=encode_cursor(store_id, entry.position),
        event=v1.RolloutEvent.FromString(entry.event),
        attempt=entry.attempt,
        store_time=stamp,
        handler=entry.handler,
        group_id=entry.group_id,
        labels=entry.labels,
    )
