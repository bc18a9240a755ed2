"""The PostgreSQL job store against a real PostgreSQL server (tests/postgres.py starts a
throwaway one): the store's semantics side by side with SQLite's, its schema migrations,
the `jobs.store` setting, and the job manager and a whole server restarting from it.

The tests that need PostgreSQL are marked `postgres` (`make test` leaves them out); the
SQLite side of the comparisons and the setting checks run everywhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from prorl_client import Client, v1
from prorl_server.agents.registry import default_registry
from prorl_server.app import ProrlServer
from prorl_server.config import ConfigError, Settings, load_settings, mask_url
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.phases import phase_gates
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.postgres_store import MIGRATIONS, Migration, PostgresJobStore
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from prorl_server.jobs.store import JobStore, JobStoreError
from prorl_server.llm.router import BackendRouter
from prorl_server.modes.factory import build_store, open_store
from prorl_server.sandbox.allocator import SandboxAllocator
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt
from tests.helpers import assert_eventually, math_request
from tests.postgres import PostgresCluster, postgres_cluster_fixture, postgres_url_fixture  # noqa: F401

SUCCEEDED, FAILED, QUEUED = v1.JOB_STATUS_SUCCEEDED, v1.JOB_STATUS_FAILED, v1.JOB_STATUS_QUEUED
LATEST = MIGRATIONS[-1].version


def settings_with(store: bool | str, **jobs: Any) -> Settings:
    return load_settings(None, environ={}, overrides={"jobs": {"store": store, **jobs}})


def events_of(job_id: str, count: int, payload: int = 0) -> list[v1.RolloutEvent]:
    events = [v1.RolloutEvent(job_id=job_id, seq=1, queued=v1.JobQueued(queue_position=0))]
    for seq in range(2, count):
        output = f"{seq:08d}" * (payload // 8)
        event = v1.RolloutEvent(
            job_id=job_id, seq=seq, tool_result=v1.ToolResult(turn=seq, name="python", output=output)
        )
        event.time.FromNanoseconds(seq * 1_000_003)
        events.append(event)
    result = v1.RolloutResult(job_id=job_id, status=SUCCEEDED, reward=1.0)
    events.append(v1.RolloutEvent(job_id=job_id, seq=count, finished=v1.JobFinished(result=result)))
    return events


def stored_request(job_id: str, restarts: int = 0) -> tuple[v1.RolloutRequest, bytes]:
    request = math_request("answer 7", "7", job_id=job_id)
    request.retry.max_restarts = restarts
    return request, request.SerializeToString(deterministic=True)


# --- the store: the same semantics as SQLite's ------------------------------------------------


@pytest_asyncio.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobStore]:
    made: JobStore
    if request.param == "sqlite":
        made = SQLiteJobStore(tmp_path / "jobs.sqlite")
    else:
        made = PostgresJobStore(request.getfixturevalue("postgres_url"), server_id="test-server")
    await made.open()
    yield made
    await made.close()


async def test_a_job_round_trips_through_the_store(store: JobStore) -> None:
    running, running_fp = stored_request("running")
    done, done_fp = stored_request("done")
    created = time.time() - 10
    await store.submitted("done", 1, done, done_fp, created)
    await store.submitted("running", 2, running, running_fp, created + 1, attempt=2)
    result = v1.RolloutResult(job_id="done", status=SUCCEEDED, reward=1.0)
    events = events_of("done", 5)
    end = time.time()
    await store.finished("done", SUCCEEDED, end, result, events)

    first, second = await store.load(retain_s=3600)
    assert (first.job_id, first.number, second.job_id, second.number) == ("done", 1, "running", 2)
    assert first.request == done and first.fingerprint == done_fp and first.create_time == created
    assert first.status == SUCCEEDED and first.end_time == end and first.result == result
    assert first.events == events and first.attempt == 1
    assert second.request == running and second.status == QUEUED and second.attempt == 2
    assert second.result is None and second.end_time is None and second.events == []


async def test_submitted_is_idempotent_and_a_new_attempt_starts_the_row_afresh(store: JobStore) -> None:
    request, fingerprint = stored_request("same")
    created = time.time()
    await store.submitted("same", 3, request, fingerprint, created)
    await store.submitted("same", 3, request, fingerprint, created)  # twice: still one job
    (only,) = await store.load(retain_s=3600)
    assert (only.job_id, only.number, only.status, only.attempt) == ("same", 3, QUEUED, 1)

    await store.finished(
        "same", FAILED, time.time(), v1.RolloutResult(job_id="same", status=FAILED), events_of("same", 4)
    )
    await store.submitted("same", 3, request, fingerprint, created, attempt=2)  # run again after a restart
    (again,) = await store.load(retain_s=3600)
    assert (again.status, again.attempt, again.result, again.end_time, again.events) == (QUEUED, 2, None, None, [])


async def test_finishing_a_job_never_submitted_records_nothing(store: JobStore) -> None:
    await store.finished("ghost", SUCCEEDED, time.time(), v1.RolloutResult(job_id="ghost"), events_of("ghost", 3))
    assert await store.load(retain_s=3600) == []


async def test_load_drops_finished_jobs_past_retention_and_keeps_unfinished_ones(store: JobStore) -> None:
    now = time.time()
    for number, job_id in enumerate(["old-done", "new-done", "old-running"], start=1):
        request, fingerprint = stored_request(job_id)
        await store.submitted(job_id, number, request, fingerprint, now - 7200)
    for job_id, end in (("old-done", now - 3700), ("new-done", now - 60)):
        await store.finished(job_id, SUCCEEDED, end, v1.RolloutResult(job_id=job_id), events_of(job_id, 3))

    assert [job.job_id for job in await store.load(retain_s=3600)] == ["new-done", "old-running"]
    assert [job.job_id for job in await store.load(retain_s=30)] == ["old-running"]  # deleted, not hidden
    assert [job.job_id for job in await store.load(retain_s=3600)] == ["old-running"]


async def test_a_big_event_log_round_trips_in_order(store: JobStore) -> None:
    request, fingerprint = stored_request("big")
    await store.submitted("big", 1, request, fingerprint, time.time())
    events = events_of("big", 20_000, payload=256)  # about 6 MB of events
    started = time.monotonic()
    await store.finished("big", SUCCEEDED, time.time(), v1.RolloutResult(job_id="big"), events)
    (loaded,) = await store.load(retain_s=3600)
    assert time.monotonic() - started < 30
    assert loaded.events == events


async def test_events_appended_while_a_job_runs_are_kept_once_in_seq_order(store: JobStore) -> None:
    request, fingerprint = stored_request("appending")
    await store.submitted("appending", 1, request, fingerprint, time.time())
    events = events_of("appending", 8)
    await store.appended("appending", events[3:6])  # out of order, overlapping: kept once each
    await store.appended("appending", events[:4])
    await store.appended("appending", events[:4])
    await store.appended("never-submitted", events_of("never-submitted", 3))  # no row: nothing
    (running,) = await store.load(retain_s=3600)
    assert running.job_id == "appending" and running.result is None and running.events == events[:6]

    result = events[-1].finished.result
    await store.finished("appending", SUCCEEDED, time.time(), result, events)
    await store.appended("appending", events[:2])  # a late duplicate changes nothing
    (ended,) = await store.load(retain_s=3600)
    assert ended.status == SUCCEEDED and ended.events == events

    await store.submitted("appending", 1, request, fingerprint, time.time(), attempt=2)
    (again,) = await store.load(retain_s=3600)
    assert again.events == []  # a new attempt starts without the old events


@pytest.mark.postgres
async def test_events_are_rows_keyed_by_job_and_seq_and_go_with_their_job(postgres_url: str) -> None:
    store = PostgresJobStore(postgres_url, server_id="server-a")
    await store.open()
    try:
        request, fingerprint = stored_request("keyed")
        await store.submitted("keyed", 1, request, fingerprint, time.time())
        await store.finished("keyed", SUCCEEDED, time.time() - 7200, v1.RolloutResult(), events_of("keyed", 6))
        async with store.pool.acquire() as conn:
            seqs = await conn.fetch("SELECT seq FROM job_events WHERE job_id = 'keyed' AND seq > 3 ORDER BY seq")
            assert [row["seq"] for row in seqs] == [4, 5, 6]  # another server could read from a seq on
            owner = await conn.fetchrow("SELECT server_id, lease_expires FROM jobs WHERE job_id = 'keyed'")
            assert (owner["server_id"], owner["lease_expires"]) == ("server-a", None)
            await store.load(retain_s=3600)
            assert await conn.fetchval("SELECT count(*) FROM job_events") == 0
    finally:
        await store.close()


# --- migrations -------------------------------------------------------------------------------


async def applied_versions(url: str) -> list[int]:
    conn = await asyncpg.connect(url)
    try:
        return [row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")]
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_migrations_are_applied_once_when_opened_again(postgres_url: str) -> None:
    first = PostgresJobStore(postgres_url)
    await first.open()
    request, fingerprint = stored_request("kept")
    await first.submitted("kept", 1, request, fingerprint, time.time())
    await first.close()
    second = PostgresJobStore(postgres_url)
    await second.open()
    try:
        assert await second.migrate() == []  # nothing left to apply
        assert [job.job_id for job in await second.load(retain_s=3600)] == ["kept"]
    finally:
        await second.close()
    assert await applied_versions(postgres_url) == [m.version for m in MIGRATIONS]


@pytest.mark.postgres
async def test_servers_starting_together_apply_each_migration_exactly_once(postgres_url: str) -> None:
    # A slow second step (not idempotent: applied twice, it would fail) keeps the lock held
    # while the other stores wait for it.
    slow = Migration(LATEST + 1, "slow", "SELECT pg_sleep(0.5); CREATE TABLE applied_once (n INTEGER)")
    stores = [PostgresJobStore(postgres_url, migrations=(*MIGRATIONS, slow)) for _ in range(4)]
    await asyncio.gather(*(store.open() for store in stores))
    try:
        assert await applied_versions(postgres_url) == [*(m.version for m in MIGRATIONS), slow.version]
        for store in stores:  # every one of them works on the schema
            assert await store.load(retain_s=3600) == []
    finally:
        await asyncio.gather(*(store.close() for store in stores))
    conn = await asyncpg.connect(postgres_url)
    try:
        described = await conn.fetch("SELECT description, applied_at FROM schema_migrations ORDER BY version")
    finally:
        await conn.close()
    assert [row["description"] for row in described][-1] == "slow" and all(row["applied_at"] for row in described)


@pytest.mark.postgres
async def test_a_failing_migration_leaves_nothing_behind(postgres_url: str) -> None:
    broken = Migration(LATEST + 1, "broken", "CREATE TABLE half_done (n INTEGER); SELECT no_such_function()")
    store = PostgresJobStore(postgres_url, migrations=(*MIGRATIONS, broken))
    with pytest.raises(JobStoreError, match=r"cannot apply the schema migrations: .*no_such_function"):
        await store.open()
    conn = await asyncpg.connect(postgres_url)
    try:  # one transaction: not even the migrations before it
        assert await conn.fetchval("SELECT to_regclass('half_done')") is None
        assert await conn.fetchval("SELECT to_regclass('jobs')") is None
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_a_schema_newer_than_the_code_refuses_to_start(postgres_url: str) -> None:
    store = PostgresJobStore(postgres_url)
    await store.open()
    async with store.pool.acquire() as conn:
        await conn.execute("INSERT INTO schema_migrations (version, description) VALUES (99, 'from the future')")
    await store.close()

    with pytest.raises(JobStoreError) as refused:
        await open_store(settings_with(postgres_url))
    message = refused.value.message
    assert "schema is at version 99, newer than this server knows" in message and f"({LATEST})" in message
    assert "setting 'jobs.store'" in message and "upgrade this server" in message
    assert await applied_versions(postgres_url) == [*(m.version for m in MIGRATIONS), 99]  # left as it was


# --- the setting --------------------------------------------------------------------------------


def test_jobs_store_takes_true_false_or_a_postgresql_url(tmp_path: Path) -> None:
    assert isinstance(build_store(settings_with(True, store_path=str(tmp_path / "j.sqlite"))), SQLiteJobStore)
    assert build_store(settings_with(False)) is None
    for url in ("postgresql://u:secret@db.example/jobs", "postgres://db.example/jobs", "PostgreSQL://h/d"):
        built = build_store(settings_with(url))
        assert isinstance(built, PostgresJobStore) and built.url == url
        assert "secret" not in repr(built)
    for wrong in ("sqlite", "mysql://h/d", "", "/var/lib/prorl/jobs.sqlite"):
        with pytest.raises(ConfigError, match=r"setting 'jobs\.store'.*true \(SQLite\), false \(no store\)"):
            settings_with(wrong)


def test_passwords_are_masked_in_urls() -> None:
    assert mask_url("postgresql://prorl:s3cret@db:5432/jobs") == "postgresql://prorl:***@db:5432/jobs"
    assert mask_url("postgresql://db/jobs?user=u&password=s3cret") == "postgresql://db/jobs?user=u&password=***"
    assert mask_url("postgresql://prorl@/jobs?host=/run/pg") == "postgresql://prorl@/jobs?host=/run/pg"


async def test_a_store_that_cannot_be_reached_says_which_and_why(tmp_path: Path) -> None:
    url = f"postgresql://prorl:s3cret@/jobs?host={tmp_path}/nowhere"
    with pytest.raises(JobStoreError) as refused:
        await open_store(settings_with(url))
    message = refused.value.message
    assert "s3cret" not in message
    assert message.startswith(
        f"job store postgresql://prorl:***@/jobs?host={tmp_path}/nowhere (setting 'jobs.store'): cannot connect: "
    )
    assert "No such file or directory" in message


@pytest.mark.postgres
async def test_a_database_that_does_not_exist_is_named(postgres_cluster: PostgresCluster) -> None:
    url = postgres_cluster.url("no_such_database", password="s3cret")
    with pytest.raises(JobStoreError) as refused:
        await open_store(settings_with(url))
    assert 'database "no_such_database" does not exist' in refused.value.message
    assert "s3cret" not in refused.value.message and ":***@" in refused.value.message


# --- the job manager and the server on the PostgreSQL store --------------------------------------


class Manager:
    """A JobManager on the fakes (as in tests/unit/jobs/test_job_manager.py) with a PostgreSQL store."""

    def __init__(self, provider: FakeSandboxProvider, url: str) -> None:
        self.backend = ScriptedChatBackend(self.script)
        self.router = BackendRouter(health_interval_s=0)
        self.router.add(self.backend)
        self.allocator = SandboxAllocator(provider, [])
        self.store = PostgresJobStore(url, server_id="manager")
        pipeline = Pipeline(gates=phase_gates(init=4, run=4, eval=4), sandboxes=self.allocator, router=self.router)
        self.manager = JobManager(
            settings=settings_with(url), registry=default_registry(), pipeline=pipeline, store=self.store
        )

    @staticmethod
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply(tool_call_text("finish", {"answer": user_prompt(messages).split()[-1]}))

    async def start(self) -> int:
        await self.store.open()
        return await self.manager.restore()

    async def stop(self) -> None:
        await self.manager.shutdown(0)
        await self.allocator.close()
        await self.router.close()
        await self.store.close()


@pytest_asyncio.fixture
async def manager_on(fake_provider: FakeSandboxProvider) -> AsyncIterator[Callable[[str], Manager]]:
    made: list[Manager] = []

    def make(url: str) -> Manager:
        made.append(Manager(fake_provider, url))
        return made[-1]

    yield make
    for manager in made:
        await manager.stop()


@pytest.mark.postgres
async def test_finished_jobs_come_back_from_postgres_after_a_restart(
    postgres_url: str, manager_on: Callable[[str], Manager]
) -> None:
    first = manager_on(postgres_url)
    assert await first.start() == 0
    job, created = first.manager.submit(math_request("answer 7", "7", job_id="durable"))
    assert created
    await assert_eventually(lambda: job.finished, message="the job did not finish")
    assert job.status == SUCCEEDED and job.result is not None and job.result.reward == 1.0
    before = job.events.events()
    await first.stop()

    second = manager_on(postgres_url)
    assert await second.start() == 1
    again = second.manager.get("durable")
    assert again.status == SUCCEEDED and again.result == job.result
    assert [event async for event in second.manager.watch("durable")] == before
    assert second.manager.submit(math_request("answer 7", "7", job_id="durable")) == (again, False)
    fresh, _ = second.manager.submit(math_request("answer 8", "8", job_id="fresh"))
    assert fresh.number == job.number + 1  # numbered after the restored jobs
    await assert_eventually(lambda: fresh.finished, message="the new job did not finish")
    assert len(second.backend.requests) == 1  # the restored job did not run again


@pytest.mark.postgres
async def test_jobs_running_when_the_server_died_restart_or_fail_as_interrupted(
    postgres_url: str, manager_on: Callable[[str], Manager]
) -> None:
    store = PostgresJobStore(postgres_url)
    await store.open()
    crashed, crashed_fp = stored_request("was-running")
    await store.submitted("was-running", 7, crashed, crashed_fp, time.time() - 5)
    again, again_fp = stored_request("rerun-me", restarts=1)
    await store.submitted("rerun-me", 8, again, again_fp, time.time() - 5)
    twice, twice_fp = stored_request("ran-twice", restarts=1)
    await store.submitted("ran-twice", 9, twice, twice_fp, time.time(), attempt=2)
    await store.close()

    restarted = manager_on(postgres_url)
    assert await restarted.start() == 3
    for job_id in ("was-running", "ran-twice"):
        failed = restarted.manager.get(job_id)
        assert failed.status == FAILED and failed.result is not None
        assert failed.result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
        assert failed.result.failure.reason == "interrupted"
    rerun = restarted.manager.get("rerun-me")
    await assert_eventually(lambda: rerun.finished, message="the restarted job did not finish")
    assert rerun.attempt == 2 and rerun.status == SUCCEEDED
    await restarted.stop()

    # The verdicts and the re-run's result were stored: read back unchanged.
    store = PostgresJobStore(postgres_url)
    await store.open()
    try:
        stored = {item.job_id: item for item in await store.load(retain_s=3600)}
    finally:
        await store.close()
    assert stored["was-running"].result is not None and stored["was-running"].result.failure.reason == "interrupted"
    assert stored["rerun-me"].attempt == 2 and stored["rerun-me"].result is not None
    assert stored["rerun-me"].result.reward == 1.0 and stored["rerun-me"].events[-1].HasField("finished")


def server_settings(url: str) -> Settings:
    return load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": instance_id("pg"), "shutdown_grace_s": 0},
            "jobs": {"store": url},
            "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
        },
    )


@pytest.mark.postgres
async def test_a_server_on_postgres_keeps_its_jobs_across_a_restart(postgres_url: str) -> None:
    settings = server_settings(postgres_url)
    backend = ScriptedChatBackend(Manager.script)
    first = ProrlServer(
        settings, sandbox_provider=FakeSandboxProvider(instance_id=instance_id("fake")), backends=[backend]
    )
    await first.start()
    try:
        async with Client.connect(first.address) as client:
            before = [event async for event in client.rollout(math_request("answer 5", "5", job_id="served"))]
    finally:
        await first.stop()
    assert before[-1].finished.result.reward == 1.0

    backend = ScriptedChatBackend(Manager.script)
    second = ProrlServer(
        settings, sandbox_provider=FakeSandboxProvider(instance_id=instance_id("fake")), backends=[backend]
    )
    await second.start()
    try:
        async with Client.connect(second.address) as client:
            job = await client.get_job("served")
            assert job.status == SUCCEEDED and job.result == before[-1].finished.result
            assert [event async for event in client.watch("served")] == before
    finally:
        await second.stop()


@pytest.mark.postgres
async def test_a_server_whose_store_is_unreachable_does_not_start(postgres_cluster: PostgresCluster) -> None:
    server = ProrlServer(
        server_settings(postgres_cluster.url("missing_db", password="hunter2")),
        sandbox_provider=FakeSandboxProvider(instance_id=instance_id("fake")),
        backends=[ScriptedChatBackend(Manager.script)],
    )
    with pytest.raises(JobStoreError, match=r"job store postgresql://.*:\*\*\*@/missing_db.*cannot connect"):
        await server.start()  # and start stopped what it had started
