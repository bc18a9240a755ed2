"""Weight updates on a REAL vLLM through its own RL API, and the contract of docs/llm.md
("Weight updates and policy versions"): across an update no in-flight episode is dropped
or failed; every sampled token carries the policy version whose weights sampled it; a
turn in flight at the update either completes under the old version (Pause) or is
re-sampled wholly under the new one (Pause with abort_in_flight), and its TurnSpan says
which (`resampled`).

The checkpoints are the served model with its final norm scaled by 1 + k/8 (k = 1..5,
tests/vllm.py make_checkpoint), so each version's log-probs differ from its neighbours'
well beyond bf16 noise. Which weights sampled a turn is then measured, not assumed:
its tokens are re-scored with transformers under the checkpoint of the version it
claims and under the neighbouring ones, and the claimed one must fit best.

A checkpoint vLLM cannot load (a folder that is not there; a half-written one that fails
half-way through vLLM's reload) is refused and vLLM serves its old weights, byte for byte
as vLLM's own checksums (POST /weight_checker) say.

Run always: the refused checkpoints and the aborted turn (minutes together on two cores).
On request: the many jobs across many updates (PRORL_TEST_VLLM_UPDATES, below), whose
re-scoring alone took 10 minutes at 8x2 here.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from prorl_client import Client, RpcError, v1
from tests.integration.test_vllm_token_backend import vllm_backend
from tests.vllm import MODEL, RecordingProxy, VLLMServer, make_checkpoint, make_half_written_checkpoint, rescore

# The first test to use the session's vLLM waits for it to start (minutes on a busy CPU): tests/vllm.py.
pytestmark = [pytest.mark.vllm, pytest.mark.podman, pytest.mark.timeout(2400)]
# The many-jobs run takes long on two cores, so it runs on request: PRORL_TEST_VLLM_UPDATES=JOBSxUPDATES
# (32x5 as the issue asks, 8x2 for a shorter one); the other tests run always.
SCALE = os.environ.get("PRORL_TEST_VLLM_UPDATES", "")
JOBS, UPDATES = (int(n) for n in (SCALE or "32x5").split("x"))
on_request = pytest.mark.skipif(
    not SCALE, reason="many jobs across updates on the real vLLM run on request (PRORL_TEST_VLLM_UPDATES=32x5 or 8x2)"
)
QUESTIONS = [f"What is {a} * {b}?" for a in range(3, 11) for b in range(4, 8)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def checkpoints() -> AsyncIterator[list[Path]]:
    """Version k's weights at index k (0: the served model).

    Not under pytest's basetemp: another pytest run of the same user removes older basetemps
    (it keeps three), and here one did so mid-test, so vLLM was asked to load a folder that was
    gone (vLLM then takes the path for a hub repo id and fails half-way through its reload)."""
    with tempfile.TemporaryDirectory(prefix="prorl-checkpoints-") as name:
        folder = Path(name)
        steps = UPDATES if SCALE else 1  # the tests run always use version 1 only
        made = await asyncio.gather(
            *(asyncio.to_thread(make_checkpoint, MODEL, folder / f"step-{k}", k) for k in range(1, steps + 1))
        )
        yield [MODEL, *made]


@pytest_asyncio.fixture(loop_scope="session")
async def restored(vllm: VLLMServer) -> AsyncIterator[VLLMServer]:
    """The shared vLLM serves the original weights again after the test, whatever it loaded."""
    yield vllm
    await vllm.post("/pause", mode="wait")
    try:
        await vllm.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(MODEL)}})
        await vllm.post("/reset_prefix_cache")
    finally:
        await vllm.post("/resume")
    await vllm.post("/update_weight_version", {"new_version": "default"})


def job(index: int, *, max_turns: int = 3, max_tokens: int = 24) -> v1.RolloutRequest:
    a, b = QUESTIONS[index % len(QUESTIONS)].removeprefix("What is ").removesuffix("?").split(" * ")
    request = v1.RolloutRequest(handler="math", job_id=f"update-{index}")
    request.instance.update({"question": QUESTIONS[index % len(QUESTIONS)], "answer": str(int(a) * int(b))})
    request.sampling.temperature = 1.0
    request.sampling.max_tokens = max_tokens
    request.sampling.seed = index
    request.limits.max_turns = max_turns
    return request


async def aborted_in_vllm(vllm: VLLMServer) -> float:
    """Requests vLLM itself finished as aborted, since it started."""
    text = await vllm.metrics_text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
    )


def version_check(results: list[v1.RolloutResult], checkpoints: list[Path]) -> tuple[int, int, list[float]]:
    """(turns, tokens whose weights are not their turn's version, |Δ| to the claimed version's weights).

    Each job's trajectory is scored once per checkpoint one of its turns claims or neighbours."""
    requests: list[dict[str, Any]] = []
    asked: list[tuple[int, int]] = []  # (result index, version scored)
    for r, result in enumerate(results):
        trajectory = result.trajectory
        versions = {v for span in trajectory.turn_spans for v in (span.policy_version + d for d in (-1, 0, 1))}
        positions = [i for span in trajectory.turn_spans for i in range(span.start, span.end)]
        for version in sorted(v for v in versions if 0 <= v < len(checkpoints)):
            asked.append((r, version))
            requests.append(
                {
                    "model": str(checkpoints[version]),
                    "token_ids": list(trajectory.token_ids),
                    "positions": positions,
                    "temperature": 1.0,
                }
            )
    order = sorted(range(len(requests)), key=lambda i: requests[i]["model"])  # one checkpoint loaded at a time
    by_order = rescore(None, [requests[i] for i in order])
    scored: dict[tuple[int, int], dict[int, float]] = {}
    for i, values in zip(order, by_order, strict=True):
        r, version = asked[i]
        scored[(r, version)] = dict(zip(requests[i]["positions"], values, strict=True))
    turns = wrong = 0
    deltas: list[float] = []
    for r, result in enumerate(results):
        trajectory = result.trajectory
        for span in trajectory.turn_spans:
            turns += 1
            if span.end == span.start:
                continue
            served = trajectory.logprobs[span.start : span.end]
            fit = {
                version: statistics.fmean(
                    abs(a - by_position[i]) for a, i in zip(served, range(span.start, span.end), strict=True)
                )
                for (j, version), by_position in scored.items()
                if j == r and abs(version - span.policy_version) <= 1
            }
            if min(fit, key=lambda v: fit[v]) != span.policy_version:
                wrong += span.end - span.start
            claimed = scored[(r, span.policy_version)]
            deltas.extend(abs(a - claimed[i]) for a, i in zip(served, range(span.start, span.end), strict=True))
    return turns, wrong, deltas


@on_request
async def test_32_jobs_across_5_updates_keep_every_token_on_its_version(
    restored: VLLMServer, checkpoints: list[Path], start_server: Any
) -> None:
    vllm = restored
    _, client = await start_server(
        None, llm={"backends": [vllm_backend(vllm.base_url)], "embedded": {"enabled": "never"}}
    )
    aborted_before = await aborted_in_vllm(vllm)
    finished = 0
    turns_done = 0
    progress = asyncio.Event()

    async def run(index: int) -> v1.RolloutResult:
        nonlocal finished, turns_done
        events = []
        async for event in client.rollout(job(index)):
            events.append(event)
            if event.HasField("model_turn"):
                turns_done += 1
                progress.set()
        finished += 1
        result: v1.RolloutResult = events[-1].finished.result
        return result

    jobs = [asyncio.create_task(run(i)) for i in range(JOBS)]
    # Random moments: after a random number of the run's model turns (at least one per job is
    # sampled, so the last moment still finds jobs running, on a fast machine as on a slow one).
    moments = sorted(random.Random(27).sample(range(2, JOBS - 1), UPDATES))
    aborted = 0
    running_at_update = []
    for version, moment in enumerate(moments, start=1):
        while turns_done < moment:
            progress.clear()
            await progress.wait()
        running_at_update.append(JOBS - finished)
        pause = await client.pause()
        aborted += pause.aborted
        update = await client.update_weights(str(checkpoints[version]), resume=True)
        assert update.policy_version == version and [b.backend_id for b in update.backends] == ["vllm"]
        assert await vllm.weight_version() == str(version)  # vLLM's own record follows the policy version
    results = await asyncio.gather(*jobs)
    aborted_vllm = await aborted_in_vllm(vllm) - aborted_before

    assert all(r.status == v1.JOB_STATUS_SUCCEEDED for r in results), [r.failure for r in results if r.status != 3]
    assert all(n > 0 for n in running_at_update), f"jobs still running at each update: {running_at_update}"
    versions = {span.policy_version for r in results for span in r.trajectory.turn_spans}
    # At least one update landed between two turns (at a small scale, 8x2, the last update may
    # come after every remaining turn was already being sampled: those finish under the old version).
    assert len(versions) >= min(3, UPDATES), f"the updates landed between too few turns: versions {versions}"
    assert not any(span.resampled for r in results for span in r.trajectory.turn_spans)  # nothing was aborted
    turns, wrong, deltas = await asyncio.to_thread(version_check, results, checkpoints)
    tokens = sum(span.end - span.start for r in results for span in r.trajectory.turn_spans)
    print(
        f"\n{JOBS} jobs, {UPDATES} updates (jobs running at each: {running_at_update}): {turns} turns, {tokens} "
        f"sampled tokens over versions {sorted(versions)}; requests aborted: {aborted} (prorl), {aborted_vllm:g} "
        f"(vLLM); tokens with a wrong version: {wrong}; |Δ| to the claimed weights median "
        f"{statistics.median(deltas):.4f}, max {max(deltas):.4f}"
    )
    assert aborted == 0 and aborted_vllm == 0 and wrong == 0


async def test_a_turn_aborted_by_pause_is_resampled_under_the_new_version(
    restored: VLLMServer, checkpoints: list[Path], start_server: Any
) -> None:
    vllm = restored
    _, client = await start_server(
        None, llm={"backends": [vllm_backend(vllm.base_url)], "embedded": {"enabled": "never"}}
    )
    jobs = [asyncio.create_task(_collect(client, job(100 + i, max_turns=2, max_tokens=120))) for i in range(4)]
    for _ in range(5):  # a turn may end between the probe and the pause: then try again
        await _until(lambda: vllm.metrics(), lambda m: m.get("vllm:num_requests_running", 0) >= 1)
        pause = await client.pause(abort_in_flight=True)
        if pause.aborted:
            break
        await client.resume(policy_version=0)  # nothing was aborted: go on under version 0
    assert pause.aborted >= 1
    update = await client.update_weights(str(checkpoints[1]), resume=True)
    assert update.policy_version == 1
    results = await asyncio.gather(*jobs)

    assert all(r.status == v1.JOB_STATUS_SUCCEEDED for r in results), [r.failure for r in results]
    spans = [span for r in results for span in r.trajectory.turn_spans]
    resampled = [span for span in spans if span.resampled]
    assert len(resampled) == pause.aborted  # each aborted turn is marked, and only those
    assert all(span.policy_version == 1 for span in resampled)  # re-sampled wholly under the new weights
    assert all(not span.resampled for span in spans if span.policy_version == 0)
    turns, wrong, deltas = await asyncio.to_thread(version_check, list(results), checkpoints[:2])
    print(
        f"\n{len(results)} jobs, {turns} turns, {pause.aborted} aborted by Pause and re-sampled under version 1; "
        f"tokens with a wrong version: {wrong}; |Δ| to the claimed weights median "
        f"{statistics.median(deltas):.4f}, max {max(deltas):.4f}"
    )
    assert turns == len(spans) and wrong == 0


async def test_a_checkpoint_folder_that_is_not_there_is_refused_before_vllm_is_touched(
    restored: VLLMServer, start_server: Any, tmp_path: Path
) -> None:
    """vLLM runs on this host and serves a folder seen here: a checkpoint folder missing here is
    missing for vLLM too, and is refused without pausing vLLM (through a recording proxy, which
    sees every request the service sends it)."""
    vllm = restored
    proxy = RecordingProxy(vllm)
    await proxy.start()
    try:
        _, client = await start_server(
            None, llm={"backends": [vllm_backend(proxy.base_url)], "embedded": {"enabled": "never"}}
        )
        baseline = await vllm.checksums()
        await client.pause()
        with pytest.raises(RpcError) as raised:
            await client.update_weights(str(tmp_path / "no-such-checkpoint"))
        sent = [e.path for e in proxy.exchanges]
    finally:
        await proxy.stop()
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "no-such-checkpoint" in raised.value.details and "no such folder" in raised.value.details
    assert not {"/pause", "/collective_rpc", "/resume"} & set(sent), sent  # vLLM was not touched
    assert not await vllm.mismatches(baseline) and await vllm.weight_version() == "default"


async def test_a_half_written_checkpoint_is_refused_and_the_old_weights_stay(
    restored: VLLMServer, start_server: Any, tmp_path: Path
) -> None:
    """vLLM loads the first shard into its layers before the second fails (one layer left with
    part of its weights): its previous weights are loaded back, byte for byte as vLLM's own
    checksums say, before vLLM serves again."""
    vllm = restored
    broken = await asyncio.to_thread(make_half_written_checkpoint, MODEL, tmp_path / "half-written")
    _, client = await start_server(
        None, llm={"backends": [vllm_backend(vllm.base_url)], "embedded": {"enabled": "never"}}
    )
    baseline = await vllm.checksums()
    await client.pause()
    with pytest.raises(RpcError) as raised:
        await client.update_weights(str(broken))
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "half-written" in raised.value.details and "previous weights" in raised.value.details
    assert (await client.get_stats()).paused  # generation stays paused at the service
    assert not (await vllm.get_json("/is_paused"))["is_paused"]  # vLLM itself serves again
    assert not await vllm.mismatches(baseline)  # ... the old weights, every byte of them
    assert await vllm.weight_version() == "default"
    await client.resume()
    result = await _collect(client, job(200, max_turns=1))
    assert result.status == v1.JOB_STATUS_SUCCEEDED and list(result.trajectory.turn_policy_versions) == [1]


async def _collect(client: Client, request: v1.RolloutRequest) -> v1.RolloutResult:
    events = [e async for e in client.rollout(request)]
    return events[-1].finished.result


async def _until(probe: Any, check: Any) -> None:
    """Poll `probe` until `check` holds (vLLM tells no event; no fixed sleep decides the outcome)."""
    while not check(await probe()):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
