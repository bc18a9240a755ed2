"""The worked example of docs/handlers.md is code that runs: its family, registered in a
real server (fake sandboxes, scripted LLM, no Podman), scores a right and a wrong answer."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf.struct_pb2 import Struct

from prorl_client import Client, RpcError, v1
from prorl_server.agents.registry import HandlerRegistry
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt
from tests.unit.docs.handlers_md import example_module as handlers_example


def example_module() -> types.ModuleType:
    return handlers_example("prorl_server/agents/shell.py", "shell_example")


def policy(messages: list[dict[str, Any]]) -> ScriptedReply:
    """Answers `printf hello` for "print hello", and a wrong command otherwise."""
    command = "printf hello" if "print hello" in user_prompt(messages) else "printf nope"
    return ScriptedReply(tool_call_text("finish", {"answer": command}))


@pytest_asyncio.fixture
async def client() -> AsyncIterator[Client]:
    shell = example_module().ShellHandler()
    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": {"host": "127.0.0.1", "port": 0},
            "jobs": {"store": False},
            "llm": {"embedded": {"enabled": "never"}},
        },
    )
    provider = FakeSandboxProvider(instance_id="docs-example")
    server = ProrlServer(
        settings,
        registry=HandlerRegistry([shell]),
        sandbox_provider=provider,
        backends=[ScriptedChatBackend(policy)],
    )
    await server.start()
    try:
        async with Client.connect(server.address) as connected:
            yield connected
    finally:
        await server.stop()
    assert provider.busy == 0


def shell_request(goal: str, expected: str) -> v1.RolloutRequest:
    instance = Struct()
    instance.update({"goal": goal, "expected": expected})
    return v1.RolloutRequest(handler="shell", instance=instance)


async def result_of(client: Client, request: v1.RolloutRequest) -> v1.RolloutResult:
    async for event in client.rollout(request):
        if event.HasField("finished"):
            return event.finished.result
    raise AssertionError("the stream ended without a finished event")


async def test_the_documented_family_scores_right_and_wrong_answers(client: Client) -> None:
    right = await result_of(client, shell_request("print hello", "hello"))
    assert right.status == v1.JOB_STATUS_SUCCEEDED and right.reward == 1.0
    assert right.details["output"] == "hello"
    wrong = await result_of(client, shell_request("print goodbye", "goodbye"))
    assert wrong.status == v1.JOB_STATUS_SUCCEEDED and wrong.reward == 0.0


async def test_its_instance_model_names_a_bad_field(client: Client) -> None:
    instance = Struct()
    instance.update({"expected": "x"})
    with pytest.raises(RpcError) as error:
        await client.submit(v1.RolloutRequest(handler="shell", instance=instance))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "shell instance field 'goal'" in error.value.details
