"""Cancel is idempotent and cannot wedge a job: many concurrent Cancels, at
random moments (queued, mid-run, during evaluation, during cleanup), and every
job still ends with its `finished` event, stored, every stream ended and no
container left."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from prorl_client import v1
from prorl_server.jobs.record import FINISHED_STATUSES
from prorl_server.jobs.sqlite_store import SQLiteJobStore
from tests.conftest import job_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index, user_prompt
from tests.helpers import assert_eventually, kinds, math_request

pytestmark = pytest.mark.podman

JOBS = 50
CANCELS_PER_JOB = 2


def sleep_then_answer(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Turn 0 sleeps for as long as the question says; turn 1 answers."""
    if turn_index(messages) == 0:
        seconds = user_prompt(messages).split("sleep ")[1].split()[0]
        return ScriptedReply(tool_call_text("bash", {"command": f"sleep {seconds}"}))
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


async def test_concurrent_cancels_at_random_moments_end_every_job(scripted_llm, start_server, podman_url, tmp_path):
    rng = random.Random(11)
    store_path = tmp_path / "jobs.sqlite"
    llm = await scripted_llm(sleep_then_answer)
    _, client = await start_server(
        llm.base_url,
        jobs={"store": True, "store_path": str(store_path)},
        phases={"init": 8, "run": 8, "eval": 8},
    )
    job_ids = [f"storm-{i}" for i in range(JOBS)]
    for job_id in job_ids:
        sleep_s = rng.choice([0, 0.2, 1, 3])
        await client.submit(math_request(f"Please sleep {sleep_s} then answer 6 * 7", "42", job_id=job_id))

    async def follow(job_id: str) -> list[v1.RolloutEvent]:
        async with asyncio.timeout(120):
            return [event async for event in client.watch(job_id)]

    async def cancel_later(job_id: str, delay_s: float) -> v1.Job:
        await asyncio.sleep(delay_s)
        return await client.cancel(job_id, reason=f"storm after {delay_s:.2f}s")

    watchers = [asyncio.ensure_future(follow(job_id)) for job_id in job_ids]
    cancels = [cancel_later(job_id, rng.uniform(0, 6)) for job_id in job_ids for _ in range(CANCELS_PER_JOB)]
    answers = await asyncio.gather(*cancels)
    streams = await asyncio.gather(*watchers)

    assert len(answers) == JOBS * CANCELS_PER_JOB
    assert all(job.status in FINISHED_STATUSES for job in answers), [v1.JobStatus.Name(j.status) for j in answers]
    statuses: dict[str, int] = {}
    for job_id, events in zip(job_ids, streams, strict=True):
        assert kinds(events).count("finished") == 1 and kinds(events)[-1] == "finished", (job_id, kinds(events))
        assert [event.seq for event in events] == list(range(1, len(events) + 1))
        result = events[-1].finished.result
        statuses[job_id] = result.status
        if result.status == v1.JOB_STATUS_CANCELLED:
            assert result.failure.reason == "cancelled" and result.failure.message.startswith("storm after")
        else:  # it had finished before any cancel reached it: its own outcome stands
            assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0
        # No leak: the container goes, if not before the finished event, soon after (a loaded
        # machine's Podman removed one a moment after it).
        await assert_eventually(
            lambda job_id=job_id: not job_containers(podman_url, job_id), timeout_s=120, message=job_id
        )
    # The storm hit jobs at different moments: some were cancelled, some had finished.
    assert v1.JOB_STATUS_CANCELLED in statuses.values()

    store = SQLiteJobStore(store_path)
    await store.open()
    try:
        stored = {item.job_id: item for item in await store.load(retain_s=3600)}
    finally:
        await store.close()
    assert set(stored) == set(job_ids)
    for job_id, item in stored.items():
        assert item.result is not None and item.status == statuses[job_id], job_id


async def test_two_cancels_during_cleanup_keep_the_real_outcome(scripted_llm, start_server, podman_url) -> None:
    """Cancels that land after evaluation, while the sandbox is being removed,
    leave the job's own result and its finished event in place."""
    llm = await scripted_llm(sleep_then_answer)
    _, client = await start_server(llm.base_url)
    job_id = "cleanup-cancel"
    events: list[v1.RolloutEvent] = []
    cancels: list[asyncio.Future[v1.Job]] = []
    async with asyncio.timeout(60):
        async for event in client.rollout(math_request("Please sleep 0 then answer", "42", job_id=job_id)):
            events.append(event)
            if event.HasField("evaluation"):
                cancels = [asyncio.ensure_future(client.cancel(job_id)) for _ in range(2)]
    answers = await asyncio.gather(*cancels)
    assert kinds(events)[-2:] == ["evaluation", "finished"]
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED and result.reward == 1.0
    assert all(job.status == v1.JOB_STATUS_SUCCEEDED for job in answers)
    await assert_eventually(lambda: not job_containers(podman_url, job_id), timeout_s=120, message=job_id)
