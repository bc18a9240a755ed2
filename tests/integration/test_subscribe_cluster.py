"""Subscribe on servers that share one PostgreSQL store: the feed is the cluster's, whichever
server ran a job and whichever server a consumer is connected to. Real servers on real ports,
the real client, a real PostgreSQL (tests/postgres.py); fake sandboxes and scripted models
(tests/integration/test_cluster.py's Member)."""

# ruff: noqa: F811
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prorl_client import Client, v1
from tests.helpers import math_request
from tests.integration.test_cluster import (
    Cluster,
    Member,
    cluster,  # noqa: F401  (a fixture: F811 below is its use)
)
from tests.postgres import postgres_cluster_fixture, postgres_url_fixture  # noqa: F401

pytestmark = pytest.mark.postgres

JOBS = 200


def job(index: int) -> v1.RolloutRequest:
    """Half the jobs are labelled run=x, every third is in group g; half answer right."""
    answer = "42" if index % 2 else "7"
    request = math_request(f"What is it? {answer}", "42", job_id=f"job-{index:03d}")
    request.labels["run"] = "x" if index % 2 == 0 else "y"
    if index % 3 == 0:
        request.group_id = "g"
    return request


async def read(stream: AsyncIterator[v1.FeedEvent], out: list[v1.FeedEvent], done: Any) -> None:
    async for response in stream:
        out.append(response)
        if done(out):
            return


def events(responses: list[v1.FeedEvent]) -> list[v1.RolloutEvent]:
    return [response.event for response in responses if response.HasField("event")]


async def test_two_consumers_on_two_servers_get_exactly_their_events_of_200_jobs(cluster: Cluster) -> None:
    a, b = await cluster("a"), await cluster("b")
    front = await cluster("f", run_jobs=False)
    finished_x: list[v1.FeedEvent] = []
    group_g: list[v1.FeedEvent] = []
    x_jobs = {job(index).job_id for index in range(JOBS) if index % 2 == 0}
    g_jobs = {job(index).job_id for index in range(JOBS) if index % 3 == 0}
    stream_x = front.rpc.subscribe(labels={"run": "x"}, event_kinds=["finished"])
    stream_g = a.rpc.subscribe(group_ids=["g"])
    await anext(stream_x), await anext(stream_g)  # both follow from now, before any job

    def all_finished(wanted: set[str]) -> Any:
        return lambda seen: {e.job_id for e in events(seen) if e.HasField("finished")} >= wanted

    readers = [
        asyncio.ensure_future(read(stream_x, finished_x, all_finished(x_jobs))),
        asyncio.ensure_future(read(stream_g, group_g, all_finished(g_jobs))),
    ]
    clients = [a.rpc, b.rpc, front.rpc]
    await asyncio.gather(*(clients[index % 3].submit(job(index)) for index in range(JOBS)))
    await asyncio.wait_for(asyncio.gather(*readers), 240)
    await stream_x.aclose()
    await stream_g.aclose()

    # the finished events of run=x: each job once, with the result GetJob gives
    got_x = events(finished_x)
    assert sorted(event.job_id for event in got_x) == sorted(x_jobs)
    for event in got_x:
        stored = await b.rpc.get_job(event.job_id)
        assert event.finished.result == stored.result
    assert {event.finished.result.reward for event in got_x} == {0.0}  # run=x asked 7, not 42
    # every event of group g's jobs: exactly each job's log, in its order, nothing else
    got_g = events(group_g)
    assert {event.job_id for event in got_g} == g_jobs
    for job_id in g_jobs:
        logged = [event async for event in front.rpc.watch(job_id)]
        assert [event for event in got_g if event.job_id == job_id] == logged
    ran_on = {member.id for member in (a, b) if member.claimed() > 0}
    assert len(ran_on) == 2  # both servers' jobs reached both consumers


async def test_a_cursor_from_one_server_resumes_on_another(cluster: Cluster) -> None:
    a, b = await cluster("a"), await cluster("b")
    await asyncio.gather(*(a.rpc.submit(job(index)) for index in range(20)))
    everything: list[v1.FeedEvent] = []
    twenty = lambda seen: sum(e.HasField("finished") for e in events(seen)) >= 20  # noqa: E731
    await asyncio.wait_for(read(a.rpc.subscribe(after_cursor="oldest"), everything, twenty), 60)
    cut = len(everything) // 2
    rest: list[v1.FeedEvent] = []
    wanted = len(events(everything[cut + 1 :]))
    await asyncio.wait_for(
        read(b.rpc.subscribe(after_cursor=everything[cut].cursor), rest, lambda seen: len(events(seen)) >= wanted),
        60,
    )
    assert events(everything[: cut + 1]) + events(rest) == events(everything)


async def test_a_consumer_follows_the_cluster_across_a_server_restart(cluster: Cluster, postgres_url: str) -> None:
    a, b = await cluster("a"), await cluster("b")
    multi = Client.connect([a.server.address, b.server.address], load_balancing="round_robin")
    try:
        seen: list[v1.FeedEvent] = []
        stream = multi.follow_feed(event_kinds=["finished"], backoff_s=0.05)
        await anext(stream)
        await asyncio.gather(*(a.rpc.submit(job(index)) for index in range(10)))

        def finished(count: int) -> Any:
            return lambda got: len(events(got)) >= count

        await asyncio.wait_for(read(stream, seen, finished(10)), 60)
        restarted = await restart(a)
        await asyncio.gather(*(restarted.rpc.submit(job(index)) for index in range(10, 20)))
        await asyncio.wait_for(read(stream, seen, finished(20)), 60)
        await stream.aclose()
        ids = [event.job_id for event in events(seen)]
        assert sorted(ids) == sorted(job(index).job_id for index in range(20)) and len(set(ids)) == 20
    finally:
        await multi.close()


async def restart(member: Member) -> Member:
    """Stop a server and start it again on the same port, the same store."""
    port = int(member.server.address.rsplit(":", 1)[1])
    await member.stop()
    member.server = type(member.server)(
        member.server.settings.model_copy(
            update={"server": member.server.settings.server.model_copy(update={"port": port})}
        ),
        sandbox_provider=member.provider,
        backends=[member.backend],
    )
    return await member.start()
