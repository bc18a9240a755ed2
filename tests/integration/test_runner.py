"""`prorl run`: a dataset through a live server, n samples per task, resumable."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, user_prompt

pytestmark = pytest.mark.podman


def answer_from_question(messages: list[dict[str, Any]]) -> ScriptedReply:
    question = user_prompt(messages)
    return ScriptedReply(tool_call_text("finish", {"answer": question.split()[-1].rstrip("?")}))


async def prorl_run(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_client.runner", "run", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await process.communicate()
    return process.returncode or 0, stderr.decode()


async def test_dataset_runs_n_samples_per_task_and_resumes(scripted_llm, start_server, tmp_path: Path) -> None:
    llm = await scripted_llm(answer_from_question)
    server, _ = await start_server(llm.base_url)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "\n".join(
            [
                json.dumps({"id": "q1", "question": "Repeat 7", "answer": "7"}),
                json.dumps({"id": "q2", "handler": "math", "instance": {"question": "Repeat 9", "answer": "8"}}),
                json.dumps({"id": "q3", "question": "Repeat 5", "answer": "5", "limits": {"max_turns": 2}}),
            ]
        )
        + "\n"
    )
    out = tmp_path / "results.jsonl"

    code, stderr = await prorl_run(str(tasks), "--out", str(out), "--server", server.address, "--samples", "2")

    assert code == 0, stderr
    assert "rollouts 6/6" in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["task_id"], r["sample"]) for r in records) == [
        ("q1", 0), ("q1", 1), ("q2", 0), ("q2", 1), ("q3", 0), ("q3", 1),
    ]  # fmt: skip
    assert {r["task_id"]: r["reward"] for r in records} == {"q1": 1.0, "q2": 0.0, "q3": 1.0}
    assert all(r["status"] == "JOB_STATUS_SUCCEEDED" and r["messages"] for r in records)
    assert all({"token_ids", "loss_mask", "logprobs"} <= r.keys() for r in records)
    requests_after_first_run = len(llm.requests)

    code, stderr = await prorl_run(str(tasks), "--out", str(out), "--server", server.address, "--samples", "2")

    assert code == 0 and len(llm.requests) == requests_after_first_run  # nothing ran again
    assert len(out.read_text().splitlines()) == 6

    # A line cut short by an interrupted run is fetched again: the same job id
    # reattaches to the job the server already finished, so nothing is recomputed.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20] + "\n")
    code, stderr = await prorl_run(str(tasks), "--out", str(out), "--server", server.address, "--samples", "2")
    assert code == 0 and "rollouts 1/1" in stderr
    assert len(llm.requests) == requests_after_first_run
    complete = [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
    assert len({(r["task_id"], r["sample"]) for r in complete}) == 6
