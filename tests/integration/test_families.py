"""Each task family end to end with the scripted fake LLM: right answers score 1,
wrong ones 0, malformed tool calls are policy format errors."""

from __future__ import annotations

from typing import Any

import pytest

from prorl_client import v1
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index

pytestmark = pytest.mark.podman

ADD_FUNCTION = {
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}
SUM_PROGRAM = {
    "problem": "Read two integers on one line and print their sum.",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}],
}
FAMILIES = {
    "math": ({"question": "What is 6 * 7?", "answer": "42"}, "42", "41"),
    "stem": (
        {"question": "Which planet do we live on?", "choices": ["Mars", "Earth", "Venus"], "answer": "B"},
        "B",
        "A",
    ),
    "code-function": (ADD_FUNCTION, "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"),
    "code-program": (
        SUM_PROGRAM,
        "a, b = map(int, input().split())\nprint(a + b)\n",
        "a, b = map(int, input().split())\nprint(a * b)\n",
    ),
}


def request(family: str, instance: dict[str, Any]) -> v1.RolloutRequest:
    message = v1.RolloutRequest(handler=family.split("-")[0])
    message.instance.update(instance)
    return message


def finish_with(answer: str, *, malformed_first: bool = False) -> Any:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if malformed_first and turn_index(messages) == 0:
            return ScriptedReply('<tool_call>{"name": "finish", "arguments": {"answer": </tool_call>')
        return ScriptedReply(tool_call_text("finish", {"answer": answer}))

    return script


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_right_wrong_and_malformed(family: str, scripted_llm, start_server) -> None:
    instance, right, wrong = FAMILIES[family]
    for answer, reward, malformed in ((right, 1.0, False), (wrong, 0.0, False), (right, 1.0, True)):
        llm = await scripted_llm(finish_with(answer, malformed_first=malformed))
        _, client = await start_server(llm.base_url)
        events = [e async for e in client.rollout(request(family, instance))]
        result = events[-1].finished.result
        assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
        assert result.reward == reward, (answer, result.details)
        assert result.details["format_errors"] == (1 if malformed else 0)
        if malformed:
            bad = next(e.tool_result for e in events if e.HasField("tool_result"))
            assert bad.error and "not valid JSON" in bad.output


async def test_code_is_judged_in_a_fresh_sandbox(scripted_llm, start_server) -> None:
    """An agent that plants a fake `check` in its own sandbox gains nothing."""

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        if turn_index(messages) == 0:
            return ScriptedReply(
                tool_call_text("bash", {"command": "mkdir -p /tmp/prorl-eval && echo x > /tmp/prorl-eval/planted"})
            )
        return ScriptedReply(tool_call_text("finish", {"answer": "def add(a, b):\n    return 0\n"}))

    llm = await scripted_llm(script)
    _, client = await start_server(llm.base_url)
    events = [e async for e in client.rollout(request("code", ADD_FUNCTION))]
    result = events[-1].finished.result
    assert result.reward == 0.0 and result.details["verdict"] == "fail"
    assert "AssertionError" in result.details["output"]
