"""End to end with the real embedded model (SmolLM2-135M via llama.cpp) and real sandboxes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_client import v1
from tests import chromium
from tests.conftest import instance_id
from tests.helpers import assert_eventually, math_request

pytestmark = [pytest.mark.e2e, pytest.mark.podman]

QUESTIONS = [
    ("What is 17 + 25?", "42"),
    ("What is 12 * 11?", "132"),
    ("What is 100 - 37?", "63"),
    ("What is 2**10?", "1024"),
]


async def test_four_math_rollouts_on_the_embedded_model(start_server) -> None:
    _, client = await start_server(None)
    (backend,) = await client.list_backends()
    assert backend.id == "embedded" and backend.state.managed

    requests = []
    for index, (question, answer) in enumerate(QUESTIONS):
        request = math_request(question, answer, job_id=f"e2e-{index}", max_turns=3)
        request.sampling.max_tokens = 96
        request.sampling.temperature = 0.7
        requests.append(request)

    events: dict[str, list[v1.RolloutEvent]] = {r.job_id: [] for r in requests}
    async for item in client.rollout_many(requests):
        assert isinstance(item, v1.RolloutEvent), f"rejected: {item}"
        events[item.job_id].append(item)

    for job_id, job_events in events.items():
        result = job_events[-1].finished.result
        assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
        turns = [e.model_turn for e in job_events if e.HasField("model_turn")]
        assert turns, f"{job_id} had no model turn"
        assert all(t.text and t.latency.ToNanoseconds() > 0 and t.backend_id == "embedded" for t in turns)
        # The embedded model reports where a turn's time went: prompt evaluation, then generation.
        for t in turns:
            prefill, decode = t.prefill.ToNanoseconds(), t.decode.ToNanoseconds()
            assert prefill > 0 and decode > 0 and prefill + decode <= t.latency.ToNanoseconds()
        # The result agrees with what was streamed.
        assert result.trajectory.num_turns == len(turns)
        assistant = [m.content for m in result.trajectory.messages if m.role == "assistant"]
        assert assistant == [t.text for t in turns]
        evaluation = next(e.evaluation for e in job_events if e.HasField("evaluation"))
        assert evaluation.reward == result.reward in (0.0, 1.0)
        tool_results = [e for e in job_events if e.HasField("tool_result")]
        assert result.details["format_errors"] >= sum(e.tool_result.error for e in tool_results)
        llm_s = sum(t.latency.ToNanoseconds() for t in turns) / 1e9
        assert result.timing.llm.ToNanoseconds() / 1e9 == pytest.approx(llm_s, abs=1e-3)
        job = await client.get_job(job_id)
        assert job.result == result


def own_seconds(result: v1.RolloutResult) -> float:
    """The job's phases less its wait for a model slot: what its budget counts."""
    timing = result.timing
    phases = sum(d.ToNanoseconds() for d in (timing.init, timing.run, timing.eval))
    return (phases - timing.model_wait.ToNanoseconds()) / 1e9


async def test_six_jobs_on_the_one_cpu_model_share_it_and_no_budget_pays_for_the_wait(start_server) -> None:
    """Six math jobs on the embedded model, whose one slot serves a turn at a time. None ends
    TIMED_OUT for time spent waiting for the model (a job may still use up its budget with
    its own init, tools and model turns), and their turns interleave (a job ending a turn
    queues behind the others): it used to serve whole trajectories one after another, and
    time out the last ones with 0 turns.

    The budget is set from one job run alone first, at 2.5 times its own time (at least
    20 s): each of six jobs waits for about five others' turns, so a budget that counted the
    wait would run out, while the jobs' own time fits on a machine of any speed. The
    sandboxes are warm before the jobs come (the budget covers init too)."""
    warm = {"size": 6, "cpus": 1.0, "memory_mib": 256, "pids_limit": 64}
    _, client = await start_server(None, phases={"init": 6, "run": 6, "eval": 6}, sandbox={"warm_pools": [warm]})

    async def pool_full() -> bool:
        (pool,) = (await client.get_stats()).pools
        return pool.warm == 6

    def request(index: int, budget_s: int) -> v1.RolloutRequest:
        made = math_request(f"What is {index} + 40? Use python.", str(index + 40), job_id=f"share-{index}")
        made.sandbox.cpus, made.sandbox.memory_mib, made.sandbox.pids_limit = 1.0, 256, 64
        made.limits.max_turns = 3
        made.limits.budget.FromSeconds(budget_s)
        made.sampling.max_tokens = 96
        made.sampling.temperature = 0.7
        made.sampling.seed = index
        return made

    await assert_eventually(pool_full, timeout_s=600, message="the warm pool did not fill")
    alone = [e async for e in client.rollout_many([request(99, 1800)])][-1].finished.result
    assert alone.status == v1.JOB_STATUS_SUCCEEDED, alone.failure
    budget_s = max(20, round(2.5 * own_seconds(alone)))
    await assert_eventually(pool_full, timeout_s=600, message="the warm pool did not refill")

    turns: list[tuple[str, v1.ModelTurn]] = []
    results: dict[str, v1.RolloutResult] = {}
    async for item in client.rollout_many([request(index, budget_s) for index in range(6)]):
        assert isinstance(item, v1.RolloutEvent), f"rejected: {item}"
        if item.HasField("model_turn"):
            turns.append((item.job_id, item.model_turn))
        elif item.HasField("finished"):
            results[item.job_id] = item.finished.result

    assert len(results) == 6
    for result in results.values():  # a policy failure for time it spent waiting is what must not happen
        if result.failure.reason == "budget_exceeded":  # only where its own time (init, tools, model) used it up
            assert own_seconds(result) >= budget_s - 0.05, (own_seconds(result), result.failure)
            assert result.timing.model_wait.ToNanoseconds() == 0 or "waiting for a model slot" in result.failure.message
    # The jobs waited for the model (their own bar, not the budget's): six jobs on one slot, so one
    # at least waited longer than all its own time. (Not "longer than the budget": that depends on
    # how the machine's load changed since the job run alone set it, and failed at load 15-30.)
    assert any(r.timing.model_wait.ToNanoseconds() / 1e9 > own_seconds(r) for r in results.values()), [
        (own_seconds(r), r.timing.model_wait.ToNanoseconds() / 1e9) for r in results.values()
    ]
    assert all(turn.model_wait.ToNanoseconds() >= 0 for _, turn in turns)
    # Interleaved: jobs with several turns do not have them back to back in the model's order.
    order = [job for job, _ in turns]
    runs = [job for index, job in enumerate(order) if index == 0 or order[index - 1] != job]
    several = {job for job in order if order.count(job) > 1}
    outcomes = {job: (v1.JobStatus.Name(r.status), r.failure.reason, r.failure.message) for job, r in results.items()}
    assert several and len(runs) > len(set(order)), (order, outcomes)


def test_demo_command_writes_one_line_per_rollout(tmp_path: Path) -> None:
    """The README's demo command, on two tasks."""
    out = tmp_path / "trajectories.jsonl"
    completed = subprocess.run(
        [sys.executable, "-m", "prorl_server", "demo", "--no-reference", "--limit", "2", "--max-turns", "2",
         "--out", str(out), "--set", f"server.instance_id={instance_id('demo')}", "--log-level", "warning"],
        capture_output=True, text=True, timeout=600, cwd="/",
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["task_id"] for line in lines) == ["add-1", "mul-1"]
    assert all(line["status"] == "JOB_STATUS_SUCCEEDED" and line["messages"] for line in lines)
    assert all(line["handler"] == "math" and line["timeline"] for line in lines)
    # The terminal shows progress and the summary; the server's log went to a file.
    assert "rollouts 2/2" in completed.stderr
    assert f"server log: {tmp_path / 'demo_server.log'}" in completed.stderr
    assert (tmp_path / "demo_server.log").is_file()
    assert not [line for line in completed.stderr.splitlines() if "[warning" in line or "[info" in line]
    assert any(row.split()[:3] == ["math", "2", "2"] for row in completed.stderr.splitlines())
    # The trajectory viewer, opened in a real browser: token text from the model's vocabulary.
    page = tmp_path / "trajectories.html"
    assert f"trajectory viewer: file://{page}" in completed.stderr
    dom = chromium.check_page(page, rollouts=2, tokens=True)
    assert "&lt;|im_start|&gt;" in dom and "token ids shown" not in dom


async def test_prorl_run_over_a_mixed_dataset(start_server, tmp_path: Path) -> None:
    """Math, STEM, code and SWE tasks, 2 samples each, on the real model; a rerun does no work."""
    import asyncio

    from prorl_server.datasets.swe import TASKS_DIR, load_task, to_task

    server, client = await start_server(None)
    lines = [
        {"id": "m1", "handler": "math", "instance": {"question": "What is 3 + 4?", "answer": "7"}},
        {
            "id": "s1",
            "handler": "stem",
            "instance": {"question": "H2O is?", "choices": ["water", "salt"], "answer": "A"},
        },
        {
            "id": "c1",
            "handler": "code",
            "instance": {
                "prompt": 'def double(x):\n    """Return 2 * x."""\n',
                "entry_point": "double",
                "test": "def check(f):\n    assert f(2) == 4\n",
            },
        },
        {
            "id": "c2",
            "handler": "code",
            "instance": {"problem": "Print the input back.", "tests": [{"input": "hi\n", "output": "hi\n"}]},
        },
        to_task(load_task(TASKS_DIR / "more-itertools__more-itertools-10.8.0")),
    ]
    for line in lines:  # one short turn each: what is tested is prorl run over every family, not the model
        line["limits"] = {"max_turns": 1}
        line["sampling"] = {"max_tokens": 48}
    tasks = tmp_path / "mixed.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"

    async def prorl_run() -> str:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prorl_client.runner", "run", str(tasks), "--out", str(out),
            "--server", server.address, "--samples", "2",
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await process.communicate()
        assert process.returncode == 0, stderr.decode()[-2000:]
        return stderr.decode()

    await prorl_run()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["task_id"], r["sample"]) for r in records) == sorted(
        (line["id"], sample) for line in lines for sample in (0, 1)
    )
    assert all(r["status"] == "JOB_STATUS_SUCCEEDED" and r["token_ids"] for r in records)
    assert all(len(r["token_ids"]) == len(r["loss_mask"]) == len(r["logprobs"]) for r in records)
    swe = [r for r in records if r["task_id"] == "more-itertools__more-itertools-10.8.0"]
    assert all(r["details"]["verdict"] in {"resolved", "unresolved", "patch_does_not_apply"} for r in swe)
    jobs_before = len((await client.list_jobs(page_size=1000)).jobs)

    stderr = await prorl_run()

    assert len(out.read_text().splitlines()) == 10
    assert len((await client.list_jobs(page_size=1000)).jobs) == jobs_before  # no new job
    assert "nothing to run: every rollout is already done" in stderr
