"""The job store opens stores written by earlier versions of its schema."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from prorl_client import v1
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from prorl_server.jobs.store import pack_events

SCHEMA_BEFORE_RETRIES = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, number INTEGER NOT NULL, request BLOB NOT NULL, fingerprint BLOB NOT NULL,
    status INTEGER NOT NULL, create_time REAL NOT NULL, end_time REAL, result BLOB, events BLOB
);
"""


async def test_a_store_from_before_retries_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    request = v1.RolloutRequest(job_id="old-1", handler="math")
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_BEFORE_RETRIES)
        db.execute(
            "INSERT INTO jobs (job_id, number, request, fingerprint, status, create_time) VALUES (?, ?, ?, ?, ?, ?)",
            ("old-1", 1, request.SerializeToString(), b"f", v1.JOB_STATUS_RUNNING, time.time()),
        )
    db.close()

    store = SQLiteJobStore(path)
    await store.open()
    try:
        (old,) = await store.load(retain_s=3600)
        assert old.job_id == "old-1" and old.attempt == 1 and old.result is None
        await store.submitted("old-1", 1, request, b"f", old.create_time, attempt=2)
        (again,) = await store.load(retain_s=3600)
        assert again.attempt == 2
    finally:
        await store.close()


async def test_events_stored_as_one_blob_are_still_read(tmp_path: Path) -> None:
    """Before `job_events`, a finished job's events were one column of length-prefixed frames."""
    path = tmp_path / "blob.sqlite"
    request = v1.RolloutRequest(job_id="old-2", handler="math")
    result = v1.RolloutResult(job_id="old-2", status=v1.JOB_STATUS_SUCCEEDED, reward=1.0)
    events = [
        v1.RolloutEvent(job_id="old-2", seq=1, queued=v1.JobQueued()),
        v1.RolloutEvent(job_id="old-2", seq=2, finished=v1.JobFinished(result=result)),
    ]
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_BEFORE_RETRIES)
        db.execute(
            "INSERT INTO jobs (job_id, number, request, fingerprint, status, create_time, end_time, result, events) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                "old-2",
                1,
                request.SerializeToString(),
                b"f",
                v1.JOB_STATUS_SUCCEEDED,
                time.time(),
                time.time(),
                result.SerializeToString(),
                pack_events(events),
            ),
        )
    db.close()

    store = SQLiteJobStore(path)
    await store.open()
    try:
        (old,) = await store.load(retain_s=3600)
        assert old.events == events and old.result == result
        await store.finished("old-2", v1.JOB_STATUS_SUCCEEDED, time.time(), result, events[:1])
        (rewritten,) = await store.load(retain_s=3600)
        assert rewritten.events == events[:1]  # from job_events now, the blob cleared
    finally:
        await store.close()
