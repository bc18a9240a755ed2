"""The durable job store: what every implementation keeps, and the interface.

What it keeps: every job's request at submission, its events while it runs
(`appended`, in batches from the job manager's EventWriter, event_writer.py),
and at the end its status, result and whole event log. So after a restart
GetJob, ListJobs and Watch of finished jobs still work, Submit of a known job
id returns the stored job, and a job that was running when the server died is
reported as failed (infrastructure, "interrupted", after the events it had
stored), or run again when its retry policy allows.
Finished jobs are kept for `jobs.retain_finished_s`.

Two implementations, chosen by the setting `jobs.store` (see store_factory.py):
SQLite, embedded, one file per server (sqlite_store.py), and PostgreSQL
(postgres_store.py). Every method is async and never blocks the event loop.
"""

from __future__ import annotations

import abc
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from prorl_client import v1
from prorl_server.errors import ProrlError

if TYPE_CHECKING:  # at run time through __getattr__ below (sqlite_store imports this module)
    from prorl_server.jobs.sqlite_store import SQLiteJobStore as SQLiteJobStore

FRAME = struct.Struct(">I")


class JobStoreError(ProrlError):
    """The job store cannot be used: unreachable, refused, or a schema this server does not know."""

    reason = "job_store"


class JobNotHeld(JobStoreError):
    """A cluster's server writes a job's outcome it no longer holds (its lease lapsed and
    another server took the job over): nothing is written, and trying again cannot help."""

    reason = "job_not_held"


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


def mask_url(url: str) -> str:
    """A database URL fit for messages and logs: its password (in the user part or
    a `password=` parameter) replaced by ***."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, colon, _password = userinfo.partition(":")
            netloc = f"{user}:***@{hostport}" if colon else netloc
        query = urlencode(
            [(key, "***" if key.lower() == "password" else value) for key, value in parse_qsl(parts.query)], safe="/*"
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return f"{url.partition(':')[0]}://***"


def __getattr__(name: str) -> Any:
    """`from prorl_server.jobs.store import SQLiteJobStore` keeps working (it moved to sqlite_store.py)."""
    if name == "SQLiteJobStore":
        from prorl_server.jobs.sqlite_store import SQLiteJobStore

        return SQLiteJobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
