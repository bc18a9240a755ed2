"""The judged family of docs/handlers.md ("A judged reward in any family") is code that runs:
registered in a real server (fake sandboxes, a scripted policy and a scripted judge), its
reward is half its own check and half the judge's."""

from __future__ import annotations

import types
from typing import Any

import pytest

from prorl_client import Client, v1
from prorl_server.agents.registry import HandlerRegistry
from prorl_server.app import ProrlServer
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text
from tests.helpers import server_settings
from tests.unit.docs.handlers_md import example_module as handlers_example


def example_module() -> types.ModuleType:
    return handlers_example("prorl_server/agents/explained.py", "explained_example")


def grader(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Gives 10 to an answer with "because" in it, else 0."""
    answer = messages[1]["content"].rsplit("<<<ANSWER", 1)[1]
    return ScriptedReply(f"explained: {10 if 'because' in answer else 0}")


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("42, because 6 * 7 = 42.", 1.0), ("42", 0.5), ("41, because I guessed.", 0.5), ("41", 0.0)],
)
async def test_the_documented_judged_family_runs(answer: str, reward: float) -> None:
    handler = example_module().ExplainedHandler()
    settings = server_settings("explained")
    policy = ScriptedChatBackend([tool_call_text("finish", {"answer": answer})])
    judge = ScriptedChatBackend(grader, backend_id="judge")
    provider = FakeSandboxProvider(instance_id=instance_id("explained"))
    server = ProrlServer(
        settings,
        registry=HandlerRegistry([handler]),
        sandbox_provider=provider,
        backends=[policy],
        judge_backends=[judge],
    )
    await server.start()
    try:
        async with Client.connect(server.address) as client:
            request = v1.RolloutRequest(handler="explained")
            request.instance.update({"question": "What is 6 * 7?", "answer": "42"})
            result = None
            async for event in client.rollout(request):
                if event.HasField("finished"):
                    result = event.finished.result
    finally:
        await server.stop()
    assert result is not None and result.status == v1.JOB_STATUS_SUCCEEDED, result
    assert result.reward == reward
    assert result.details["verdict"] == "judged" and len(judge.requests) == 1
