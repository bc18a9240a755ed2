"""The scripted fake LLMs: the in-process chat backend in the pool like any backend, and the
HTTP server driven by the same kind of script."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from prorl_server.errors import ContextLengthExceeded, LLMError
from prorl_server.llm.base import ApiToolCall, BackendInfo, Sampling
from prorl_server.llm.openai_chat import OpenAIChatBackend
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.llm.tool_calls import parse_text
from tests.fakes.scripted_llm import (
    ScriptedChatBackend,
    ScriptedLLMServer,
    ScriptedReply,
    api_tool_call,
    tool_call_text,
    turn_index,
    user_prompt,
)

SAMPLING = Sampling(max_tokens=8, temperature=0.0, seed=1)
TOOLS = [{"type": "function", "function": {"name": "finish", "parameters": {}}}]


def conversation(*replies: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
    for reply in replies:
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    return messages


async def test_a_list_script_answers_each_turn_through_the_pool_and_records_requests() -> None:
    backend = ScriptedChatBackend(["thinking", tool_call_text("finish", {"answer": "42"})])
    pool = BackendRouter(health_interval_s=0)
    pool.add(backend)
    session = LLMSession("job", pool)

    first = await session.chat(conversation(), TOOLS, SAMPLING)
    second = await session.chat(conversation(first.text), TOOLS, SAMPLING)

    assert first.text == "thinking" and first.backend_id == "scripted" and first.tool_call_parser == "hermes"
    (call,) = parse_text(second.text, second.tool_call_parser, id_prefix="t1")
    assert (call.name, json.loads(call.arguments_json)) == ("finish", {"answer": "42"})
    assert [request.messages for request in backend.requests] == [conversation(), conversation("thinking")]
    assert backend.requests[0].tools == TOOLS and backend.requests[0].sampling == SAMPLING
    assert backend.in_flight == 0
    await pool.close()
    assert backend.closed


async def test_a_turn_beyond_the_script_fails_as_a_refused_request() -> None:
    backend = ScriptedChatBackend(["only one"])
    with pytest.raises(LLMError, match="no reply for model turn 2") as raised:
        await backend.chat(conversation("only one"), [], SAMPLING)
    assert raised.value.reason == "llm_bad_request"


async def test_a_function_script_sees_the_messages_and_may_call_tools_structurally() -> None:
    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        a, b = re.findall(r"\d+", user_prompt(messages))
        answer = str(int(a) * int(b))
        return ScriptedReply(tool_calls=[api_tool_call("finish", {"answer": answer}, f"c{turn_index(messages)}")])

    backend = ScriptedChatBackend(script, backend_id="calc", max_in_flight=2, weight=3.0)
    result = await backend.chat(conversation(), [], SAMPLING)
    assert result.tool_calls == (ApiToolCall(id="c0", name="finish", arguments_json='{"answer": "42"}'),)
    assert (backend.info.id, backend.info.max_in_flight, backend.info.weight) == ("calc", 2, 3.0)


@pytest.mark.parametrize(
    ("reply", "error", "reason"),
    [
        (ScriptedReply(status=503), LLMError, "llm_unavailable"),
        (ScriptedReply(status=429), LLMError, "llm_unavailable"),
        (ScriptedReply(status=400, error_message="maximum context length is 8"), ContextLengthExceeded, None),
        (ScriptedReply(status=404), LLMError, "llm_bad_request"),
    ],
)
async def test_failures_look_like_an_http_backends(
    reply: ScriptedReply, error: type[Exception], reason: str | None
) -> None:
    backend = ScriptedChatBackend(lambda messages: reply)
    with pytest.raises(error) as raised:
        await backend.chat(conversation(), [], SAMPLING)
    if reason is not None:
        assert getattr(raised.value, "reason", None) == reason


async def test_an_unavailable_fake_is_failed_over_and_readmitted_by_the_health_check() -> None:
    down = ScriptedChatBackend([ScriptedReply(status=503)], backend_id="down")
    up = ScriptedChatBackend(["fine"], backend_id="up")
    pool = BackendRouter(health_interval_s=0)
    pool.add(down)
    pool.add(up)
    result = await LLMSession("job", pool).chat(conversation(), [], SAMPLING)
    assert (result.backend_id, len(down.requests)) == ("up", 1)
    assert [entry.healthy for entry in pool.entries()] == [False, True]
    await pool.check_health()
    assert all(entry.healthy for entry in pool.entries())
    down.healthy = False
    await pool.check_health()
    assert [entry.healthy for entry in pool.entries()] == [False, True]
    await pool.close()


async def test_the_http_server_takes_the_same_list_script() -> None:
    server = ScriptedLLMServer(["one", ScriptedReply("two", finish_reason="length")])
    await server.start()
    backend = OpenAIChatBackend(BackendInfo("b", "openai_chat", server.base_url, "m"), max_retries=0)
    try:
        first = await backend.chat(conversation(), [], SAMPLING)
        second = await backend.chat(conversation("one"), [], SAMPLING)
        assert (first.text, second.text, second.finish_reason) == ("one", "two", "length")
        with pytest.raises(LLMError, match="HTTP 400"):
            await backend.chat(conversation("one", "two"), [], SAMPLING)
    finally:
        await backend.close()
        await server.stop()


def test_one_reply_is_not_a_script() -> None:
    with pytest.raises(TypeError, match="not one reply"):
        ScriptedChatBackend("hello")
