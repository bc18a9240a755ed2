"""The SQLite job store: finished jobs survive a restart; interrupted ones are reported."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from tests.conftest import make_settings
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.helpers import math_request

pytestmark = pytest.mark.podman


def python_then_finish(messages: list[dict[str, Any]]) -> ScriptedReply:
    if turn_index(messages) == 0:
        return ScriptedReply(tool_call_text("python", {"code": "print(6 * 7)"}))
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


async def test_finished_jobs_survive_a_restart(scripted_llm, podman_url, tmp_path: Path) -> None:
    llm = await scripted_llm(python_then_finish)
    settings = make_settings(
        podman_url, llm.base_url, jobs={"store": True, "store_path": str(tmp_path / "jobs.sqlite")}
    )
    request = math_request("What is 6 * 7?", "42", job_id="durable-1", group_id="g1")
    request.labels["run"] = "a"

    first = ProrlServer(settings)
    await first.start()
    try:
        async with Client.connect(first.address) as client:
            before = [e async for e in client.rollout(request)]
    finally:
        await first.stop()
    assert before[-1].finished.result.reward == 1.0

    second = ProrlServer(settings)
    await second.start()
    try:
        async with Client.connect(second.address) as client:
            job = await client.get_job("durable-1")
            assert job.status == v1.JOB_STATUS_SUCCEEDED and job.result == before[-1].finished.result
            replayed = [e async for e in client.watch("durable-1")]
            assert replayed == before
            tail = [e async for e in client.watch("durable-1", after_seq=before[-2].seq)]
            assert [e.seq for e in tail] == [before[-1].seq]
            listed = await client.list_jobs(labels={"run": "a"}, group_id="g1")
            assert [j.job_id for j in listed.jobs] == ["durable-1"]

            calls = len(llm.requests)
            again = await client.submit(request)  # idempotent across the restart
            assert not again.created and again.job.result == before[-1].finished.result
            streamed = [item async for item in client.rollout_many([request]) if item.HasField("finished")]
            assert [item.finished.result for item in streamed] == [before[-1].finished.result]  # RolloutStream too
            assert len(llm.requests) == calls
            changed = math_request("What is 6 * 8?", "48", job_id="durable-1")
            with pytest.raises(RpcError) as error:
                await client.submit(changed)
            assert error.value.code == grpc.StatusCode.ALREADY_EXISTS

            fresh = [e async for e in client.rollout(math_request("What is 6 * 7?", "42", job_id="durable-2"))]
            assert fresh[-1].finished.result.reward == 1.0
            numbers = [j.job_id for j in (await client.list_jobs()).jobs]
            assert numbers == ["durable-1", "durable-2"]  # new jobs are numbered after the restored ones
    finally:
        await second.stop()


async def test_a_job_running_when_the_server_died_is_reported_interrupted(
    scripted_llm, podman_url, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.sqlite"
    store = SQLiteJobStore(path)
    await store.open()
    crashed = math_request("q", "1", job_id="was-running")
    await store.submitted("was-running", 7, crashed, crashed.SerializeToString(deterministic=True), time.time() - 5)
    await store.close()

    llm = await scripted_llm(python_then_finish)
    server = ProrlServer(make_settings(podman_url, llm.base_url, jobs={"store": True, "store_path": str(path)}))
    await server.start()
    try:
        async with Client.connect(server.address) as client:
            job = await client.get_job("was-running")
            assert job.status == v1.JOB_STATUS_FAILED
            assert job.result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
            assert job.result.failure.reason == "interrupted"
            events = [e async for e in client.watch("was-running")]
            assert events[-1].HasField("finished")
    finally:
        await server.stop()
    # The verdict itself was stored: a second restart reads it back unchanged.
    store = SQLiteJobStore(path)
    await store.open()
    (stored,) = await store.load(retain_s=3600)
    await store.close()
    assert stored.result is not None and stored.result.failure.reason == "interrupted"


async def test_a_job_that_allows_restarts_runs_again_after_a_restart(scripted_llm, podman_url, tmp_path: Path) -> None:
    """retry.max_restarts = 1: the first restart runs the job again (attempt 2), to a real result;
    had it been interrupted once more, the second restart reports it interrupted."""
    path = tmp_path / "jobs.sqlite"
    store = SQLiteJobStore(path)
    await store.open()
    again = math_request("What is 6 * 7?", "42", job_id="rerun-me")
    again.retry.max_restarts = 1
    await store.submitted("rerun-me", 3, again, again.SerializeToString(deterministic=True), time.time() - 5)
    twice = math_request("What is 6 * 7?", "42", job_id="ran-twice")
    twice.retry.max_restarts = 1
    await store.submitted("ran-twice", 4, twice, twice.SerializeToString(deterministic=True), time.time(), attempt=2)
    await store.close()

    llm = await scripted_llm(python_then_finish)
    server = ProrlServer(make_settings(podman_url, llm.base_url, jobs={"store": True, "store_path": str(path)}))
    await server.start()
    try:
        async with Client.connect(server.address) as client:
            events = [e async for e in client.watch("rerun-me")]
            assert events[0].queued.attempt == 2
            assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED
            assert events[-1].finished.result.reward == 1.0
            exhausted = await client.get_job("ran-twice")
            assert exhausted.result.failure.reason == "interrupted"
            # The re-run is idempotent like any job: resubmitting the same request returns it.
            same = await client.submit(again)
            assert not same.created and same.job.result.reward == 1.0
    finally:
        await server.stop()
    store = SQLiteJobStore(path)
    await store.open()
    stored = {item.job_id: item for item in await store.load(retain_s=3600)}
    await store.close()
    assert stored["rerun-me"].attempt == 2 and stored["rerun-me"].result is not None
    assert stored["rerun-me"].result.reward == 1.0


async def test_restarts_need_the_store_and_are_bounded(scripted_llm, start_server) -> None:
    llm = await scripted_llm(python_then_finish)
    _, client = await start_server(llm.base_url)  # runs without the store
    request = math_request("q", "1")
    request.retry.max_restarts = 1
    with pytest.raises(RpcError) as error:
        await client.submit(request)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION and "job store" in error.value.details
    request.retry.max_restarts = 11
    with pytest.raises(RpcError) as error:
        await client.submit(request)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "at most 10" in error.value.details
