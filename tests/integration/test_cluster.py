"""Three servers sharing one PostgreSQL job store are one service.

Real servers on real ports, driven by the real client, sharing a real
PostgreSQL (tests/postgres.py); sandboxes from the fake provider and model
turns from scripted in-process backends, so that these run without Podman.
The subprocess tests with Podman (kill -9 of a server) are in
test_cluster_processes.py.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorl_client import Client, RpcError, v1
from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome
from prorl_server.agents.math import MathHandler, MathInstance
from prorl_server.agents.registry import default_registry
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.sandbox.base import Sandbox, SandboxSpec
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import LoadableScriptedBackend, ScriptedReply, tool_call_text, user_prompt
from tests.fakes.token_servers import FakeSGLang, write_tiny_tokenizer
from tests.helpers import assert_eventually, kinds, math_request
from tests.postgres import PostgresCluster, postgres_cluster_fixture, postgres_url_fixture  # noqa: F401

pytestmark = pytest.mark.postgres


class HoldingProvider(FakeSandboxProvider):
    """Fake sandboxes whose creation waits, while `hold` is given and not set: a job held in init."""

    def __init__(self, hold: asyncio.Event | None, **options: Any) -> None:
        super().__init__(**options)
        self.hold = hold
        self.holding = 0

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if self.hold is not None and not self.hold.is_set():
            self.holding += 1
            try:
                await self.hold.wait()
            finally:
                self.holding -= 1
        return await super().create(spec)


class HoldingMath(MathHandler):
    """The math family, whose evaluation waits while `hold` is not set: a job held in eval."""

    def __init__(self, hold: asyncio.Event) -> None:
        super().__init__()
        self.hold = hold
        self.holding = 0

    async def evaluate(self, ctx: RolloutContext[MathInstance], outcome: RunOutcome) -> EvalOutcome:
        self.holding += 1
        try:
            await self.hold.wait()
        finally:
            self.holding -= 1
        return await super().evaluate(ctx, outcome)


class Member:
    """One server of the test cluster, with its own fake sandboxes and scripted model.
    `hold`: "init" or "eval" holds this server's jobs in that phase until `held` is set."""

    def __init__(self, name: str, url: str, release: asyncio.Event, hold: str = "", **cluster: Any) -> None:
        self.name = name
        self.release = release
        self.held = asyncio.Event()
        self.provider = HoldingProvider(self.held if hold == "init" else None, instance_id=instance_id(f"fake-{name}"))
        self.math = HoldingMath(self.held) if hold == "eval" else None
        registry = default_registry()
        if self.math is not None:
            registry.register(self.math)
        self.backend = LoadableScriptedBackend(self.script)
        settings = load_settings(
            None,
            environ={},
            overrides={
                "server": {"port": 0, "instance_id": instance_id(name), "shutdown_grace_s": 0},
                "phases": {"init": 2, "run": 2, "eval": 2},
                "jobs": {"store": url},
                "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
                "cluster": {"lease_ttl_s": 4, "heartbeat_s": 0.5, "poll_s": 0.5, **cluster},
            },
        )
        self.server = ProrlServer(settings, registry=registry, sandbox_provider=self.provider, backends=[self.backend])
        self.client: Client | None = None

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        question = user_prompt(messages)
        if question == "hold":
            return ScriptedReply(tool_call_text("finish", {"answer": "42"}), wait_for=self.release)
        return ScriptedReply(tool_call_text("finish", {"answer": question.split()[-1]}), delay_s=0.05)

    @property
    def id(self) -> str:
        return self.server.settings.server.instance_id

    async def start(self) -> Member:
        await self.server.start()
        self.client = Client.connect(self.server.address)
        return self

    async def stop(self) -> None:
        self.held.set()
        if self.client is not None:
            await self.client.close()
        await self.server.stop()
        assert self.provider.busy == 0 and leftovers(self.provider) == []

    @property
    def rpc(self) -> Client:
        assert self.client is not None
        return self.client

    def claimed(self) -> int:
        coordinator = self.server._mode.coordinator
        assert coordinator is not None
        return coordinator.claimed


def leftovers(provider: FakeSandboxProvider) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"prorl-{provider.instance_id}-*"))


Cluster = Callable[..., Awaitable[Member]]


@pytest_asyncio.fixture
async def cluster(postgres_url: str) -> AsyncIterator[Cluster]:
    """Start servers on one database: `await cluster("a")`, `await cluster("f", run_jobs=False)`."""
    release = asyncio.Event()
    members: list[Member] = []

    async def start(name: str, **settings: Any) -> Member:
        member = Member(name, postgres_url, release, **settings)
        members.append(member)
        return await member.start()

    yield start
    release.set()
    for member in reversed(members):
        await member.stop()


async def held_on(members: list[Member], count: int = 1) -> Member:
    """The server whose model holds `count` jobs."""
    await assert_eventually(
        lambda: sum(member.backend.in_flight for member in members) == count, message="jobs never got held"
    )
    return next(member for member in members if member.backend.in_flight)


async def test_jobs_submitted_to_one_server_run_on_every_server(cluster: Cluster) -> None:
    a, b, c = [await cluster(name) for name in ("a", "b", "c")]
    requests = [math_request(f"answer {n}", str(n), job_id=f"j{n}") for n in range(90)]

    results = {}
    async for event in a.rpc.rollout_many(requests):
        assert not isinstance(event, v1.RolloutRejected), event
        if event.HasField("finished"):
            results[event.job_id] = event.finished.result

    assert sorted(results) == sorted(request.job_id for request in requests)
    assert all(r.status == v1.JOB_STATUS_SUCCEEDED and r.reward == 1.0 for r in results.values())
    shares = {member.name: member.claimed() for member in (a, b, c)}
    assert sum(shares.values()) == 90, shares  # each job claimed once
    assert all(share >= 18 for share in shares.values()), shares  # at least 20% each
    listed = await c.rpc.list_jobs(statuses=[v1.JOB_STATUS_SUCCEEDED], page_size=1000)
    assert len(listed.jobs) == 90


async def test_watch_on_any_server_gives_the_same_events_live_and_replayed(cluster: Cluster) -> None:
    members = [await cluster(name) for name in ("a", "b", "c")]
    a = members[0]
    await a.rpc.submit(math_request("hold", job_id="held"))
    holder = await held_on(members)
    other = next(member for member in members if member is not holder and member is not a)

    async def watch(member: Member) -> list[v1.RolloutEvent]:
        return [event async for event in member.rpc.watch("held")]

    live = [asyncio.create_task(watch(member)) for member in members]
    await assert_eventually(lambda: other.server.jobs is not None, message="no job service")
    await asyncio.sleep(0.5)  # the watchers follow the live job (its events so far replayed)
    holder.release.set()
    on_holder, on_a, on_other = await asyncio.gather(*live)

    assert kinds(on_holder)[-1] == "finished" and on_holder[-1].finished.result.reward == 1.0
    assert on_a == on_holder and on_other == on_holder
    assert [event async for event in other.rpc.watch("held")] == on_holder  # replayed after the end
    assert [event async for event in a.rpc.watch("held", after_seq=3)] == on_holder[3:]
    job = await other.rpc.get_job("held")
    assert job.status == v1.JOB_STATUS_SUCCEEDED and job.last_seq == len(on_holder)


async def test_a_watcher_never_sees_an_event_the_store_does_not_have(cluster: Cluster, postgres_url: str) -> None:
    """So a client that saw seq N on a server that then dies resumes elsewhere with after_seq=N
    and misses nothing: each event reaches watchers once it is stored, on the holder too."""
    a = await cluster("a")
    conn = await asyncpg.connect(postgres_url)
    try:
        await a.rpc.submit(math_request("hold", job_id="d1"))
        await held_on([a])  # the job is a's now: a's watchers follow its log in memory
        a.release.set()
        seen = []
        async for event in a.rpc.watch("d1"):
            stored = await conn.fetchval("SELECT event FROM job_events WHERE job_id = 'd1' AND seq = $1", event.seq)
            assert stored is not None and v1.RolloutEvent.FromString(stored) == event, event
            seen.append(event)
    finally:
        await conn.close()
    assert kinds(seen)[-1] == "finished" and len(seen) >= 5


async def test_cancel_reaches_a_job_on_another_server(cluster: Cluster) -> None:
    members = [await cluster(name) for name in ("a", "b")]
    await members[0].rpc.submit(math_request("hold", job_id="c1"))
    holder = await held_on(members)
    elsewhere = next(member for member in members if member is not holder)

    job = await elsewhere.rpc.cancel("c1", reason="enough")

    assert job.status == v1.JOB_STATUS_CANCELLED
    assert job.result.failure.reason == "cancelled" and job.result.failure.message == "enough"
    assert holder.backend.in_flight == 0 and holder.provider.busy == 0


async def test_a_front_accepts_and_a_queued_job_is_cancelled_in_the_store(cluster: Cluster) -> None:
    front = await cluster("front", run_jobs=False)
    submitted = await front.rpc.submit(math_request("answer 7", "7", job_id="q1"))
    assert submitted.created and submitted.job.status == v1.JOB_STATUS_QUEUED

    job = await front.rpc.cancel("q1")
    assert job.status == v1.JOB_STATUS_CANCELLED
    events = [event async for event in front.rpc.watch("q1")]
    assert kinds(events) == ["queued", "finished"]

    await front.rpc.submit(math_request("answer 8", "8", job_id="q2"))
    worker = await cluster("worker")  # a server that runs jobs joins: the queue drains
    events = [event async for event in front.rpc.watch("q2")]
    assert events[-1].finished.result.reward == 1.0 and worker.claimed() == 1
    with pytest.raises(RpcError) as refused:
        await front.rpc.submit(math_request("answer 9", "9", job_id="q2"))
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    again = await worker.rpc.submit(math_request("answer 8", "8", job_id="q2"))
    assert not again.created and again.job.status == v1.JOB_STATUS_SUCCEEDED


async def test_admin_changes_apply_to_every_server(cluster: Cluster) -> None:
    a, b, c = [await cluster(name) for name in ("a", "b", "c")]
    backend = v1.Backend(id="shared", kind=v1.BACKEND_KIND_OPENAI_CHAT, base_url="http://127.0.0.1:9/v1")

    await a.rpc.add_backend(backend)
    for member in (a, b, c):
        assert "shared" in [entry.id for entry in await member.rpc.list_backends()]
    await b.rpc.pause()
    assert [(await member.rpc.get_stats()).paused for member in (a, b, c)] == [True] * 3
    assert await c.rpc.resume() == 1
    assert await a.rpc.resume(policy_version=5) == 5
    for member in (a, b, c):
        stats = await member.rpc.get_stats()
        assert (stats.paused, stats.policy_version) == (False, 5)
    with pytest.raises(RpcError) as older:
        await b.rpc.resume(policy_version=4)
    assert older.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await c.rpc.remove_backend("shared")
    for member in (a, b, c):
        assert "shared" not in [entry.id for entry in await member.rpc.list_backends()]

    late = await cluster("late")  # a server that joins later applies what was done before
    stats = await late.rpc.get_stats(include_cluster=True)
    assert stats.policy_version == 5 and not stats.paused
    assert "shared" not in [entry.id for entry in await late.rpc.list_backends()]
    assert sorted(server.server_id for server in stats.servers if server.live) == sorted(
        member.id for member in (a, b, c, late)
    )


async def test_new_weights_load_on_every_server_and_shared_backends_load_once(cluster: Cluster, tmp_path: Path) -> None:
    a, b, c = [await cluster(name) for name in ("a", "b", "c")]
    folder = write_tiny_tokenizer(tmp_path / "tokenizer")
    sglang = FakeSGLang(folder, lambda prompt: "ok")
    await sglang.start()
    try:
        await a.rpc.add_backend(
            v1.Backend(id="sg", kind=v1.BACKEND_KIND_SGLANG, base_url=sglang.base_url, tokenizer_path=str(folder))
        )
        await b.rpc.pause()
        update = await a.rpc.update_weights("/ckpt/step-1")
        assert update.policy_version == 1 and sorted(x.backend_id for x in update.backends) == ["scripted", "sg"]
        # Each server loaded its own model; the shared SGLang server was asked once, by a.
        assert [member.backend.loaded for member in (a, b, c)] == [["/ckpt/step-1"]] * 3
        assert sglang.loads == ["/ckpt/step-1"]
        assert await c.rpc.resume() == 1  # the version staged on every server
        for member in (a, b, c):
            stats = await member.rpc.get_stats()
            assert (stats.paused, stats.policy_version) == (False, 1)

        # A server that cannot load the new weights stays paused rather than serve the old
        # ones under the new version; the next update that loads lets it go on.
        c.backend.refuse = True
        await a.rpc.pause()
        await b.rpc.update_weights("/ckpt/step-2", backend_ids=["scripted"], resume=True)
        paused = {member.name: (await member.rpc.get_stats()).paused for member in (a, b, c)}
        assert paused == {"a": False, "b": False, "c": True}
        c.backend.refuse = False
        await a.rpc.pause()
        await a.rpc.update_weights("/ckpt/step-3", backend_ids=["scripted"], resume=True)
        assert [(await member.rpc.get_stats()).policy_version for member in (a, b, c)] == [3, 3, 3]
        assert not (await c.rpc.get_stats()).paused and c.backend.weights == "step-3"

        late = await cluster("late")  # loads only the latest checkpoint
        assert late.backend.loaded == ["/ckpt/step-3"] and (await late.rpc.get_stats()).policy_version == 3
    finally:
        await sglang.stop()


async def test_cluster_stats_show_every_server_and_the_leases(cluster: Cluster) -> None:
    members = [await cluster(name) for name in ("a", "b")]
    await members[0].rpc.submit(math_request("hold", job_id="s1"))
    holder = await held_on(members)

    async def leases() -> dict[str, int]:
        stats = await members[0].rpc.get_stats(include_cluster=True)
        return {server.server_id: server.leases for server in stats.servers}

    await assert_eventually(
        lambda: _equals(leases(), {member.id: int(member is holder) for member in members}),
        message="the holder never published its lease",
    )
    stats = await members[1].rpc.get_stats(include_cluster=True)
    assert stats.server_id == members[1].id
    assert {count.status: count.count for count in stats.cluster_jobs} == {v1.JOB_STATUS_RUNNING: 1}
    assert all(server.live and server.runs_jobs and server.address for server in stats.servers)


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected


async def test_a_server_that_stops_hands_its_running_jobs_to_a_peer(cluster: Cluster) -> None:
    members = [await cluster(name) for name in ("a", "b")]
    request = math_request("hold", job_id="h1")
    await members[0].rpc.submit(request)
    holder = await held_on(members)
    peer = next(member for member in members if member is not holder)

    await holder.server.stop()  # grace 0: the job is handed back, not cancelled
    holder.release.set()  # from now on the peer's model answers at once
    events = [event async for event in peer.rpc.watch("h1")]

    assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED
    queued = [event.queued.attempt for event in events if event.HasField("queued")]
    assert queued == [1, 2] and peer.claimed() == 1
    assert [event.seq for event in events] == list(range(1, len(events) + 1))


@pytest.mark.parametrize("phase", ["queued", "init", "run", "eval"])
async def test_a_stopping_server_hands_a_job_back_from_every_phase_and_no_restart_is_used(
    cluster: Cluster, phase: str
) -> None:
    """Server a holds the job waiting for an init slot, in init, in run, or in eval; it stops
    gracefully (grace 0); b, started meanwhile, runs the job again and it succeeds. The job
    allows no restart (max_restarts 0, the default): a hand-back is not a lost server."""
    a = await cluster("a", hold=phase if phase in ("init", "eval") else "")
    question = "hold" if phase == "run" else "answer 7"
    request = math_request(question, "42" if phase == "run" else "7", job_id=f"hb-{phase}")
    init_gate = a.server._gates[v1.PHASE_INIT]
    slots_taken = asyncio.Event()
    blockers: list[asyncio.Task[None]] = []
    if phase == "queued":  # both of a's init slots are busy: the job waits for one

        async def occupy() -> None:
            async with init_gate.slot():
                await slots_taken.wait()

        blockers = [asyncio.create_task(occupy()) for _ in range(init_gate.limit)]
        await assert_eventually(lambda: init_gate.active == init_gate.limit)
    await a.rpc.submit(request)
    held: dict[str, Callable[[], bool]] = {
        "queued": lambda: init_gate.queued == 1,
        "init": lambda: a.provider.holding == 1,
        "run": lambda: a.backend.in_flight == 1,
        "eval": lambda: a.math is not None and a.math.holding == 1,
    }
    await assert_eventually(held[phase], message=f"the job never got held in {phase} on a")
    assert a.server.manager is not None
    log = a.server.manager.local(request.job_id)
    assert log is not None
    await assert_eventually(lambda: log.events.durable_seq == log.events.last_seq, message="a's events not stored")
    b = await cluster("b")

    await a.server.stop()  # grace 0: the job is handed back, from whatever phase it was in
    a.release.set()  # from now on b's model answers "hold" at once
    slots_taken.set()
    await asyncio.gather(*blockers)
    events = [event async for event in b.rpc.watch(request.job_id)]

    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0, result.failure
    queued = [(e.queued.attempt, e.queued.handed_back) for e in events if e.HasField("queued")]
    assert queued == [(1, False), (2, True)]
    assert a.claimed() == 1 and b.claimed() == 1
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    started = [e.phase_started.phase for e in events if e.HasField("phase_started")]
    reached = {"queued": [], "init": [v1.PHASE_INIT], "run": [v1.PHASE_INIT, v1.PHASE_RUN]}
    expected_on_a = reached.get(phase, [v1.PHASE_INIT, v1.PHASE_RUN, v1.PHASE_EVAL])
    # a's phases as far as it got (every event it wrote before it stopped), then b's whole run.
    assert started == [*expected_on_a, v1.PHASE_INIT, v1.PHASE_RUN, v1.PHASE_EVAL]


async def test_a_handed_back_job_keeps_its_restarts_for_a_server_that_is_lost(
    cluster: Cluster, postgres_url: str
) -> None:
    """max_restarts 1, handed back once: when its next server's lease then lapses (a lost
    server, simulated in the store), the job still runs again, as its third attempt."""
    a = await cluster("a")
    request = math_request("hold", job_id="hb-then-lost")
    request.retry.max_restarts = 1
    await a.rpc.submit(request)
    await assert_eventually(lambda: a.backend.in_flight == 1, message="the job never reached a's model")
    await a.server.stop()
    b = await cluster("b")
    await assert_eventually(lambda: b.backend.in_flight == 1, message="b never ran the handed-back job")
    conn = await asyncpg.connect(postgres_url)
    try:  # the job's server is lost: its lease lapses (it is another's, "ghost", which never renews)
        await conn.execute("UPDATE jobs SET server_id = 'ghost', lease_expires = 0 WHERE job_id = $1", request.job_id)
    finally:
        await conn.close()
    b.release.set()  # b's own run of attempt 2 may end now: its write is refused, it no longer holds the job

    async def succeeded() -> bool:
        job = await b.rpc.get_job(request.job_id)
        return bool(job.status == v1.JOB_STATUS_SUCCEEDED)

    await assert_eventually(succeeded, message="the job never ran again after its server was lost")
    events = [event async for event in b.rpc.watch(request.job_id)]

    queued = [(e.queued.attempt, e.queued.handed_back) for e in events if e.HasField("queued")]
    assert queued == [(1, False), (2, True), (3, False)]
    assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED


async def test_ten_seconds_without_the_store_lose_no_job_and_refuse_submissions(
    cluster: Cluster, postgres_cluster: PostgresCluster
) -> None:
    """PostgreSQL stopped for 10 s while 8 jobs run (leases of 20 s outlast it)."""
    a, b = [await cluster(name, lease_ttl_s=20) for name in ("a", "b")]
    ids = [f"o{n}" for n in range(8)]
    for job_id in ids:
        await a.rpc.submit(math_request("hold", job_id=job_id))
    await held_on([a, b], count=4)  # 2 jobs held by each server's model (run limit 2), 4 queued
    channel = grpc.aio.insecure_channel(a.server.address)
    health = health_pb2_grpc.HealthStub(channel)

    async def serving() -> bool:
        answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    postgres_cluster.stop()
    stopped = time.monotonic()
    try:
        with pytest.raises(RpcError) as refused:
            await a.rpc.submit(math_request("answer 1", "1", job_id="late"))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "job store cannot be reached" in refused.value.details
        await assert_eventually(lambda: _not(serving()), message="health never said NOT_SERVING")
        a.release.set()  # the running jobs end while the store is down: their results wait
        await assert_eventually(lambda: a.backend.in_flight + b.backend.in_flight == 0, message="jobs never ended")
        await asyncio.sleep(max(0.0, 10 - (time.monotonic() - stopped)))  # the outage lasts 10 s
    finally:
        postgres_cluster.start()
    await assert_eventually(serving, timeout_s=30, message="health never came back")
    for job_id in ids:
        events = [event async for event in b.rpc.watch(job_id)]
        assert [event.seq for event in events] == list(range(1, len(events) + 1)), job_id
        assert kinds(events).count("finished") == 1 and kinds(events).count("queued") == 1, job_id
        assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED, job_id
    assert a.claimed() + b.claimed() == len(ids)  # each job claimed once
    submitted = await b.rpc.submit(math_request("answer 2", "2", job_id="late"))
    assert submitted.created
    done = [event async for event in a.rpc.watch("late")]
    assert done[-1].finished.result.reward == 1.0
    listed = await a.rpc.list_jobs(page_size=100)
    assert sorted(job.job_id for job in listed.jobs) == sorted([*ids, "late"])
    await channel.close()


async def _not(value: Awaitable[bool]) -> bool:
    return not await value


async def test_a_server_cut_off_from_the_store_stops_its_job_before_another_takes_it_over(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition: b runs, but its leases cannot be renewed. b stops the job a heartbeat
    before its lease lapses, so it never runs on two servers at once; a runs it again."""
    b = await cluster("b")
    request = math_request("hold", job_id="p1")
    request.retry.max_restarts = 1
    await b.rpc.submit(request)
    await held_on([b])
    a = await cluster("a")
    store = b.server._mode.store
    assert store is not None

    async def unreachable(*_args: object, **_kwargs: object) -> None:
        raise ConnectionRefusedError("cut off (test)")

    monkeypatch.setattr(store, "renew", unreachable)
    monkeypatch.setattr(store, "claim", unreachable)
    await assert_eventually(lambda: b.backend.in_flight == 0, message="b never stopped its job")
    stopped = time.time()
    await assert_eventually(lambda: a.backend.in_flight == 1, message="a never took the job over")
    b.release.set()
    events = [event async for event in a.rpc.watch("p1")]

    restarted = next(e for e in events if e.HasField("queued") and e.queued.attempt == 2)
    assert restarted.time.ToNanoseconds() / 1e9 >= stopped  # taken over after b had stopped
    assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED
    assert kinds(events).count("finished") == 1  # b's own ending of the job was never written
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
