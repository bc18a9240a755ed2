"""The demo's reference runs (no model: a program submits a known answer) through a real server
on fake sandboxes: the right math answer scores 1, the wrong one 0, and the table calls a run
that scores otherwise WRONG (the demo then fails)."""

from __future__ import annotations

from pathlib import Path

from prorl_client.runner import read_records, run

from prorl_client import Client
from prorl_server.demo import reference_table, reference_tasks
from tests.unit.client.test_cli_run import Served


async def test_the_math_references_score_1_and_0(tmp_path: Path) -> None:
    tasks = reference_tasks([])
    out = tmp_path / "ref.jsonl"
    async with Served() as served:
        async with Client.connect(served.server.address) as client:
            await run(client, tasks, out, run_id="ref", live=False)
        assert not served.backend.requests  # no model turn: the answers are the programs'
    records = read_records(out)
    assert {r["task_id"]: r["reward"] for r in records} == {"ref-math-right": 1.0, "ref-math-wrong": 0.0}
    table, ok = reference_table(records, tasks)
    assert ok, table

    forged = [{**r, "reward": 1.0} for r in records]  # a verifier that gave everything 1
    table, ok = reference_table(forged, tasks)
    assert not ok and "ref-math-wrong" in table and "WRONG" in table
    table, ok = reference_table(records[:1], tasks)  # one never finished
    assert not ok and "did not finish" in table
