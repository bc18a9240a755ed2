"""The SQLite job store: embedded, one file per server (`jobs.store = true`).

The request and result of each job in one row of `jobs`; its events one row
each in `job_events`, keyed by (job_id, seq): appended while the job runs,
replaced by the whole log when it ends. Stores written before `job_events`
existed kept a finished job's events in the column `jobs.events` as
length-prefixed protobuf frames (store.pack_events): still read for those jobs
(a job with rows in `job_events` is read from them), never written any more.
The event feed (store.py) is `event_feed`: each event that lands in
`job_events` is copied there in the same transaction, keyed by (job_id,
attempt, seq) so that a rewrite adds nothing; `position` is SQLite's
AUTOINCREMENT rowid, never reused. `feed_meta` holds the feed's id and the
last position trimmed.
sqlite3 is synchronous: every call runs in a single worker thread, never on the
event loop.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prorl_client import v1
from prorl_server.jobs.store import (
    FeedBounds,
    FeedEntry,
    FeedPage,
    JobStore,
    Record,
    StoredJob,
    records,
    unpack_events,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    number INTEGER NOT NULL,
    request BLOB NOT NULL,
    fingerprint BLOB NOT NULL,
    status INTEGER NOT NULL,
    create_time REAL NOT NULL,
    end_time REAL,
    result BLOB,
    events BLOB,
    attempt INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS jobs_end_time ON jobs (end_time);
CREATE TABLE IF NOT EXISTS job_events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event BLOB NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS event_feed (
    position INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    status INTEGER NOT NULL,
    handler TEXT NOT NULL,
    group_id TEXT NOT NULL,
    labels TEXT NOT NULL,
    store_time REAL NOT NULL,
    event BLOB NOT NULL,
    UNIQUE (job_id, attempt, seq)
);
CREATE INDEX IF NOT EXISTS event_feed_time ON event_feed (store_time);
CREATE INDEX IF NOT EXISTS event_feed_kind ON event_feed (kind, position);
CREATE TABLE IF NOT EXISTS feed_meta (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    store_id TEXT NOT NULL,
    trimmed INTEGER NOT NULL DEFAULT 0
);
"""
# What a subscription filters on, kept on the job's row for the feed's copies.
JOB_TAGS = {
    "handler": "TEXT NOT NULL DEFAULT ''",
    "group_id": "TEXT NOT NULL DEFAULT ''",
    "labels": "TEXT NOT NULL DEFAULT '{}'",
}

# A feed copy of an event the job's log holds now (a write the job's row refused adds nothing).
FEED = (
    "INSERT OR IGNORE INTO event_feed "
    "(job_id, attempt, seq, kind, status, handler, group_id, labels, store_time, event) "
    "SELECT j.job_id, j.attempt, e.seq, ?, ?, j.handler, j.group_id, j.labels, ?, ? "
    "FROM jobs j JOIN job_events e ON e.job_id = j.job_id WHERE j.job_id = ? AND e.seq = ? AND e.event = ? "
    # Not even tried for an event already there: an ignored insert would still use up a position.
    "AND NOT EXISTS (SELECT 1 FROM event_feed f WHERE f.job_id = j.job_id AND f.attempt = j.attempt AND f.seq = e.seq)"
)

# An event row, only for a job that has a row in `jobs`; a seq already there is kept.
APPEND = (
    "INSERT OR IGNORE INTO job_events (job_id, seq, event) "
    "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM jobs WHERE job_id = ?)"
)


class SQLiteJobStore(JobStore):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-store")
        self._db: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"SQLiteJobStore({str(self.path)!r})"

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if "attempt" not in columns:  # a store written before retries existed
            self._db.execute("ALTER TABLE jobs ADD COLUMN attempt INTEGER NOT NULL DEFAULT 1")
        for name, kind in JOB_TAGS.items():  # a store written before the feed existed
            if name not in columns:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        self._db.execute("INSERT OR IGNORE INTO feed_meta (id, store_id) VALUES (1, ?)", (uuid.uuid4().hex,))
        self._db.commit()

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "job store not opened"
        return self._db

    async def open(self) -> None:
        await self._call(self._open)

    async def close(self) -> None:
        if self._db is not None:
            await self._call(self.db.close)
            self._db = None
        self._executor.shutdown(wait=True)

    def _submitted(
        self,
        job_id: str,
        number: int,
        request: bytes,
        fingerprint: bytes,
        created: float,
        attempt: int,
        tags: tuple[str, str, str],
    ) -> None:
        self.db.execute("DELETE FROM job_events WHERE job_id = ?", (job_id,))
        self.db.execute(
            "INSERT OR REPLACE INTO jobs (job_id, number, request, fingerprint, status, create_time, attempt, "
            "handler, group_id, labels) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job_id, number, request, fingerprint, v1.JOB_STATUS_QUEUED, created, attempt, *tags),
        )
        self.db.commit()

    async def submitted(
        self,
        job_id: str,
        number: int,
        request: v1.RolloutRequest,
        fingerprint: bytes,
        created: float,
        attempt: int = 1,
    ) -> None:
        tags = (request.handler, request.group_id, json.dumps(dict(request.labels), sort_keys=True))
        await self._call(
            self._submitted, job_id, number, request.SerializeToString(), fingerprint, created, attempt, tags
        )

    def _feed(self, job_id: str, events: list[Record]) -> None:
        now = time.time()
        self.db.executemany(
            FEED,
            [(kind, status, now, copy, job_id, seq, data) for seq, data, kind, status, copy in events],
        )

    def _appended(self, job_id: str, events: list[Record]) -> None:
        try:
            self.db.executemany(APPEND, [(job_id, seq, data, job_id) for seq, data, *_ in events])
            self._feed(job_id, events)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    async def appended(self, job_id: str, events: Sequence[v1.RolloutEvent]) -> None:
        if events:
            await self._call(self._appended, job_id, records(events))

    def _finished(self, job_id: str, status: int, end_time: float, result: bytes, events: list[Record]) -> None:
        try:
            updated = self.db.execute(
                "UPDATE jobs SET status = ?, end_time = ?, result = ?, events = NULL WHERE job_id = ?",
                (status, end_time, result, job_id),
            )
            if updated.rowcount:  # never submitted: nothing to record
                self.db.execute("DELETE FROM job_events WHERE job_id = ?", (job_id,))
                self.db.executemany(
                    "INSERT INTO job_events (job_id, seq, event) VALUES (?, ?, ?)",
                    [(job_id, seq, data) for seq, data, *_ in events],
                )
                self._feed(job_id, events)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    async def finished(
        self, job_id: str, status: int, end_time: float, result: v1.RolloutResult, events: list[v1.RolloutEvent]
    ) -> None:
        await self._call(self._finished, job_id, status, end_time, result.SerializeToString(), records(events))

    def _load(self, keep_after: float) -> list[StoredJob]:
        self.db.execute(
            "DELETE FROM job_events WHERE job_id IN "
            "(SELECT job_id FROM jobs WHERE end_time IS NOT NULL AND end_time < ?)",
            (keep_after,),
        )
        self.db.execute("DELETE FROM jobs WHERE end_time IS NOT NULL AND end_time < ?", (keep_after,))
        self.db.commit()
        rows = self.db.execute(
            "SELECT job_id, number, request, fingerprint, status, create_time, end_time, result, events, attempt "
            "FROM jobs ORDER BY number"
        ).fetchall()
        logs: dict[str, list[v1.RolloutEvent]] = {}
        for job_id, data in self.db.execute("SELECT job_id, event FROM job_events ORDER BY job_id, seq"):
            logs.setdefault(job_id, []).append(v1.RolloutEvent.FromString(data))
        return [
            StoredJob(
                job_id=row[0],
                number=row[1],
                request=v1.RolloutRequest.FromString(row[2]),
                fingerprint=row[3],
                status=row[4],
                create_time=row[5],
                end_time=row[6],
                result=v1.RolloutResult.FromString(row[7]) if row[7] is not None else None,
                events=logs[row[0]] if row[0] in logs else unpack_events(row[8]),
                attempt=row[9],
            )
            for row in rows
        ]

    async def load(self, retain_s: float) -> list[StoredJob]:
        result: list[StoredJob] = await self._call(self._load, time.time() - retain_s)
        return result

    # --- the event feed ---------------------------------------------------------------

    def _feed_bounds(self) -> FeedBounds:
        store_id, trimmed = self.db.execute("SELECT store_id, trimmed FROM feed_meta WHERE id = 1").fetchone()
        (head,) = self.db.execute("SELECT COALESCE(max(position), 0) FROM event_feed").fetchone()
        # AUTOINCREMENT never reuses a position, even after every entry was trimmed.
        found = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'event_feed'").fetchone()
        return FeedBounds(store_id, max(head, found[0] if found else 0, trimmed), trimmed)

    async def feed_bounds(self) -> FeedBounds:
        bounds: FeedBounds = await self._call(self._feed_bounds)
        return bounds

    def _feed_page(self, after: int, limit: int, kinds: Sequence[str]) -> FeedPage:
        bounds = self._feed_bounds()
        where = "position > ? AND position <= ?"
        params: list[object] = [after, bounds.head]
        if kinds:
            where += f" AND kind IN ({', '.join('?' for _ in kinds)})"
            params.extend(kinds)
        rows = self.db.execute(
            "SELECT position, job_id, attempt, kind, status, handler, group_id, labels, store_time, event "
            f"FROM event_feed WHERE {where} ORDER BY position LIMIT ?",
            [*params, limit],
        ).fetchall()
        entries = [
            FeedEntry(
                position=row[0],
                job_id=row[1],
                attempt=row[2],
                kind=row[3],
                status=row[4],
                handler=row[5],
                group_id=row[6],
                labels=json.loads(row[7]),
                store_time=row[8],
                event=row[9],
            )
            for row in rows
        ]
        scanned = entries[-1].position if len(entries) == limit else max(after, bounds.head)
        return FeedPage(entries, scanned, bounds.trimmed)

    async def feed_page(self, after: int, limit: int, kinds: Sequence[str] = ()) -> FeedPage:
        page: FeedPage = await self._call(self._feed_page, after, limit, tuple(kinds))
        return page

    def _feed_trim(self, before: float) -> int:
        try:
            (last,) = self.db.execute("SELECT max(position) FROM event_feed WHERE store_time < ?", (before,)).fetchone()
            if last is None:
                return 0
            deleted = self.db.execute("DELETE FROM event_feed WHERE position <= ?", (last,)).rowcount
            self.db.execute("UPDATE feed_meta SET trimmed = max(trimmed, ?) WHERE id = 1", (last,))
            self.db.commit()
            return int(deleted)
        except BaseException:
            self.db.rollback()
            raise

    async def feed_trim(self, retain_s: float) -> int:
        deleted: int = await self._call(self._feed_trim, time.time() - retain_s)
        return deleted
