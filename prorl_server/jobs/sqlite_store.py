"""The SQLite job store: embedded, one file per server (`jobs.store = true`).

The request, result and events of each job in one row, the event log as
length-prefixed protobuf frames (store.pack_events). sqlite3 is synchronous:
every call runs in a single worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prorl_client import v1
from prorl_server.jobs.store import JobStore, StoredJob, pack_events, unpack_events

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
"""


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
        self, job_id: str, number: int, request: bytes, fingerprint: bytes, created: float, attempt: int
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO jobs (job_id, number, request, fingerprint, status, create_time, attempt) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (job_id, number, request, fingerprint, v1.JOB_STATUS_QUEUED, created, attempt),
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
        await self._call(self._submitted, job_id, number, request.SerializeToString(), fingerprint, created, attempt)

    def _finished(self, job_id: str, status: int, end_time: float, result: bytes, events: bytes) -> None:
        self.db.execute(
            "UPDATE jobs SET status = ?, end_time = ?, result = ?, events = ? WHERE job_id = ?",
            (status, end_time, result, events, job_id),
        )
        self.db.commit()

    async def finished(
        self, job_id: str, status: int, end_time: float, result: v1.RolloutResult, events: list[v1.RolloutEvent]
    ) -> None:
        await self._call(self._finished, job_id, status, end_time, result.SerializeToString(), pack_events(events))

    def _load(self, keep_after: float) -> list[StoredJob]:
        self.db.execute("DELETE FROM jobs WHERE end_time IS NOT NULL AND end_time < ?", (keep_after,))
        self.db.commit()
        rows = self.db.execute(
            "SELECT job_id, number, request, fingerprint, status, create_time, end_time, result, events, attempt "
            "FROM jobs ORDER BY number"
        ).fetchall()
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
                events=unpack_events(row[8]),
                attempt=row[9],
            )
            for row in rows
        ]

    async def load(self, retain_s: float) -> list[StoredJob]:
        result: list[StoredJob] = await self._call(self._load, time.time() - retain_s)
        return result
