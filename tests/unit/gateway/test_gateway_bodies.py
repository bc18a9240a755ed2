"""The gateway's 400s for malformed request bodies: the message names the field by its path and says
what it must be, in the same words whichever reader (hand-written or pydantic) checks the body."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prorl_server.gateway.anthropic_messages import handle_messages
from prorl_server.gateway.common import ChatTurns, GatewayError
from prorl_server.gateway.google_generate import handle_count_tokens, handle_generate
from prorl_server.gateway.openai_chat import handle_chat_completions
from prorl_server.gateway.openai_responses import handle_responses
from prorl_server.llm.base import ChatResult, Sampling

USER = {"role": "user", "content": "Hi"}
SAMPLING = Sampling(max_tokens=16, temperature=1.0)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


async def _never(*_: Any) -> ChatResult:
    raise AssertionError("a malformed request must not reach the model")


async def _refusal(handle: Any, body: dict[str, Any], **where: str) -> tuple[int, str | None, str]:
    """(status, param, message) of the error `handle` answers `body` with, the model never asked."""
    with pytest.raises(GatewayError) as refused:
        await handle(ChatTurns(_never, model="m", default_sampling=SAMPLING), body, **where)
    return refused.value.status, refused.value.param, refused.value.message


def _recording(seen: list[tuple[list[Any], list[Any], Sampling]]) -> Any:
    """A chat that answers "ok" and keeps each call's (messages, tools, sampling) in `seen`."""

    async def chat(messages: Any, tools: Any, sampling: Sampling) -> ChatResult:
        seen.append((list(messages), list(tools), sampling))
        return ChatResult(text="ok", finish_reason="stop", prompt_tokens=1, completion_tokens=1)

    return chat


CHAT_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({}, "messages", "messages: this field is required"),
    ({"messages": "hi"}, "messages", "messages must be an array, not a string"),
    ({"messages": [USER, 5]}, "messages[1]", "messages[1] must be an object, not a number"),
    ({"messages": [USER, {"content": "x"}]}, "messages[1].role", "messages[1].role: this field is required"),
    ({"messages": [{"role": 1}]}, "messages[0].role", "messages[0].role must be a string, not a number"),
    ({"messages": [{"role": "bot"}]}, "messages[0].role", "messages[0].role: unknown role 'bot'"),
    (
        {"messages": [USER, USER, {"role": "user", "content": 3}]},
        "messages[2].content",
        "messages[2].content must be a string or an array of content parts, not a number",
    ),
    (
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages[0].tool_call_id",
        "messages[0].tool_call_id: this field is required",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": 3}}]}]},
        "messages[0].tool_calls[0].function.name",
        "messages[0].tool_calls[0].function.name: this field is required",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}]},
        "messages[0].tool_calls[0].function.arguments",
        "messages[0].tool_calls[0].function.arguments must be a string",
    ),
    (
        {"messages": [USER], "tools": [{"type": "function", "function": {"name": 7}}]},
        "tools[0].function.name",
        "tools[0].function.name must be a string, not a number",
    ),
    (
        {"messages": [USER], "tools": [{"type": "function"}]},
        "tools[0].function",
        "tools[0].function: this field is required",
    ),
    (
        {"messages": [USER], "tools": [TOOL], "tool_choice": {"type": "function", "function": {}}},
        "tool_choice.function.name",
        "tool_choice.function.name: this field is required",
    ),
    ({"messages": [USER], "temperature": 3}, "temperature", "temperature must be between 0.0 and 2.0, not 3"),
    ({"messages": [USER], "temperature": True}, "temperature", "temperature must be a number, not a boolean"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, not 0"),
    ({"messages": [USER], "max_tokens": 1.5}, "max_tokens", "max_tokens must be an integer, not a number"),
    ({"messages": [USER], "stop": [1]}, "stop", "stop must be a string or an array of strings, not an array"),
    ({"messages": [USER], "stream": "yes"}, "stream", "stream must be a boolean, not a string"),
    (
        {"messages": [USER], "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "stream_options.include_usage must be a boolean, not a number",
    ),
    (
        {"messages": [USER], "chat_template_kwargs": []},
        "chat_template_kwargs",
        "chat_template_kwargs must be an object, not an array",
    ),
    ({"messages": [USER], "model": 5}, "model", "model must be a string, not a number"),
]


@pytest.mark.parametrize(("body", "param", "message"), CHAT_CASES)
async def test_chat_completions_refusals(body: dict[str, Any], param: str, message: str) -> None:
    assert await _refusal(handle_chat_completions, body) == (400, param, message)


async def test_chat_completions_nulls_and_unknown_fields_are_absent() -> None:
    """A null is absent and an unknown field is ignored: the request reaches the model."""
    seen: list[Any] = []

    body = {
        "messages": [{**USER, "name": None, "cache_control": {"x": 1}}],
        "temperature": None,
        "tools": None,
        "stream": None,
        "stop": None,
        "logit_bias": {"1": 2},
        "user": "u",
    }
    response = await handle_chat_completions(ChatTurns(_recording(seen), model="m", default_sampling=SAMPLING), body)
    assert response.status == 200
    [(messages, tools, _)] = seen
    assert messages == [{"role": "user", "content": "Hi"}] and tools == []


ANTHROPIC_USER = {"role": "user", "content": "Hi"}
ANTHROPIC_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": [ANTHROPIC_USER]}, "max_tokens", "max_tokens: this field is required"),
    ({"max_tokens": 0, "messages": [ANTHROPIC_USER]}, "max_tokens", "max_tokens must be at least 1, not 0"),
    ({"max_tokens": 5}, "messages", "messages: this field is required"),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER, {"role": "user"}]},
        "messages[1].content",
        "messages[1].content: this field is required",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER, {"role": "user", "content": None}]},
        "messages[1].content",
        "messages[1].content: this field is required",
    ),
    ({"max_tokens": 5, "messages": [{"content": "x"}]}, "messages[0].role", "messages[0].role: this field is required"),
    (
        {"max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
        "messages[0].role",
        "messages[0].role must be 'user', 'assistant' or 'system', not 'bot'",
    ),
    (
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        "messages[0].content[0].tool_use_id",
        "messages[0].content[0].tool_use_id: this field is required",
    ),
    (
        {
            "max_tokens": 5,
            "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "c", "input": 1}]}],
        },
        "messages[0].content[0].input",
        "messages[0].content[0].input must be an object",
    ),
    (
        {"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "c"}]}]},
        "messages[0].content[0].name",
        "messages[0].content[0].name: this field is required",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER], "tools": [{"description": "d"}]},
        "tools[0].name",
        "tools[0].name: this field is required",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER], "tools": [{"name": "f"}], "tool_choice": {"type": "tool"}},
        "tool_choice.name",
        "tool_choice.name: this field is required",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER], "tool_choice": "auto"},
        "tool_choice",
        "tool_choice must be an object, not a string",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER], "stop_sequences": "x"},
        "stop_sequences",
        "stop_sequences must be an array, not a string",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER], "stop_sequences": [1]},
        "stop_sequences",
        "stop_sequences must be an array of strings",
    ),
    (
        {"max_tokens": 5, "messages": [ANTHROPIC_USER], "temperature": 1.5},
        "temperature",
        "temperature must be between 0.0 and 1.0, not 1.5",
    ),
]


@pytest.mark.parametrize(("body", "param", "message"), ANTHROPIC_CASES)
async def test_anthropic_messages_refusals(body: dict[str, Any], param: str, message: str) -> None:
    assert await _refusal(handle_messages, body) == (400, param, message)


async def test_anthropic_server_tools_are_left_out_whatever_they_hold() -> None:
    seen: list[Any] = []

    body = {
        "max_tokens": 5,
        "messages": [ANTHROPIC_USER],
        "tools": [{"type": "web_search_20250305", "name": 3}, {"name": "f", "input_schema": None}],
        "thinking": {"type": "enabled"},
        "temperature": None,
    }
    response = await handle_messages(ChatTurns(_recording(seen), model="m", default_sampling=SAMPLING), body)
    assert response.status == 200
    assert [tool["function"]["name"] for tool in seen[0][1]] == ["f"]


GOOGLE_USER = {"role": "user", "parts": [{"text": "Hi"}]}
GOOGLE_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({}, "contents", "contents: this field is required"),
    ({"contents": [GOOGLE_USER, "x"]}, "contents[1]", "contents[1] must be an object, not a string"),
    (
        {"contents": [{"role": "bot", "parts": []}]},
        "contents[0].role",
        "contents[0].role must be 'user' or 'model', not 'bot'",
    ),
    ({"contents": [{"parts": {"text": "x"}}]}, "contents[0].parts", "contents[0].parts must be an array of parts"),
    (
        {"contents": [{"parts": [{"text": 3}]}]},
        "contents[0].parts[0].text",
        "contents[0].parts[0].text must be a string, not a number",
    ),
    (
        {"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]},
        "contents[0].parts[0].functionCall.name",
        "contents[0].parts[0].functionCall.name: this field is required",
    ),
    (
        {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": []}}]}]},
        "contents[0].parts[0].functionCall.args",
        "contents[0].parts[0].functionCall.args must be an object",
    ),
    (
        {"contents": [{"parts": [{"functionResponse": {"response": {}}}]}]},
        "contents[0].parts[0].functionResponse.name",
        "contents[0].parts[0].functionResponse.name: this field is required",
    ),
    (
        {"contents": [{"parts": [{"inlineData": {"data": "AA"}}]}]},
        "contents[0].parts[0]",
        "contents[0].parts[0] is a part with inlineData: this gateway takes text, functionCall and functionResponse "
        "parts only (no inline or file data, no executable code)",
    ),
    (
        {"contents": [GOOGLE_USER], "systemInstruction": {"parts": [{"fileData": {}}]}},
        "systemInstruction.parts[0]",
        "systemInstruction.parts[0] is a part with fileData: this gateway takes text, functionCall and "
        "functionResponse parts only (no inline or file data, no executable code)",
    ),
    (
        {"contents": [GOOGLE_USER], "tools": [{"functionDeclarations": [{"description": "d"}]}]},
        "tools[0].functionDeclarations[0].name",
        "tools[0].functionDeclarations[0].name: this field is required",
    ),
    (
        {"contents": [GOOGLE_USER], "toolConfig": {"functionCallingConfig": {"mode": 1}}},
        "toolConfig.functionCallingConfig.mode",
        "toolConfig.functionCallingConfig.mode must be a string, not a number",
    ),
    (
        {"contents": [GOOGLE_USER], "generationConfig": {"candidateCount": 2}},
        "generationConfig.candidateCount",
        "generationConfig.candidateCount must be 1: one sample per call",
    ),
    (
        {"contents": [GOOGLE_USER], "generationConfig": {"maxOutputTokens": 0}},
        "generationConfig.maxOutputTokens",
        "generationConfig.maxOutputTokens must be at least 1, not 0",
    ),
    (
        {"contents": [GOOGLE_USER], "generationConfig": {"topP": 2}},
        "generationConfig.topP",
        "generationConfig.topP must be between 0.0 and 1.0, not 2",
    ),
    (
        {"contents": [GOOGLE_USER], "generationConfig": {"stopSequences": 5}},
        "generationConfig.stopSequences",
        "generationConfig.stopSequences must be a string or an array of strings, not a number",
    ),
    (
        {"contents": [GOOGLE_USER], "generationConfig": []},
        "generationConfig",
        "generationConfig must be an object, not an array",
    ),
]


@pytest.mark.parametrize(("body", "param", "message"), GOOGLE_CASES)
async def test_google_generate_refusals(body: dict[str, Any], param: str, message: str) -> None:
    assert await _refusal(handle_generate, body, path="/v1beta/models/m:generateContent") == (400, param, message)


async def test_google_count_tokens_reads_the_inner_request() -> None:
    inner = {"contents": [{"parts": [{"text": 3}]}]}
    with pytest.raises(GatewayError) as refused:
        handle_count_tokens({"generateContentRequest": inner})
    assert refused.value.param == "generateContentRequest.contents[0].parts[0].text"
    assert handle_count_tokens({"tools": "not read without contents"}).status == 200


async def test_google_other_tools_are_left_out_and_camel_case_is_read() -> None:
    seen: list[Any] = []
    left: list[Any] = []

    body = {
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "contents": [GOOGLE_USER],
        "tools": [{"googleSearch": {}, "functionDeclarations": [{"name": "f", "parametersJsonSchema": {}}]}],
        "generationConfig": {"maxOutputTokens": 7, "topP": 0.5, "stopSequences": "END", "thinkingConfig": {}},
    }
    turns = ChatTurns(_recording(seen), model="m", default_sampling=SAMPLING, on_left_out=left.append)
    response = await handle_generate(turns, body, path="/v1beta/models/m:generateContent")
    assert response.status == 200
    [(messages, tools, sampling)] = seen
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert [tool["function"]["name"] for tool in tools] == ["f"] and left == [["googleSearch"]]
    assert (sampling.max_tokens, sampling.top_p, sampling.stop) == (7, 0.5, ("END",))


FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}
RESPONSES_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({}, "input", "input: this field is required"),
    ({"input": 5}, "input", "input must be a string or an array of items"),
    (
        {"input": "Hi", "previous_response_id": "r", "temperature": 9},
        "previous_response_id",
        "previous_response_id: this gateway is stateless and stores no responses: send the whole conversation as input",
    ),
    ({"input": "Hi", "background": "yes"}, "background", "background must be a boolean, not a string"),
    ({"input": ["x"]}, "input[0]", "input[0] must be an object, not a string"),
    ({"input": [{"type": "message", "content": "x"}]}, "input[0].role", "input[0].role: this field is required"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role", "input[0].role: unknown role 'bot'"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
        "input[0].name",
        "input[0].name: this field is required",
    ),
    (
        {"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": {}}]},
        "input[0].arguments",
        "input[0].arguments must be a string",
    ),
    (
        {"input": [{"type": "custom_tool_call", "name": "f", "input": 3, "call_id": "c"}]},
        "input[0].input",
        "input[0].input must be a string, not a number",
    ),
    (
        {"input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id",
        "input[0].call_id: this field is required",
    ),
    ({"input": "Hi", "tools": [{"type": "function"}]}, "tools[0].name", "tools[0].name: this field is required"),
    (
        {"input": "Hi", "tools": [{"type": "custom", "name": "p", "format": "x"}]},
        "tools[0].format",
        "tools[0].format must be an object, not a string",
    ),
    (
        {"input": "Hi", "tools": [{"type": "namespace", "name": "ns"}]},
        "tools[0].tools",
        "tools[0].tools: this field is required",
    ),
    (
        {"input": "Hi", "tools": [{"type": "namespace", "name": "ns", "tools": [FN, 4]}]},
        "tools[0].tools[1]",
        "tools[0].tools[1] must be an object, not a number",
    ),
    (
        {"input": "Hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
        "tools[0].tools[0].name",
        "tools[0].tools[0].name: this field is required",
    ),
    (
        {"input": "Hi", "tools": [FN, FN]},
        "tools[1]",
        "tools[1]: two tools would both be offered to the model as 'f': give them distinct names",
    ),
    (
        {"input": "Hi", "tools": [FN], "tool_choice": {"type": "function"}},
        "tool_choice.name",
        "tool_choice.name: this field is required",
    ),
    (
        {"input": "Hi", "tools": [FN], "tool_choice": {"type": "allowed_tools"}},
        "tool_choice.tools",
        "tool_choice.tools: this field is required",
    ),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1, not 0"),
    ({"input": "Hi", "top_p": -1}, "top_p", "top_p must be between 0.0 and 1.0, not -1"),
]


@pytest.mark.parametrize(("body", "param", "message"), RESPONSES_CASES)
async def test_responses_refusals(body: dict[str, Any], param: str, message: str) -> None:
    assert await _refusal(handle_responses, body) == (400, param, message)


async def test_responses_hosted_tools_are_left_out_and_the_request_is_echoed() -> None:
    seen: list[Any] = []
    left: list[Any] = []

    body = {
        "input": "Hi",
        "temperature": 1,
        "tools": [{"type": "web_search", "name": 3}, {"type": "namespace", "name": "ns", "tools": [FN, {"type": "x"}]}],
        "reasoning": {"effort": "high"},
    }
    turns = ChatTurns(_recording(seen), model="m", default_sampling=SAMPLING, on_left_out=left.append)
    response = await handle_responses(turns, body)
    assert response.status == 200 and left == [["web_search", "ns.x"]]
    assert [tool["function"]["name"] for tool in seen[0][1]] == ["ns__f"]
    assert isinstance(response.body, bytes)
    assert json.loads(response.body)["temperature"] == 1
