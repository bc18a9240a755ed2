"""Three `prorl-server serve` processes on one PostgreSQL: real Podman, real kills.

Each server is its own process with its own instance id and its own rootless
Podman service; they share a throwaway PostgreSQL (tests/postgres.py) and a
scripted fake LLM served over HTTP by the test. These show what a cluster
promises when machines are lost: `kill -9` of a server, its jobs taken over
after the lease, its containers reaped by itself on restart and nobody else's;
and a Go trainer on a round_robin channel that resumes its streams on another
server when its server goes away.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from prorl_client import Client, v1
from tests.conftest import instance_id, server_containers
from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply, tool_call_text, user_prompt
from tests.helpers import ServeProcess, assert_eventually, math_request
from tests.postgres import PostgresCluster, postgres_cluster_fixture, postgres_url_fixture  # noqa: F401

pytestmark = [pytest.mark.podman, pytest.mark.postgres, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LEASE_TTL_S = 6


class Policy:
    """The scripted model: "answer N" finishes with N after `delay_s`; "hold" waits for `release`."""

    def __init__(self, delay_s: float = 0.05) -> None:
        self.delay_s = delay_s
        self.release = asyncio.Event()

    def __call__(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        question = user_prompt(messages)
        numbers = re.findall(r"\d+", question)
        if question.startswith("What is"):  # the Go client's tasks: "What is a + b?"
            total = str(sum(int(n) for n in numbers[:2]))
            return ScriptedReply(tool_call_text("finish", {"answer": total}), delay_s=self.delay_s)
        if question == "hold":
            return ScriptedReply(tool_call_text("finish", {"answer": "42"}), wait_for=self.release)
        return ScriptedReply(tool_call_text("finish", {"answer": numbers[-1]}), delay_s=self.delay_s)


class Fleet:
    """Servers of one cluster, started and killed as processes."""

    def __init__(self, url: str, llm: ScriptedLLMServer, stack: AsyncExitStack) -> None:
        self.url = url
        self.llm = llm
        self.llm_url = llm.base_url
        self.stack = stack
        self.ids: dict[str, str] = {}

    async def start(self, name: str, **extra: Any) -> ServeProcess:
        self.ids.setdefault(name, instance_id(name))
        settings = {
            "server.instance_id": self.ids[name],
            "server.shutdown_grace_s": 0,
            "server.log_level": "warning",
            "jobs.store": self.url,
            "llm.embedded.enabled": "never",
            "llm.backends": json.dumps([{"id": "scripted", "base_url": self.llm_url}]),
            "llm.max_retries": 0,
            "phases.init": 4,
            "phases.run": 4,
            "cluster.claim_slots": 4,
            "cluster.lease_ttl_s": LEASE_TTL_S,
            "cluster.heartbeat_s": 1,
            "cluster.poll_s": 0.5,
            "sandbox.tmp_mib": 64,
            **extra,
        }
        process = ServeProcess(*(f"{key}={value}" for key, value in settings.items()))
        return await self.stack.enter_async_context(process)

    async def held_by(self) -> dict[str, int]:
        """Running jobs per server name, from the store."""
        conn = await asyncpg.connect(self.url)
        try:
            rows = await conn.fetch(
                "SELECT server_id, count(*) AS n FROM jobs WHERE end_time IS NULL AND server_id IS NOT NULL "
                "GROUP BY server_id"
            )
        finally:
            await conn.close()
        names = {server_id: name for name, server_id in self.ids.items()}
        return {names.get(row["server_id"], row["server_id"]): row["n"] for row in rows}

    async def ran_by(self) -> dict[str, int]:
        conn = await asyncpg.connect(self.url)
        try:
            rows = await conn.fetch("SELECT server_id, count(*) AS n FROM jobs GROUP BY server_id")
        finally:
            await conn.close()
        names = {server_id: name for name, server_id in self.ids.items()}
        return {names.get(row["server_id"], str(row["server_id"])): row["n"] for row in rows}


@pytest_asyncio.fixture
async def fleet(postgres_url: str, podman_url: str) -> AsyncIterator[Callable[[Policy], Awaitable[Fleet]]]:
    fleets: list[Fleet] = []
    async with AsyncExitStack() as stack:

        async def start(policy: Policy) -> Fleet:
            llm = ScriptedLLMServer(policy)
            await llm.start()
            stack.push_async_callback(llm.stop)
            stack.callback(policy.release.set)
            fleets.append(Fleet(postgres_url, llm, stack))
            return fleets[-1]

        yield start
    # A server killed and not restarted (a failed test) leaves its sandboxes: remove them.
    for server_id in (server_id for item in fleets for server_id in item.ids.values()):
        for container in server_containers(podman_url, server_id):
            container.remove(force=True)


async def finished_results(client: Client, job_ids: list[str]) -> dict[str, v1.RolloutResult]:
    async def one(job_id: str) -> tuple[str, list[v1.RolloutEvent]]:
        return job_id, [event async for event in client.follow(job_id)]

    results = {}
    for job_id, events in await asyncio.gather(*(one(job_id) for job_id in job_ids)):
        assert [event.seq for event in events] == list(range(1, len(events) + 1)), job_id
        assert sum(event.HasField("finished") for event in events) == 1, job_id
        results[job_id] = events[-1].finished.result
    return results


async def test_300_jobs_submitted_to_one_server_run_on_all_three(
    fleet: Callable[[Policy], Awaitable[Fleet]], podman_url: str
) -> None:
    servers = await fleet(Policy(delay_s=0.3))
    # No server is lost here: a lease long enough that a loaded machine (a heartbeat late by the
    # short lease of the other tests, seen at load 10-36) cannot make one look lost.
    long_lease = {"cluster.lease_ttl_s": 60}
    a, *_ = [await servers.start(name, **long_lease) for name in ("a", "b", "c")]
    requests = [math_request(f"answer {n}", str(n), job_id=f"j{n:03d}") for n in range(300)]

    results: dict[str, v1.RolloutResult] = {}
    async with Client.connect(a.address) as client:
        async for item in client.rollout_many(requests):
            assert not isinstance(item, v1.RolloutRejected), item
            if item.HasField("finished"):
                assert item.job_id not in results, f"{item.job_id} finished twice"
                results[item.job_id] = item.finished.result

    assert len(results) == 300
    wrong = {
        job: (r.status, r.reward)
        for job, r in results.items()
        if (r.status, r.reward) != (v1.JOB_STATUS_SUCCEEDED, 1.0)
    }
    assert not wrong, wrong
    shares = await servers.ran_by()
    assert sorted(shares) == ["a", "b", "c"] and sum(shares.values()) == 300, shares
    assert all(count >= 60 for count in shares.values()), shares  # each at least 20%
    for server_id in servers.ids.values():
        await assert_eventually(lambda sid=server_id: not server_containers(podman_url, sid))


async def test_a_killed_server_loses_no_job_and_reaps_only_its_own_containers(
    fleet: Callable[[Policy], Awaitable[Fleet]], podman_url: str
) -> None:
    policy = Policy()
    servers = await fleet(policy)
    a, b, _c = [await servers.start(name) for name in ("a", "b", "c")]
    client = Client.connect(a.address)
    ids = [f"{'r' if n % 2 else 'n'}{n:02d}" for n in range(12)]  # r..: may run again; n..: may not
    for job_id in ids:
        request = math_request("hold", job_id=job_id)
        request.retry.max_restarts = 1 if job_id.startswith("r") else 0
        await client.submit(request)
    await assert_eventually(lambda: _equals(servers.held_by(), {"a": 4, "b": 4, "c": 4}), message="12 jobs never held")
    on_b = await _jobs_of(servers, "b")
    # Another Podman service's containers show up in this one's list within a moment.
    await assert_eventually(lambda: len(server_containers(podman_url, servers.ids["b"])) == 4)
    b_containers = {container.id for container in server_containers(podman_url, servers.ids["b"])}

    assert b.process is not None
    os.kill(b.process.pid, signal.SIGKILL)
    killed_at = asyncio.get_running_loop().time()
    await b.wait()
    policy.release.set()
    results = await finished_results(client, ids)
    took = asyncio.get_running_loop().time() - killed_at

    for job_id, result in results.items():
        if job_id in on_b and job_id.startswith("n"):
            assert result.status == v1.JOB_STATUS_FAILED and result.failure.reason == "server_lost", result
            assert result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
        else:
            assert (result.status, result.reward) == (v1.JOB_STATUS_SUCCEEDED, 1.0), (job_id, result)
    assert took >= LEASE_TTL_S - 2  # taken over once the lease lapsed, not while b could still run it
    for job_id in on_b:
        job = await client.get_job(job_id)
        attempts = [e.queued.attempt async for e in client.watch(job_id) if e.HasField("queued")]
        assert attempts == ([1, 2] if job_id.startswith("r") else [1]), (job_id, attempts)
        assert job.status in (v1.JOB_STATUS_SUCCEEDED, v1.JOB_STATUS_FAILED)

    # b's containers outlived it; a peer's running sandboxes must survive b's restart.
    assert {container.id for container in server_containers(podman_url, servers.ids["b"])} == b_containers
    policy.release.clear()
    await client.submit(math_request("hold", job_id="survivor"))
    await assert_eventually(lambda: servers.llm.in_flight == 1, message="the survivor was never held")
    holder = next(iter(await servers.held_by()))
    theirs = {container.id for container in server_containers(podman_url, servers.ids[holder])}
    assert theirs

    await servers.start("b")  # the same instance id: it reaps its own leftovers at start

    assert server_containers(podman_url, servers.ids["b"]) == []
    assert theirs <= {container.id for container in server_containers(podman_url, servers.ids[holder])}
    policy.release.set()
    (survivor,) = (await finished_results(client, ["survivor"])).values()
    assert survivor.status == v1.JOB_STATUS_SUCCEEDED
    await client.close()


async def test_a_go_trainer_on_round_robin_resumes_its_streams_when_a_server_goes(
    fleet: Callable[[Policy], Awaitable[Fleet]],
) -> None:
    build = await asyncio.create_subprocess_exec(
        "bash", str(EXAMPLES / "go" / "build.sh"), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await build.communicate()
    assert build.returncode == 0, output.decode()
    servers = await fleet(Policy(delay_s=1.0))
    members = [await servers.start(name) for name in ("a", "b", "c")]
    targets = ",".join(member.address for member in members)
    trainer = await asyncio.create_subprocess_exec(
        str(EXAMPLES / "go" / "bin" / "cluster-client"), "-targets", targets, "-tasks", "12", "-restarts", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert trainer.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(30):
        while len([line for line in seen if " queued" in line]) < 12:
            line = (await trainer.stdout.readline()).decode()
            assert line, "".join(seen)
            seen.append(line)
    stopped = members[2]
    assert stopped.process is not None
    stopped.process.send_signal(signal.SIGTERM)  # its jobs are handed to a peer, its streams break
    async with asyncio.timeout(180):
        rest, _ = await trainer.communicate()
    text = "".join(seen) + rest.decode()

    assert trainer.returncode == 0, text
    rewards = re.findall(r"^reward (\S+) (\S+)$", text, re.MULTILINE)
    assert len(rewards) == 12, text
    resumed = int(re.findall(r"^resumed (\d+)$", text, re.MULTILINE)[-1])
    assert resumed >= 1, text
    for job, _ in rewards:
        seqs = [int(n) for n in re.findall(rf"^{re.escape(job)} #(\d+) ", text, re.MULTILINE)]
        assert seqs == list(range(1, len(seqs) + 1)), (job, seqs)  # each event once, in order, across servers


async def _jobs_of(servers: Fleet, name: str) -> set[str]:
    conn = await asyncpg.connect(servers.url)
    try:
        rows = await conn.fetch("SELECT job_id FROM jobs WHERE server_id = $1 AND end_time IS NULL", servers.ids[name])
    finally:
        await conn.close()
    return {row["job_id"] for row in rows}


async def _equals(value: Awaitable[Any], *expected: Any) -> bool:
    return await value in expected
