"""The demo's reference runs on real Podman: for a shipped SWE task the gold patch scores 1 and
no change 0, and a right and a wrong math answer score 1 and 0, each submitted by a program
(no model), scored by the same verifiers as the model's rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from prorl_client.runner import read_records, run

from prorl_server.datasets.swe import TASKS_DIR, load_task
from prorl_server.demo import reference_table, reference_tasks

pytestmark = pytest.mark.podman


async def test_reference_runs_score_what_they_must(scripted_llm, start_server, tmp_path: Path) -> None:
    llm = await scripted_llm(["unused: the reference runs call no model"])
    _, client = await start_server(llm.base_url)
    tasks = reference_tasks([load_task(TASKS_DIR / "kjd__idna-3.8")])
    out = tmp_path / "reference.jsonl"

    display = await run(client, tasks, out, run_id="ref", live=False)

    records = read_records(out)
    assert display.done == len(tasks) == 4
    rewards = {r["task_id"]: r["reward"] for r in records}
    assert rewards == {
        "ref-math-right": 1.0,
        "ref-math-wrong": 0.0,
        "ref-kjd__idna-3.8-gold-patch": 1.0,
        "ref-kjd__idna-3.8-no-change": 0.0,
    }, [(r["task_id"], r["status"], r["failure"], r["details"].get("verdict")) for r in records]
    table, ok = reference_table(records, tasks)
    assert ok and table.count(" ok") == 4
    assert not llm.requests
