"""One client over several servers: round_robin spreads the calls, `follow` resumes a job's
events on another server when its server goes away.

Three real grpc.aio servers on 127.0.0.1, each with a small fake RolloutService; the fakes
share one in-memory event log, playing the part of the job store a cluster shares, and
record which server served each Watch and from which seq."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from prorl_client._client import LoadBalancing, multi_address_target

import prorl_client
from prorl_client import Client, RpcError, v1
from tests.helpers import kinds

JOB = "job-1"


class SharedLog:
    """The events of JOB as the shared store holds them; a Watch on any server reads them."""

    def __init__(self) -> None:
        self.events: list[v1.RolloutEvent] = []
        self.changed = asyncio.Condition()

    async def append(self, kind: str) -> None:
        event = v1.RolloutEvent(job_id=JOB, seq=len(self.events) + 1)
        if kind == "finished":
            event.finished.result.job_id = JOB
            event.finished.result.reward = 1.0
        else:
            getattr(event, kind).SetInParent()
        async with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    async def follow(self, after_seq: int) -> AsyncIterator[v1.RolloutEvent]:
        seq = after_seq
        while True:
            async with self.changed:
                while len(self.events) <= seq:
                    await self.changed.wait()
                event = self.events[seq]
            seq = event.seq
            yield event
            if event.HasField("finished"):
                return


@dataclass(frozen=True)
class WatchCall:
    server: int
    job_id: str
    after_seq: int


class FakeRolloutService(v1.RolloutServiceServicer):
    """GetJob and Watch of one server. Jobs: JOB (events from the shared log), "down"
    (always UNAVAILABLE), "flaky" (one new event per stream, then UNAVAILABLE); any other
    job is NOT_FOUND."""

    def __init__(self, index: int, cluster: Cluster) -> None:
        self.index = index
        self.cluster = cluster

    async def GetJob(  # noqa: N802
        self, request: v1.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> v1.GetJobResponse:
        self.cluster.get_jobs[self.index] += 1
        return v1.GetJobResponse(job=v1.Job(job_id=request.job_id))

    async def Watch(  # noqa: N802
        self, request: v1.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[v1.WatchResponse]:
        self.cluster.watches.append(WatchCall(self.index, request.job_id, request.after_seq))
        self.cluster.streaming += 1
        try:
            async for response in self._watch(request, context):
                yield response
        finally:
            self.cluster.streaming -= 1

    async def _watch(
        self, request: v1.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[v1.WatchResponse]:
        if request.job_id == JOB:
            async for event in self.cluster.log.follow(request.after_seq):
                yield v1.WatchResponse(event=event)
        elif request.job_id == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the job store is unreachable")
        elif request.job_id == "flaky":
            seq = request.after_seq + 1
            event = v1.RolloutEvent(job_id="flaky", seq=seq)
            if seq == 5:
                event.finished.result.job_id = "flaky"
                yield v1.WatchResponse(event=event)
                return
            event.queued.SetInParent()
            yield v1.WatchResponse(event=event)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "lost the stream")
        else:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id}")


class Cluster:
    def __init__(self) -> None:
        self.log = SharedLog()
        self.watches: list[WatchCall] = []
        self.get_jobs: Counter[int] = Counter()
        self.servers: list[grpc.aio.Server] = []
        self.addresses: list[str] = []
        self.stopped: set[int] = set()
        self.clients: list[Client] = []
        self.streaming = 0  # Watch streams the servers are serving now

    async def start(self, count: int) -> None:
        for index in range(count):
            server = grpc.aio.server()
            v1.add_RolloutServiceServicer_to_server(FakeRolloutService(index, self), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            self.addresses.append(f"127.0.0.1:{port}")

    def connect(self, target: str | list[str], *, load_balancing: LoadBalancing | None = None) -> Client:
        client = prorl_client.connect(target, load_balancing=load_balancing)
        self.clients.append(client)
        return client

    async def warm_up(self, client: Client) -> None:
        """Call until every server has answered: all of the channel's connections are up,
        so that round_robin takes them in turn from now on."""
        async with asyncio.timeout(10):
            while len(self.get_jobs) < len(self.servers):
                await client.get_job("warm-up")
        self.get_jobs.clear()

    async def stop(self, index: int) -> None:
        """The server goes away: its streams break at once (as when its machine is lost)."""
        self.stopped.add(index)
        await self.servers[index].stop(0)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        for server in self.servers:
            await server.stop(None)


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    cluster = Cluster()
    await cluster.start(3)
    yield cluster
    await cluster.close()
    assert cluster.streaming == 0  # every Watch ended with its client or server


async def test_round_robin_spreads_calls_over_every_server(cluster: Cluster) -> None:
    client = cluster.connect(cluster.addresses)
    async with asyncio.timeout(10):
        for _ in range(30):
            assert (await client.get_job("x")).job_id == "x"

    assert sum(cluster.get_jobs.values()) == 30
    assert set(cluster.get_jobs) == {0, 1, 2}, cluster.get_jobs


async def test_a_multi_address_string_target_with_round_robin_spreads_too(cluster: Cluster) -> None:
    client = cluster.connect(multi_address_target(cluster.addresses), load_balancing="round_robin")
    async with asyncio.timeout(10):
        await client.wait_ready()
        for _ in range(30):
            await client.get_job("x")

    assert set(cluster.get_jobs) == {0, 1, 2}, cluster.get_jobs


async def test_pick_first_over_a_list_sends_every_call_to_one_server(cluster: Cluster) -> None:
    client = cluster.connect(cluster.addresses, load_balancing="pick_first")
    async with asyncio.timeout(10):
        for _ in range(10):
            await client.get_job("x")

    assert list(cluster.get_jobs.values()) == [10]


async def test_a_single_target_still_works(cluster: Cluster) -> None:
    client = cluster.connect(cluster.addresses[1])
    async with asyncio.timeout(10):
        for _ in range(5):
            assert (await client.get_job("y")).job_id == "y"
        await cluster.log.append("queued")
        await cluster.log.append("finished")
        events = [event async for event in client.watch(JOB)]

    assert cluster.get_jobs == Counter({1: 5})
    assert [event.seq for event in events] == [1, 2] and kinds(events) == ["queued", "finished"]


async def test_follow_resumes_on_another_server_when_its_server_goes_away(cluster: Cluster) -> None:
    for kind in ("queued", "phase_started", "model_turn"):
        await cluster.log.append(kind)
    client = cluster.connect(cluster.addresses)
    seen: list[v1.RolloutEvent] = []

    async with asyncio.timeout(20):
        async for event in client.follow(JOB, backoff_s=0.01):
            seen.append(event)
            if event.seq == 3:
                # Its server goes away mid-stream; the job goes on in the shared store.
                await cluster.stop(cluster.watches[0].server)
                for kind in ("tool_call", "tool_result", "finished"):
                    await cluster.log.append(kind)

    assert [event.seq for event in seen] == [1, 2, 3, 4, 5, 6]
    assert kinds(seen) == ["queued", "phase_started", "model_turn", "tool_call", "tool_result", "finished"]
    assert seen[-1].finished.result.reward == 1.0
    first, resumed = cluster.watches
    assert first.after_seq == 0 and first.server in cluster.stopped
    assert resumed.after_seq == 3 and resumed.server not in cluster.stopped


async def test_follow_from_a_given_seq_yields_only_later_events(cluster: Cluster) -> None:
    for kind in ("queued", "phase_started", "evaluation", "finished"):
        await cluster.log.append(kind)
    client = cluster.connect(cluster.addresses)

    async with asyncio.timeout(10):
        seen = [event.seq async for event in client.follow(JOB, after_seq=2)]

    assert seen == [3, 4]
    assert [call.after_seq for call in cluster.watches] == [2]


async def test_follow_counts_only_failures_in_a_row(cluster: Cluster) -> None:
    # Every stream of "flaky" brings one new event and breaks: one retry at a time suffices.
    client = cluster.connect(cluster.addresses)
    await cluster.warm_up(client)

    async with asyncio.timeout(10):
        seen = [event.seq async for event in client.follow("flaky", retries=1, backoff_s=0.01)]

    assert seen == [1, 2, 3, 4, 5]
    assert [call.after_seq for call in cluster.watches] == [0, 1, 2, 3, 4]
    servers = [call.server for call in cluster.watches]
    assert all(a != b for a, b in itertools.pairwise(servers)), servers  # each resumption on another server


async def test_follow_gives_up_after_its_retries(cluster: Cluster) -> None:
    client = cluster.connect(cluster.addresses)

    with pytest.raises(RpcError) as raised:
        async with asyncio.timeout(10):
            async for _ in client.follow("down", retries=2, backoff_s=0.01):
                pass

    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert "unreachable" in raised.value.details
    assert [call.job_id for call in cluster.watches] == ["down"] * 3


async def test_follow_does_not_retry_other_errors(cluster: Cluster) -> None:
    client = cluster.connect(cluster.addresses)

    with pytest.raises(RpcError) as raised:
        async with asyncio.timeout(10):
            async for _ in client.follow("missing", retries=5, backoff_s=0.01):
                pass

    assert raised.value.code == grpc.StatusCode.NOT_FOUND
    assert [call.job_id for call in cluster.watches] == ["missing"]


def test_a_list_becomes_one_multi_address_target() -> None:
    assert multi_address_target(["10.0.0.1:50051", "10.0.0.2:50052"]) == "ipv4:10.0.0.1:50051,10.0.0.2:50052"
    assert multi_address_target(["[::1]:5001", "[fd00::2]:5002"]) == "ipv6:[::1]:5001,[fd00::2]:5002"


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        ([], "no server addresses"),
        (["node1:50051"], "dns:///NAME:PORT"),
        (["10.0.0.1"], "not IP:PORT"),
        (["10.0.0.1:0"], "not IP:PORT"),
        (["::1:5001"], "not IP:PORT"),
        (["10.0.0.1:5001", "[::1]:5001"], "not both"),
    ],
)
def test_a_list_takes_ip_addresses_with_ports(addresses: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Client.connect(addresses)


def test_load_balancing_and_an_own_service_config_do_not_mix() -> None:
    own = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"pick_first": {}}]}))
    with pytest.raises(ValueError, match="not both"):
        Client.connect("127.0.0.1:1", load_balancing="round_robin", options=[own])
    with pytest.raises(ValueError, match="round_robin"):
        Client.connect("127.0.0.1:1", load_balancing="round-robin")  # type: ignore[arg-type]
