"""Hostile answers cost only their own jobs: the server keeps answering, right answers beside
them score 1, and the server's memory comes back.

A real gRPC server on port 0 (in this process, so its RSS is this process's), the fake sandbox
provider (the real in-sandbox runtime as local processes) and a scripted policy that finishes
at once with the answer its question names. 20 jobs answer `\\boxed{9^{9^{8}}}` (sympy
computes for minutes on it), submitted together with right math and STEM answers. Before the
checker processes, one such job blocked the event loop for a minute (GetStats answered after
61 s) and the right answers beside six of them scored 0 ("verification took longer than
20s"), with the server's RSS at 742 MiB from 135.

GetStats is called every 50 ms while the batch runs; its latency bound (2 s) is one that a
loaded 2-core machine meets with room, against the 61 s of a blocked loop; the measured
figures are printed (the benchmark, bench/verification.py, puts them in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.verifiers import checker_pool
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt

pytestmark = pytest.mark.slow

HOSTILE = "\\boxed{9^{9^{8}}}"
HOSTILE_JOBS = 20
STATS_LATENCY_BOUND_S = 2.0
RSS_SLACK_MIB = 50.0
ANSWER_PREFIX = "Answer exactly: "


def answer_from_question(messages: list[dict[str, Any]]) -> ScriptedReply:
    """The policy: finish at once with what the question says to answer."""
    answer = user_prompt(messages).split(ANSWER_PREFIX, 1)[1]
    return ScriptedReply(tool_call_text("finish", {"answer": answer}))


def request(job_id: str, handler: str, gold: Any, answer: str) -> v1.RolloutRequest:
    job = v1.RolloutRequest(job_id=job_id, handler=handler)
    job.instance.update({"question": f"{ANSWER_PREFIX}{answer}", "answer": gold})
    return job


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


@pytest_asyncio.fixture
async def client(fake_provider: FakeSandboxProvider) -> AsyncIterator[Client]:
    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": instance_id("verify"), "shutdown_grace_s": 0, "log_level": "error"},
            "jobs": {"store": False},
            "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
            "phases": {"eval": 64},
            "verifier": {"processes": 4, "time_limit_s": 5.0},
        },
    )
    prorl = ProrlServer(settings, sandbox_provider=fake_provider, backends=[ScriptedChatBackend(answer_from_question)])
    await prorl.start()
    connected = Client.connect(prorl.address)
    try:
        yield connected
    finally:
        await connected.close()
        await prorl.stop()


async def run_all(client: Client, requests: list[v1.RolloutRequest]) -> dict[str, v1.RolloutResult]:
    results: dict[str, v1.RolloutResult] = {}
    async for event in client.rollout_many(requests):
        assert not isinstance(event, v1.RolloutRejected), event
        if event.HasField("finished"):
            results[event.job_id] = event.finished.result
    return results


async def sample_stats(client: Client, latencies: list[float], done: asyncio.Event) -> None:
    while not done.is_set():
        began = time.perf_counter()
        await client.get_stats()
        latencies.append(time.perf_counter() - began)
        await asyncio.sleep(0.05)


async def test_hostile_answers_block_neither_the_server_nor_right_answers(client: Client) -> None:
    # Warm up: a checker process started, one job of each family through, then the baseline.
    warm = await run_all(client, [request("warm-math", "math", 42, "42"), request("warm-stem", "stem", "1.0", "1")])
    assert [result.reward for result in warm.values()] == [1.0, 1.0], warm
    baseline_mib = rss_mib()
    pool = checker_pool.shared_pool()
    killed_before = pool.killed

    hostile = [request(f"hostile-{i}", "math", 42, HOSTILE) for i in range(HOSTILE_JOBS)]
    right = [request(f"right-math-{i}", "math", 42, "42") for i in range(3)]
    right += [request(f"right-stem-{i}", "stem", 6.626e-34, "6.63e-34 J s") for i in range(3)]
    latencies: list[float] = []
    done = asyncio.Event()
    sampler = asyncio.create_task(sample_stats(client, latencies, done))
    try:
        results = await run_all(client, hostile + right)
    finally:
        done.set()
        await sampler

    for job in right:
        result = results[job.job_id]
        assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0, (job.job_id, result.failure)
    for job in hostile:
        result = results[job.job_id]
        assert result.status == v1.JOB_STATUS_FAILED and result.reward == 0.0, (job.job_id, result)
        failure = result.failure
        assert (failure.kind, failure.phase, failure.reason) == (
            v1.FAILURE_KIND_POLICY,
            v1.PHASE_EVAL,
            "verification_timeout",
        ), failure
        assert "took longer than 5s" in failure.message
    assert pool.killed - killed_before == HOSTILE_JOBS  # each hostile check's process killed, none left computing

    ordered = sorted(latencies)
    p50, worst = ordered[len(ordered) // 2], ordered[-1]
    await asyncio.sleep(0)  # let the reaping of the last killed processes run
    end_mib = rss_mib()
    print(
        f"\nGetStats during {HOSTILE_JOBS} hostile verifications: {len(latencies)} calls, "
        f"p50 {p50 * 1e3:.1f} ms, max {worst * 1e3:.1f} ms; server RSS {baseline_mib:.0f} MiB -> {end_mib:.0f} MiB"
    )
    assert len(latencies) >= 10, "the batch ended before GetStats was sampled"
    assert worst < STATS_LATENCY_BOUND_S, f"GetStats took {worst:.2f}s while answers were verified"
    assert end_mib <= baseline_mib + RSS_SLACK_MIB, f"server RSS {baseline_mib:.0f} -> {end_mib:.0f} MiB"
