"""Task instances refuse fields their family does not know, by name, with the closest known one:
a typo would otherwise change the task silently (`choice` for `choices` made a multiple-choice
STEM task a short-answer one). Dataset columns a family knowingly ignores are accepted."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_server.agents.registry import default_registry
from prorl_server.errors import InvalidArgument

REGISTRY = default_registry(plugins=False)


def refusal(handler: str, instance: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgument) as caught:
        REGISTRY.get(handler).validate(instance)
    return caught.value.message


def test_a_typo_is_named_with_the_field_it_was_meant_to_be() -> None:
    message = refusal("stem", {"question": "Which?", "choice": ["a", "b"], "answer": "A"})
    assert message == "stem instance field 'choice': unknown field; did you mean 'choices'?"
    assert "did you mean 'question'?" in refusal("math", {"questoin": "1+1?", "question": "1+1?", "answer": 2})


def test_an_unknown_field_far_from_any_lists_the_fields() -> None:
    message = refusal("math", {"question": "1+1?", "answer": 2, "difficulty": "easy"})
    assert message == "math instance field 'difficulty': unknown field; the fields are: question, answer"


def test_nested_models_name_the_path() -> None:
    tests = [{"input": "1\n", "output": "1\n", "outptu": "x"}]
    message = refusal("code", {"problem": "echo", "tests": tests})
    assert message.startswith("code instance field 'tests' (at 0.outptu): unknown field; did you mean 'output'?")
    program = {"argv": ["echo", "42"], "timeout": 5}
    message = refusal("command", {"program": program, "verifier": "math", "task": {"question": "q", "answer": 1}})
    assert "'program' (at timeout): unknown field; did you mean 'timeout_s'?" in message


def test_the_judged_task_of_the_command_family_is_checked_too() -> None:
    task = {"question": "q", "answer": 1, "answr": 1}
    message = refusal("command", {"program": {"argv": ["true"]}, "verifier": "math", "task": task})
    assert "answr" in message


def test_dataset_columns_a_family_ignores_are_accepted() -> None:
    swe = {
        "instance_id": "o__r-1",
        "repo": "o/r",
        "base_commit": "a" * 40,
        "problem_statement": "fix it",
        "image": "localhost/prorl-swe-x:latest",
        "FAIL_TO_PASS": ["tests/test_x.py::test_y"],
        "hints_text": "",
        "created_at": "2024-01-01",
        "environment_setup_commit": "b" * 40,
    }
    assert REGISTRY.get("swe").validate(swe).instance_id == "o__r-1"
    assert "did you mean 'repo_dir'?" in refusal("swe", {**swe, "repo_dri": "/x"})
