"""The SQLite job store: finished jobs survive a restart; interrupted ones are reported."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from prorl_client import Client, RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.jobs.store import SQLiteJobStore
from prorl_server.llm.scripted import ScriptedReply, tool_call_text, turn_index
from tests.conftest import make_settings
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
