"""The durable job store: what every implementation keeps, and the interface.

What it keeps: every job's request at submission, its events while it runs
(`appended`, in batches from the job manager's EventWriter, event_writer.py),
and at the end its status, result and whole event log. So after a restart
GetJob, ListJobs and Watch of finished jobs still work, Submit of a known job
id returns the stored job, and a job that was running when the server died is
reported as failed (infrastructure, "interrupted", after the events it had
stored), or run again when its retry policy allows.
Finished jobs are kept for `jobs.retain_finished_s`.

The event feed (Subscribe): every event written to a job's log is also added,
once, to one store-wide feed in the order the store received it, each at a
`position` that only grows (a copy of the event: later rewrites of the job's
log, a re-run or the job's deletion do not take it out). A gateway's API key
is left out of the copy: a consumer of the feed is not the job's owner.
Entries older than `subscribe.retain_s` are trimmed; the store remembers the
last position trimmed, so that a cursor behind it is known to have lost events.

Two implementations, chosen by the setting `jobs.store` (see prorl_server/modes/):
SQLite, embedded, one file per server (sqlite_store.py), and PostgreSQL
(postgres_store.py). Every method is async and never blocks the event loop.
"""

from __future__ import annotations

import abc
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prorl_client import v1
from prorl_server.errors import ProrlError

FRAME = struct.Struct(">I")


class JobStoreError(ProrlError):
    """The job store cannot be used: unreachable, refused, or a schema this server does not know."""

    reason = "job_store"


class JobNotHeld(JobStoreError):
    """A cluster's server writes a job's outcome it no longer holds (its lease lapsed and
    another server took the job over): nothing is written, and trying again cannot help."""

    reason = "job_not_held"


@dataclass(frozen=True)
class FeedEntry:
    """One event of the feed, with what a subscription filters on."""

    position: int
    job_id: str
    attempt: int
    kind: str
    status: int
    """The job's status as of the event (see status_as_of)."""
    handler: str
    group_id: str
    labels: dict[str, str]
    store_time: float
    event: bytes


@dataclass(frozen=True)
class FeedBounds:
    store_id: str
    """Random, made when the feed was created: a cursor of another store is refused."""
    head: int
    """The last position written (0: none yet)."""
    trimmed: int
    """The last position deleted by retention (0: none)."""


@dataclass(frozen=True)
class FeedPage:
    entries: list[FeedEntry]
    scanned: int
    """Every position up to here was read: the entries are all those after `after` up to it
    (among the kinds asked for)."""
    trimmed: int


@dataclass(frozen=True)
class StoredJob:
    job_id: str
    number: int
    request: v1.RolloutRequest
    fingerprint: bytes
    status: int
    create_time: float
    end_time: float | None
    result: v1.RolloutResult | None
    events: list[v1.RolloutEvent]
    attempt: int = 1


class JobStore(abc.ABC):
    """Where jobs survive a restart. `open` before any other call, `close` at the end."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect (create or migrate the schema); raises JobStoreError saying why not."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def submitted(
        self,
        job_id: str,
        number: int,
        request: v1.RolloutRequest,
        fingerprint: bytes,
        created: float,
        attempt: int = 1,
    ) -> None:
        """A job was admitted (or started again: `attempt` counts its runs). Idempotent:
        the job's row is (re)written as queued, without result or events."""

    @abc.abstractmethod
    async def appended(self, job_id: str, events: Sequence[v1.RolloutEvent]) -> None:
        """Events of a running job, as they happen. Idempotent by (job_id, seq): an event
        written twice is kept once. A job never submitted (or whose row is gone): no-op.
        `load` returns them in seq order; `finished` later replaces them with the whole log."""

    @abc.abstractmethod
    async def finished(
        self, job_id: str, status: int, end_time: float, result: v1.RolloutResult, events: list[v1.RolloutEvent]
    ) -> None:
        """A job ended: its status, result and whole event log, replacing the events
        appended before (a job never submitted: no-op)."""

    @abc.abstractmethod
    async def load(self, retain_s: float) -> list[StoredJob]:
        """Every job kept, oldest (lowest number) first; finished jobs older than `retain_s`
        are deleted first."""

    @abc.abstractmethod
    async def feed_bounds(self) -> FeedBounds:
        """The feed's identity, head and trimmed positions."""

    @abc.abstractmethod
    async def feed_page(self, after: int, limit: int, kinds: Sequence[str] = ()) -> FeedPage:
        """Up to `limit` entries after position `after`, in order (only `kinds`, if given)."""

    @abc.abstractmethod
    async def feed_trim(self, retain_s: float) -> int:
        """Delete the entries stored more than `retain_s` ago; returns how many."""


def event_kind(event: v1.RolloutEvent) -> str:
    return event.WhichOneof("kind") or ""


def status_as_of(event: v1.RolloutEvent) -> int:
    """QUEUED for `queued`, the final status for `finished`, RUNNING otherwise."""
    kind = event_kind(event)
    if kind == "queued":
        return v1.JOB_STATUS_QUEUED
    if kind == "finished":
        return int(event.finished.result.status)
    return v1.JOB_STATUS_RUNNING


def feed_copy(event: v1.RolloutEvent) -> tuple[int, str, int, bytes]:
    """(seq, kind, status, bytes) of an event as the feed keeps it (no gateway API key)."""
    if event_kind(event) == "gateway_opened" and event.gateway_opened.api_key:
        event = v1.RolloutEvent.FromString(event.SerializeToString())
        event.gateway_opened.api_key = ""
    return event.seq, event_kind(event), status_as_of(event), event.SerializeToString()


Record = tuple[int, bytes, str, int, bytes]
"""An event to write: seq, bytes, then its feed copy's kind, status and bytes."""


def records(events: Iterable[v1.RolloutEvent]) -> list[Record]:
    out: list[Record] = []
    for event in events:
        seq, kind, status, copy = feed_copy(event)
        out.append((seq, event.SerializeToString(), kind, status, copy))
    return out


def pack_events(events: Iterable[v1.RolloutEvent]) -> bytes:
    chunks = []
    for event in events:
        data = event.SerializeToString()
        chunks.append(FRAME.pack(len(data)) + data)
    return b"".join(chunks)


def unpack_events(blob: bytes | None) -> list[v1.RolloutEvent]:
    events, offset = [], 0
    while blob and offset < len(blob):
        (size,) = FRAME.unpack_from(blob, offset)
        offset += FRAME.size
        events.append(v1.RolloutEvent.FromString(blob[offset : offset + size]))
        offset += size
    return events
