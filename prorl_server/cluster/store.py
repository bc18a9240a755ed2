"""The shared PostgreSQL store of a cluster: the job queue, leases, cancels, takeovers.

Servers that share a database are peers (see cluster/__init__.py). A job's life
in the `jobs` table:

    Submit (any server)   row inserted: status QUEUED, server_id NULL; its
                          `queued` event is seq 1; NOTIFY prorl_queue.
    claim (a server with  `FOR UPDATE SKIP LOCKED`: server_id = the server,
    free slots)           status RUNNING, lease_expires = now + lease_ttl.
    heartbeat             the holder renews the leases of the jobs it runs
                          (and records their phase).
    end                   the holder writes status, result and the whole event
                          log; only while it still holds the job (fenced by
                          server_id and attempt), else the write is dropped.
    takeover (any server) a lease that lapsed (holder killed, node gone): the
                          job is queued again as attempt + 1 (a `queued` event
                          after the events stored so far) while
                          RetryPolicy.max_restarts allows, else it ends FAILED,
                          infrastructure, reason `server_lost`.
    hand-back (holder)    the holder stops gracefully with the job unfinished:
                          it queues the job again itself, at once, as attempt
                          + 1 (`queued` with handed_back), whatever its retry
                          policy: nothing was lost, so no restart is used
                          (`handbacks` counts these runs, which takeovers
                          leave out of max_restarts).

Lease times are read from the database's clock (`clock_timestamp()`), so the
servers' clocks need not agree. Every change to a job's events is followed by
NOTIFY prorl_events with the job id, so that watchers on any server read the
new events at once (cluster/notifications.py); writes of running jobs' events
come batched from the EventWriter, as with one server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from prorl_client import v1
from prorl_server.errors import ResourceExhausted
from prorl_server.jobs.postgres_store import PostgresJobStore, feed, replace_events
from prorl_server.jobs.record import FINISHED_STATUSES
from prorl_server.jobs.store import JobNotHeld, StoredJob, records

log = structlog.get_logger(__name__)

UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,  # e.g. the connection was closed under a query
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,  # shutting down, starting up
)
"""What a database that is down or restarting raises (not a bug in a query)."""
Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
"""A connection, or one lent by the pool."""
NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"
EVENTS_CHANNEL = "prorl_events"
QUEUE_CHANNEL = "prorl_queue"
CANCEL_CHANNEL = "prorl_cancel"
ADMIN_CHANNEL = "prorl_admin"

JOB_COLUMNS = (
    "job_id, number, request, fingerprint, status, phase, create_time, start_time, end_time, result, attempt, "
    "server_id, cancel_reason, "
    "(SELECT COALESCE(max(seq), 0) FROM job_events e WHERE e.job_id = jobs.job_id) AS last_seq"
)


@dataclass(frozen=True)
class JobRow:
    """A job as the shared store holds it: what GetJob and ListJobs report of a job
    this server does not hold (the fields of jobs.wire.job)."""

    job_id: str
    number: int
    request: v1.RolloutRequest
    fingerprint: bytes
    status: v1.JobStatus
    phase: v1.Phase
    create_time: float
    start_time: float | None
    end_time: float | None
    result: v1.RolloutResult | None
    attempt: int
    server_id: str | None
    cancel_reason: str | None
    last_seq: int

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_STATUSES


@dataclass(frozen=True)
class Claimed:
    """A job this server just claimed, with the events stored so far (seq 1..n)."""

    job: StoredJob
    cancel_reason: str | None


@dataclass(frozen=True)
class Lease:
    job_id: str
    attempt: int
    cancel_reason: str | None


def event(job_id: str, seq: int, **kind: object) -> v1.RolloutEvent:
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return v1.RolloutEvent(job_id=job_id, seq=seq, time=stamp, **kind)  # type: ignore[arg-type]


class ClusterStore(PostgresJobStore):
    """The job store of a server in a cluster. As the job manager's store (JobStore):
    `submitted` writes nothing (the row was written at Submit and claimed),
    `appended` and `finished` are fenced by the claim, `load` returns nothing (no
    job is this server's at start). The rest is the cluster's queue."""

    def __init__(self, url: str, *, server_id: str, max_connections: int = 8) -> None:
        super().__init__(url, server_id=server_id, max_connections=max_connections)
        self._claims: dict[str, int] = {}
        """Jobs this server holds: job id -> attempt (the fence of its writes)."""

    # --- the job manager's store ---------------------------------------------------

    async def submitted(
        self,
        job_id: str,
        number: int,
        request: v1.RolloutRequest,
        fingerprint: bytes,
        created: float,
        attempt: int = 1,
    ) -> None:
        """Nothing to write: a cluster's job row is written at Submit and claimed."""

    async def appended(self, job_id: str, events: Sequence[v1.RolloutEvent]) -> None:
        attempt = self._claims.get(job_id)
        if not events or attempt is None:
            return
        written = records(events)
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.executemany(
                "INSERT INTO job_events (job_id, seq, event) SELECT $1, $2, $3 WHERE EXISTS "
                "(SELECT 1 FROM jobs WHERE job_id = $1 AND server_id = $4 AND attempt = $5 AND end_time IS NULL) "
                "ON CONFLICT (job_id, seq) DO NOTHING",
                [(job_id, seq, data, self.server_id, attempt) for seq, data, *_ in written],
            )
            await feed(conn, job_id, written, held=(self.server_id, attempt))
            await conn.execute("SELECT pg_notify($1, $2)", EVENTS_CHANNEL, job_id)

    async def finished(
        self, job_id: str, status: int, end_time: float, result: v1.RolloutResult, events: list[v1.RolloutEvent]
    ) -> None:
        attempt = self._claims.get(job_id)
        if attempt is None:
            raise JobNotHeld(f"job {job_id!r} is no longer held by server {self.server_id!r}")
        written = records(events)
        phase = result.failure.phase if result.HasField("failure") else v1.PHASE_EVAL
        async with self.pool.acquire() as conn, conn.transaction():
            updated = await conn.execute(
                "UPDATE jobs SET status = $2, end_time = $3, result = $4, phase = $7, lease_expires = NULL "
                "WHERE job_id = $1 AND server_id = $5 AND attempt = $6 AND end_time IS NULL",
                job_id,
                status,
                end_time,
                result.SerializeToString(),
                self.server_id,
                attempt,
                phase,
            )
            if updated == "UPDATE 0":
                self._claims.pop(job_id, None)
                raise JobNotHeld(f"job {job_id!r} was taken over from server {self.server_id!r}")
            else:
                await replace_events(conn, job_id, written)
                await conn.execute("SELECT pg_notify($1, $2)", EVENTS_CHANNEL, job_id)
        self._claims.pop(job_id, None)

    async def load(self, retain_s: float) -> list[StoredJob]:
        """Only deletes finished jobs past retention: no job is this server's at start."""
        await self.forget_finished(retain_s)
        return []

    async def forget_finished(self, retain_s: float) -> int:
        """Delete the jobs that ended more than `retain_s` ago (their events go with them)."""
        done = await self.pool.execute(f"DELETE FROM jobs WHERE end_time < {NOW} - $1", retain_s)
        return int(done.split()[-1])

    def claimed_ids(self) -> list[str]:
        """The jobs this server holds now."""
        return list(self._claims)

    def release(self, job_id: str) -> None:
        """This server no longer holds the job (it ended or was lost): its writes stop."""
        self._claims.pop(job_id, None)

    def hold(self, job_id: str, attempt: int) -> None:
        """This server holds `attempt` of the job again (claimed while an earlier run of it here
        was still ending, unheld: see ClusterCoordinator._adopt_after)."""
        self._claims[job_id] = attempt

    # --- submission -------------------------------------------------------------------

    async def insert(
        self, request: v1.RolloutRequest, fingerprint: bytes, created: float, max_live: int
    ) -> tuple[JobRow, bool]:
        """Queue a new job, its `queued` event as seq 1; returns (row, created). A job id
        already stored returns that row, not created (the caller compares fingerprints).
        ResourceExhausted when `max_live` jobs are queued or running in the cluster."""
        job_id = request.job_id
        async with self.pool.acquire() as conn, conn.transaction():
            existing = await self._row(conn, job_id)
            if existing is not None:
                return existing, False
            counts = await conn.fetchrow(
                "SELECT count(*) AS live, count(*) FILTER (WHERE server_id IS NULL) AS queued "
                "FROM jobs WHERE end_time IS NULL"
            )
            assert counts is not None
            if counts["live"] >= max_live:
                raise ResourceExhausted(
                    f"{counts['live']} jobs are queued or running in the cluster, its limit (jobs.max_queued); "
                    "retry later"
                )
            inserted = await conn.fetchval(
                "INSERT INTO jobs (job_id, number, request, fingerprint, status, create_time, attempt, priority, "
                "group_id, labels, handler) "
                "VALUES ($1, nextval('job_numbers'), $2, $3, $4, $5, 1, $6, $7, $8::jsonb, $9) "
                "ON CONFLICT (job_id) DO NOTHING RETURNING number",
                job_id,
                request.SerializeToString(),
                fingerprint,
                v1.JOB_STATUS_QUEUED,
                created,
                request.priority,
                request.group_id,
                json.dumps(dict(request.labels)),
                request.handler,
            )
            if inserted is not None:
                first = event(job_id, 1, queued=v1.JobQueued(queue_position=counts["queued"], attempt=1))
                await _insert_event(conn, first)
                await conn.execute("SELECT pg_notify($1, '')", QUEUE_CHANNEL)
            # inserted is None: submitted through another server at the same moment; theirs stands.
            row = await self._row(conn, job_id)
        assert row is not None
        return row, inserted is not None

    # --- claims and leases --------------------------------------------------------------

    async def claim(self, limit: int, lease_ttl_s: float) -> list[Claimed]:
        """Up to `limit` queued jobs, highest priority then oldest first, now held by
        this server under a lease of `lease_ttl_s`."""
        if limit <= 0:
            return []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "WITH picked AS (SELECT job_id FROM jobs WHERE server_id IS NULL AND end_time IS NULL "
                "ORDER BY priority DESC, number LIMIT $2 FOR UPDATE SKIP LOCKED) "
                f"UPDATE jobs SET server_id = $1, status = $3, start_time = {NOW}, lease_expires = {NOW} + $4 "
                "FROM picked WHERE jobs.job_id = picked.job_id "
                "RETURNING jobs.job_id, number, request, fingerprint, create_time, attempt, cancel_reason, priority",
                self.server_id,
                limit,
                v1.JOB_STATUS_RUNNING,
                lease_ttl_s,
            )
            if not rows:
                return []
            ids = [row["job_id"] for row in rows]
            stored = await conn.fetch(
                "SELECT job_id, event FROM job_events WHERE job_id = ANY($1) ORDER BY job_id, seq", ids
            )
        logs: dict[str, list[v1.RolloutEvent]] = {}
        for item in stored:
            logs.setdefault(item["job_id"], []).append(v1.RolloutEvent.FromString(item["event"]))
        claimed = []
        for row in sorted(rows, key=lambda r: (-r["priority"], r["number"])):
            self._claims[row["job_id"]] = row["attempt"]
            job = StoredJob(
                job_id=row["job_id"],
                number=row["number"],
                request=v1.RolloutRequest.FromString(row["request"]),
                fingerprint=row["fingerprint"],
                status=v1.JOB_STATUS_RUNNING,
                create_time=row["create_time"],
                end_time=None,
                result=None,
                events=logs.get(row["job_id"], []),
                attempt=row["attempt"],
            )
            claimed.append(Claimed(job=job, cancel_reason=row["cancel_reason"]))
        return claimed

    async def renew(self, phases: dict[str, int], lease_ttl_s: float) -> list[Lease]:
        """Renew the leases of the jobs this server holds (recording each one's phase);
        returns the leases it still holds, with any cancel requested meanwhile."""
        ids = list(self._claims)
        rows = await self.pool.fetch(
            f"UPDATE jobs SET lease_expires = {NOW} + $2, "
            "phase = COALESCE((SELECT p FROM unnest($3::text[], $4::int[]) AS t(j, p) WHERE j = jobs.job_id), phase) "
            "WHERE server_id = $1 AND end_time IS NULL RETURNING job_id, attempt, cancel_reason",
            self.server_id,
            lease_ttl_s,
            ids,
            [phases.get(job_id, 0) for job_id in ids],
        )
        return [Lease(row["job_id"], row["attempt"], row["cancel_reason"]) for row in rows]

    async def expire_own(self) -> int:
        """At start: the jobs this server held before (it was killed or lost its node)
        are lost; their leases end now so that a takeover handles them."""
        done = await self.pool.execute(
            "UPDATE jobs SET lease_expires = 0 WHERE server_id = $1 AND end_time IS NULL", self.server_id
        )
        return int(done.split()[-1])

    async def take_over(self, limit: int = 100) -> list[tuple[str, bool]]:
        """Jobs whose lease lapsed: queued again (attempt + 1) while their retry policy
        allows, failed as `server_lost` otherwise. Returns (job id, restarted)."""
        taken: list[tuple[str, bool]] = []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT job_id, request, attempt, handbacks, server_id, phase FROM jobs "
                f"WHERE end_time IS NULL AND server_id IS NOT NULL AND lease_expires < {NOW} "
                "ORDER BY number LIMIT $1 FOR UPDATE SKIP LOCKED",
                limit,
            )
            for row in rows:
                job_id = row["job_id"]
                kept = await _contiguous_events(conn, job_id)
                request = v1.RolloutRequest.FromString(row["request"])
                if row["attempt"] - row["handbacks"] <= request.retry.max_restarts:  # restarts used so far < max
                    attempt = row["attempt"] + 1
                    queued = event(job_id, kept + 1, queued=v1.JobQueued(attempt=attempt))
                    await conn.execute(
                        "UPDATE jobs SET server_id = NULL, lease_expires = NULL, attempt = $2, status = $3, "
                        "phase = 0, start_time = NULL WHERE job_id = $1",
                        job_id,
                        attempt,
                        v1.JOB_STATUS_QUEUED,
                    )
                    await _insert_event(conn, queued)
                    taken.append((job_id, True))
                else:
                    result = lost_result(job_id, row["server_id"], row["phase"])
                    await _end(conn, job_id, result, kept)
                    taken.append((job_id, False))
                await conn.execute("SELECT pg_notify($1, $2)", EVENTS_CHANNEL, job_id)
            if any(restarted for _, restarted in taken):
                await conn.execute("SELECT pg_notify($1, '')", QUEUE_CHANNEL)
        for job_id, restarted in taken:
            log.warning("job_taken_over", job_id=job_id, restarted=restarted)
        return taken

    async def hand_back(self, job_ids: Sequence[str]) -> list[str]:
        """This server stops gracefully: the unfinished jobs among `job_ids` that it still holds
        go back to the queue now, each as its next attempt after the events stored so far (a
        `queued` event, handed_back). Not a restart: the job's retry policy is not consulted
        and its restarts are not used. Returns the jobs queued again."""
        if not job_ids:
            return []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                "SELECT job_id, attempt FROM jobs WHERE server_id = $1 AND job_id = ANY($2) AND end_time IS NULL "
                "ORDER BY number FOR UPDATE",
                self.server_id,
                list(job_ids),
            )
            for row in rows:
                job_id = row["job_id"]
                kept = await _contiguous_events(conn, job_id)
                attempt = row["attempt"] + 1
                await conn.execute(
                    "UPDATE jobs SET server_id = NULL, lease_expires = NULL, attempt = $2, status = $3, "
                    "phase = 0, start_time = NULL, handbacks = handbacks + 1 WHERE job_id = $1",
                    job_id,
                    attempt,
                    v1.JOB_STATUS_QUEUED,
                )
                await _insert_event(
                    conn, event(job_id, kept + 1, queued=v1.JobQueued(attempt=attempt, handed_back=True))
                )
                await conn.execute("SELECT pg_notify($1, $2)", EVENTS_CHANNEL, job_id)
            if rows:
                await conn.execute("SELECT pg_notify($1, '')", QUEUE_CHANNEL)
        for row in rows:
            self._claims.pop(row["job_id"], None)
        return [row["job_id"] for row in rows]

    # --- cancel ---------------------------------------------------------------------------

    async def cancel(self, job_id: str, reason: str) -> JobRow | None:
        """A queued job ends CANCELLED here and now; a running one is asked to stop (its
        holder is notified and ends it). Returns the row after that, None if unknown."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow("SELECT server_id, end_time FROM jobs WHERE job_id = $1 FOR UPDATE", job_id)
            if row is None:
                return None
            if row["end_time"] is None and row["server_id"] is None:
                kept = await _contiguous_events(conn, job_id)
                result = v1.RolloutResult(
                    job_id=job_id,
                    status=v1.JOB_STATUS_CANCELLED,
                    failure=v1.Failure(reason="cancelled", message=reason),
                )
                await _end(conn, job_id, result, kept)
                await conn.execute("SELECT pg_notify($1, $2)", EVENTS_CHANNEL, job_id)
            elif row["end_time"] is None:
                await conn.execute(
                    "UPDATE jobs SET cancel_reason = COALESCE(cancel_reason, $2) WHERE job_id = $1", job_id, reason
                )
                await conn.execute("SELECT pg_notify($1, $2)", CANCEL_CHANNEL, json.dumps([job_id, reason]))
            return await self._row(conn, job_id)

    # --- reading --------------------------------------------------------------------------

    async def job(self, job_id: str) -> JobRow | None:
        async with self.pool.acquire() as conn:
            return await self._row(conn, job_id)

    async def events_after(self, job_id: str, after_seq: int, limit: int = 1000) -> list[v1.RolloutEvent]:
        rows = await self.pool.fetch(
            "SELECT event FROM job_events WHERE job_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
            job_id,
            after_seq,
            limit,
        )
        return [v1.RolloutEvent.FromString(row["event"]) for row in rows]

    async def jobs(
        self, *, after: int, statuses: Sequence[int], group_id: str, labels: dict[str, str], limit: int
    ) -> list[JobRow]:
        rows = await self.pool.fetch(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE number > $1 "
            "AND (cardinality($2::int[]) = 0 OR status = ANY($2::int[])) AND ($3 = '' OR group_id = $3) "
            "AND labels @> $4::jsonb ORDER BY number LIMIT $5",
            after,
            list(statuses),
            group_id,
            json.dumps(labels),
            limit,
        )
        return [_job_row(row) for row in rows]

    async def count_by_status(self) -> dict[int, int]:
        rows = await self.pool.fetch("SELECT status, count(*) AS n FROM jobs GROUP BY status")
        return {row["status"]: row["n"] for row in rows}

    @staticmethod
    async def _row(conn: Conn, job_id: str) -> JobRow | None:
        row = await conn.fetchrow(f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = $1", job_id)
        return _job_row(row) if row is not None else None


def lost_result(job_id: str, server_id: str | None, phase: int) -> v1.RolloutResult:
    return v1.RolloutResult(
        job_id=job_id,
        status=v1.JOB_STATUS_FAILED,
        failure=v1.Failure(
            kind=v1.FAILURE_KIND_INFRASTRUCTURE,
            phase=phase,  # type: ignore[arg-type]
            reason="server_lost",
            message=(
                f"server {server_id!r} running the job stopped renewing its lease (killed, or its node lost); "
                "set retry.max_restarts to have another server run the job again"
            ),
        ),
    )


async def _contiguous_events(conn: Conn, job_id: str) -> int:
    """The number of the job's stored events with seq 1, 2, ... without a gap; later
    ones (after events a lost server never wrote) are deleted."""
    seqs = [row["seq"] for row in await conn.fetch("SELECT seq FROM job_events WHERE job_id = $1 ORDER BY seq", job_id)]
    kept = 0
    while kept < len(seqs) and seqs[kept] == kept + 1:
        kept += 1
    if kept < len(seqs):
        await conn.execute("DELETE FROM job_events WHERE job_id = $1 AND seq > $2", job_id, kept)
        log.warning("job_events_gap", job_id=job_id, kept=kept, discarded=len(seqs) - kept)
    return kept


async def _insert_event(conn: Conn, item: v1.RolloutEvent) -> None:
    written = records([item])
    await conn.execute("INSERT INTO job_events (job_id, seq, event) VALUES ($1, $2, $3)", item.job_id, *written[0][:2])
    await feed(conn, item.job_id, written)


async def _end(conn: Conn, job_id: str, result: v1.RolloutResult, kept: int) -> None:
    """End a job nobody runs: its result, and its `finished` event after the `kept` stored ones."""
    await conn.execute(
        f"UPDATE jobs SET status = $2, end_time = {NOW}, result = $3, lease_expires = NULL WHERE job_id = $1",
        job_id,
        result.status,
        result.SerializeToString(),
    )
    await _insert_event(conn, event(job_id, kept + 1, finished=v1.JobFinished(result=result)))


def _job_row(row: asyncpg.Record) -> JobRow:
    return JobRow(
        job_id=row["job_id"],
        number=row["number"],
        request=v1.RolloutRequest.FromString(row["request"]),
        fingerprint=row["fingerprint"],
        status=row["status"],
        phase=row["phase"],
        create_time=row["create_time"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        result=v1.RolloutResult.FromString(row["result"]) if row["result"] is not None else None,
        attempt=row["attempt"],
        server_id=row["server_id"],
        cancel_reason=row["cancel_reason"],
        last_seq=row["last_seq"],
    )
