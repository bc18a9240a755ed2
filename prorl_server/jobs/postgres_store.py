"""The PostgreSQL job store (`jobs.store = "postgresql://..."`), on asyncpg.

Schema (see MIGRATIONS; times are Unix seconds, as time.time() gives them):

    jobs        one row per job: job_id (primary key), number, request,
                fingerprint, status, create_time, end_time (NULL until it
                ended), result (NULL until it ended), attempt, server_id (the
                server that holds or last held the job) and lease_expires
                (Unix seconds by the database's clock; see cluster/store.py).
                Migration 2 adds what a cluster of servers needs: priority,
                group_id, labels (JSONB), phase, start_time, cancel_reason, a
                job_numbers sequence, and the tables servers, admin_ops and
                cluster_state (see prorl_server/cluster/).
    job_events  a job's event log, one row per event keyed by (job_id, seq),
                so that another server can read a job's events in order or
                from a given seq: appended while the job runs (`appended`),
                replaced by the whole log when it ends; deleted with their job.
    event_feed  the event feed (store.py), migration 3: each event that lands in
                job_events is copied here in the same transaction (`feed`),
                keyed by (job_id, attempt, seq) so that a rewrite adds nothing.
                Its `position` is a BIGSERIAL; every transaction that adds to
                the feed first takes a transaction-level advisory lock, so
                positions are committed in order across servers and a reader
                that sees position p has seen everything before it.
                feed_meta: the feed's id and the last position trimmed.
    schema_migrations  the migrations applied: version, applied_at, description.

Migrations are ordered SQL steps applied by `open()` in one transaction that
first takes a transaction-level advisory lock: servers starting together
apply each one exactly once, the others wait and find them done. A database
whose schema is newer than this code knows is refused.

This class is the store of one server; servers that share a database are a
cluster and use its subclass ClusterStore (prorl_server/cluster/store.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from prorl_client import v1
from prorl_server.config import mask_url, url_password
from prorl_server.jobs.store import (
    FeedBounds,
    FeedEntry,
    FeedPage,
    JobStore,
    JobStoreError,
    Record,
    StoredJob,
    records,
)

# pg_advisory_xact_lock key of the schema migrations: "prorljob" in ASCII.
SCHEMA_LOCK_KEY = 0x70726F726C6A6F62
# ... and of the writes to the event feed: "prorlfed".
FEED_LOCK_KEY = 0x70726F726C666564
DB_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"
CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    sql: str


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "jobs and their events",
        """
        CREATE TABLE jobs (
            job_id TEXT PRIMARY KEY,
            number BIGINT NOT NULL,
            request BYTEA NOT NULL,
            fingerprint BYTEA NOT NULL,
            status INTEGER NOT NULL,
            create_time DOUBLE PRECISION NOT NULL,
            end_time DOUBLE PRECISION,
            result BYTEA,
            attempt INTEGER NOT NULL DEFAULT 1,
            server_id TEXT,
            lease_expires DOUBLE PRECISION
        );
        CREATE INDEX jobs_number ON jobs (number);
        CREATE INDEX jobs_end_time ON jobs (end_time) WHERE end_time IS NOT NULL;
        CREATE TABLE job_events (
            job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
            seq BIGINT NOT NULL,
            event BYTEA NOT NULL,
            PRIMARY KEY (job_id, seq)
        );
        """,
    ),
    Migration(
        2,
        "a cluster of servers: the job queue, leases, cancels, servers, admin operations",
        """
        ALTER TABLE jobs
            ADD COLUMN priority INTEGER NOT NULL DEFAULT 0,
            ADD COLUMN group_id TEXT NOT NULL DEFAULT '',
            ADD COLUMN labels JSONB NOT NULL DEFAULT '{}',
            ADD COLUMN phase INTEGER NOT NULL DEFAULT 0,
            ADD COLUMN start_time DOUBLE PRECISION,
            ADD COLUMN cancel_reason TEXT;
        CREATE SEQUENCE job_numbers;
        SELECT setval('job_numbers', COALESCE((SELECT max(number) FROM jobs), 0) + 1, false);
        CREATE INDEX jobs_queue ON jobs (priority DESC, number) WHERE server_id IS NULL AND end_time IS NULL;
        CREATE INDEX jobs_leases ON jobs (server_id, lease_expires) WHERE end_time IS NULL;
        CREATE TABLE servers (
            server_id TEXT PRIMARY KEY,
            address TEXT NOT NULL DEFAULT '',
            runs_jobs BOOLEAN NOT NULL DEFAULT true,
            started DOUBLE PRECISION NOT NULL,
            heartbeat DOUBLE PRECISION NOT NULL,
            admin_applied BIGINT NOT NULL DEFAULT 0,
            summary BYTEA
        );
        CREATE TABLE admin_ops (
            id BIGSERIAL PRIMARY KEY,
            time DOUBLE PRECISION NOT NULL,
            kind TEXT NOT NULL,
            payload BYTEA NOT NULL
        );
        CREATE TABLE cluster_state (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            policy_version BIGINT NOT NULL DEFAULT 0
        );
        INSERT INTO cluster_state (id) VALUES (1);
        """,
    ),
    Migration(
        3,
        "the event feed (Subscribe)",
        """
        ALTER TABLE jobs ADD COLUMN handler TEXT NOT NULL DEFAULT '';
        CREATE TABLE event_feed (
            position BIGSERIAL PRIMARY KEY,
            job_id TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            seq BIGINT NOT NULL,
            kind TEXT NOT NULL,
            status INTEGER NOT NULL,
            handler TEXT NOT NULL,
            group_id TEXT NOT NULL,
            labels JSONB NOT NULL,
            store_time DOUBLE PRECISION NOT NULL,
            event BYTEA NOT NULL,
            UNIQUE (job_id, attempt, seq)
        );
        CREATE INDEX event_feed_time ON event_feed (store_time);
        CREATE INDEX event_feed_kind ON event_feed (kind, position);
        CREATE TABLE feed_meta (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            store_id TEXT NOT NULL,
            trimmed BIGINT NOT NULL DEFAULT 0
        );
        INSERT INTO feed_meta (id, store_id) VALUES (1, md5(random()::text || clock_timestamp()::text));
        """,
    ),
    Migration(
        4,
        "hand-backs: runs of a job that a stopping server gave back (not counted as restarts)",
        """
        ALTER TABLE jobs ADD COLUMN handbacks INTEGER NOT NULL DEFAULT 0;
        """,
    ),
)

SCHEMA_MIGRATIONS = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    description TEXT NOT NULL DEFAULT ''
)
"""

SUBMITTED = """
WITH dropped AS (DELETE FROM job_events WHERE job_id = $1)
INSERT INTO jobs (job_id, number, request, fingerprint, status, create_time, attempt, server_id,
    handler, group_id, labels)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb)
ON CONFLICT (job_id) DO UPDATE SET
    number = EXCLUDED.number, request = EXCLUDED.request, fingerprint = EXCLUDED.fingerprint,
    status = EXCLUDED.status, create_time = EXCLUDED.create_time, attempt = EXCLUDED.attempt,
    server_id = EXCLUDED.server_id, end_time = NULL, result = NULL, lease_expires = NULL,
    handler = EXCLUDED.handler, group_id = EXCLUDED.group_id, labels = EXCLUDED.labels
"""

# Events of a running job: only for a job that has a row (a job never submitted, or
# deleted since: nothing), a seq already there is kept (idempotent).
APPENDED = """
INSERT INTO job_events (job_id, seq, event)
SELECT $1, $2, $3 WHERE EXISTS (SELECT 1 FROM jobs WHERE job_id = $1)
ON CONFLICT (job_id, seq) DO NOTHING
"""

# The feed copies of events the job's log holds now (a write the job's row refused adds nothing).
FEED = f"""
INSERT INTO event_feed (job_id, attempt, seq, kind, status, handler, group_id, labels, store_time, event)
SELECT j.job_id, j.attempt, r.seq, r.kind, r.status, j.handler, j.group_id, j.labels, {DB_NOW}, r.copy
FROM jobs j
CROSS JOIN unnest($2::bigint[], $3::text[], $4::int[], $5::bytea[], $6::bytea[]) AS r(seq, kind, status, copy, event)
JOIN job_events e ON e.job_id = j.job_id AND e.seq = r.seq AND e.event = r.event
WHERE j.job_id = $1 AND ($7::text IS NULL OR (j.server_id = $7 AND j.attempt = $8 AND j.end_time IS NULL))
    -- not even tried for an event already there: a skipped insert still takes a sequence value
    AND NOT EXISTS (SELECT 1 FROM event_feed f WHERE f.job_id = j.job_id AND f.attempt = j.attempt AND f.seq = r.seq)
ORDER BY r.seq
ON CONFLICT (job_id, attempt, seq) DO NOTHING
"""


async def feed(conn: Any, job_id: str, events: Sequence[Record], *, held: tuple[str, int] | None = None) -> None:
    """Copy `events` of the job into the event feed, inside the caller's transaction
    (with `held`, (server id, attempt), only while that server holds that run of the job)."""
    if not events:
        return
    await conn.execute("SELECT pg_advisory_xact_lock($1)", FEED_LOCK_KEY)
    await conn.execute(
        FEED,
        job_id,
        [seq for seq, *_ in events],
        [kind for _, _, kind, _, _ in events],
        [status for *_, status, _ in events],
        [copy for *_, copy in events],
        [data for _, data, *_ in events],
        held[0] if held else None,
        held[1] if held else None,
    )


class PostgresJobStore(JobStore):
    """`url`: postgresql://user:password@host:port/database (a Unix socket folder as
    `?host=/path`); `server_id` is recorded on the jobs this server runs."""

    def __init__(
        self,
        url: str,
        *,
        server_id: str = "",
        max_connections: int = 8,
        migrations: Sequence[Migration] = MIGRATIONS,
    ) -> None:
        self.url = url
        self.server_id = server_id
        self._max_connections = max_connections
        self._migrations = sorted(migrations, key=lambda m: m.version)
        self._pool: asyncpg.Pool | None = None

    def __repr__(self) -> str:
        return f"PostgresJobStore({mask_url(self.url)!r})"

    @property
    def pool(self) -> asyncpg.Pool:
        assert self._pool is not None, "job store not opened"
        return self._pool

    # --- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        try:
            self._pool = await asyncpg.create_pool(
                dsn=self.url,
                min_size=1,
                max_size=self._max_connections,
                timeout=CONNECT_TIMEOUT_S,
                command_timeout=COMMAND_TIMEOUT_S,
                server_settings={"application_name": f"prorl-server {self.server_id}".strip()[:63]},
            )
        except Exception as exc:
            raise JobStoreError(f"{self._name()}: cannot connect: {self._reason(exc)}") from None
        try:
            await self.migrate()
        except JobStoreError:
            await self.close()
            raise
        except Exception as exc:
            await self.close()
            raise JobStoreError(f"{self._name()}: cannot apply the schema migrations: {self._reason(exc)}") from None

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        try:
            await asyncio.wait_for(pool.close(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            pool.terminate()

    async def migrate(self) -> list[int]:
        """Apply the migrations this database lacks, once even with several servers
        starting together; returns the versions applied now."""
        known = self._migrations[-1].version if self._migrations else 0
        applied_now: list[int] = []
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK_KEY)
            await conn.execute(SCHEMA_MIGRATIONS)
            applied = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
            newest = max(applied, default=0)
            if newest > known:
                raise JobStoreError(
                    f"{self._name()}: its schema is at version {newest}, newer than this server knows ({known}); "
                    "a newer prorl-server wrote it: upgrade this server, or give it a database of its own"
                )
            for migration in self._migrations:
                if migration.version in applied:
                    continue
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, description) VALUES ($1, $2)",
                    migration.version,
                    migration.description,
                )
                applied_now.append(migration.version)
        return applied_now

    # --- the store -----------------------------------------------------------------

    async def submitted(
        self,
        job_id: str,
        number: int,
        request: v1.RolloutRequest,
        fingerprint: bytes,
        created: float,
        attempt: int = 1,
    ) -> None:
        await self.pool.execute(
            SUBMITTED,
            job_id,
            number,
            request.SerializeToString(),
            fingerprint,
            v1.JOB_STATUS_QUEUED,
            created,
            attempt,
            self.server_id or None,
            request.handler,
            request.group_id,
            json.dumps(dict(request.labels)),
        )

    async def appended(self, job_id: str, events: Sequence[v1.RolloutEvent]) -> None:
        if not events:
            return
        written = records(events)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.executemany(APPENDED, [(job_id, seq, data) for seq, data, *_ in written])
            await feed(conn, job_id, written)

    async def finished(
        self, job_id: str, status: int, end_time: float, result: v1.RolloutResult, events: list[v1.RolloutEvent]
    ) -> None:
        written = records(events)
        async with self.pool.acquire() as conn, conn.transaction():
            updated = await conn.execute(
                "UPDATE jobs SET status = $2, end_time = $3, result = $4 WHERE job_id = $1",
                job_id,
                status,
                end_time,
                result.SerializeToString(),
            )
            if updated == "UPDATE 0":  # never submitted (as with SQLite: nothing to record)
                return
            await replace_events(conn, job_id, written)

    async def load(self, retain_s: float) -> list[StoredJob]:
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM jobs WHERE end_time < $1", time.time() - retain_s)
            jobs = await conn.fetch(
                "SELECT job_id, number, request, fingerprint, status, create_time, end_time, result, attempt "
                "FROM jobs ORDER BY number"
            )
            events = await conn.fetch("SELECT job_id, event FROM job_events ORDER BY job_id, seq")
        # Parsing every request, result and event is CPU work: off the event loop.
        return await asyncio.to_thread(_decode, jobs, events)

    # --- the event feed -------------------------------------------------------------------

    async def feed_bounds(self) -> FeedBounds:
        async with self.pool.acquire() as conn:
            return await _feed_bounds(conn)

    async def feed_page(self, after: int, limit: int, kinds: Sequence[str] = ()) -> FeedPage:
        async with self.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            bounds = await _feed_bounds(conn)
            rows = await conn.fetch(
                "SELECT position, job_id, attempt, kind, status, handler, group_id, labels, store_time, event "
                "FROM event_feed WHERE position > $1 AND position <= $2 "
                "AND (cardinality($3::text[]) = 0 OR kind = ANY($3::text[])) ORDER BY position LIMIT $4",
                after,
                bounds.head,
                list(kinds),
                limit,
            )
        entries = [
            FeedEntry(
                position=row["position"],
                job_id=row["job_id"],
                attempt=row["attempt"],
                kind=row["kind"],
                status=row["status"],
                handler=row["handler"],
                group_id=row["group_id"],
                labels=json.loads(row["labels"]),
                store_time=row["store_time"],
                event=row["event"],
            )
            for row in rows
        ]
        scanned = entries[-1].position if len(entries) == limit else max(after, bounds.head)
        return FeedPage(entries, scanned, bounds.trimmed)

    async def feed_trim(self, retain_s: float) -> int:
        async with self.pool.acquire() as conn, conn.transaction():
            last = await conn.fetchval(
                f"SELECT max(position) FROM event_feed WHERE store_time < {DB_NOW} - $1", retain_s
            )
            if last is None:
                return 0
            done = await conn.execute("DELETE FROM event_feed WHERE position <= $1", last)
            await conn.execute("UPDATE feed_meta SET trimmed = GREATEST(trimmed, $1) WHERE id = 1", last)
        return int(done.split()[-1])

    # --- messages ----------------------------------------------------------------------

    def _name(self) -> str:
        return f"job store {mask_url(self.url)} (setting 'jobs.store')"

    def _reason(self, exc: BaseException) -> str:
        text = str(exc) or type(exc).__name__
        password = url_password(self.url)
        if password:
            text = text.replace(password, "***")
        return f"{text} ({type(exc).__name__})"


async def replace_events(conn: Any, job_id: str, written: Sequence[Record]) -> None:
    """A finished job's whole log replaces the events appended before (and joins the feed)."""
    await conn.execute("DELETE FROM job_events WHERE job_id = $1", job_id)
    if written:
        await conn.copy_records_to_table(
            "job_events", records=[(job_id, seq, data) for seq, data, *_ in written], columns=("job_id", "seq", "event")
        )
        await feed(conn, job_id, written)


async def _feed_bounds(conn: Any) -> FeedBounds:
    meta = await conn.fetchrow("SELECT store_id, trimmed FROM feed_meta WHERE id = 1")
    # The sequence's last value counts positions whose transaction is still open: only a
    # committed row is a head a reader may pass (writes commit in position order).
    head = await conn.fetchval("SELECT COALESCE(max(position), 0) FROM event_feed")
    return FeedBounds(meta["store_id"], max(int(head), int(meta["trimmed"])), int(meta["trimmed"]))


def _decode(jobs: Sequence[Any], events: Sequence[Any]) -> list[StoredJob]:
    logs: dict[str, list[v1.RolloutEvent]] = {}
    for row in events:
        logs.setdefault(row["job_id"], []).append(v1.RolloutEvent.FromString(row["event"]))
    return [
        StoredJob(
            job_id=row["job_id"],
            number=row["number"],
            request=v1.RolloutRequest.FromString(row["request"]),
            fingerprint=row["fingerprint"],
            status=row["status"],
            create_time=row["create_time"],
            end_time=row["end_time"],
            result=v1.RolloutResult.FromString(row["result"]) if row["result"] is not None else None,
            events=logs.get(row["job_id"], []),
            attempt=row["attempt"],
        )
        for row in jobs
    ]
