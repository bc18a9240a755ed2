"""The model gateway (prorl_server/gateway/) driven by the official `openai` and `anthropic` SDKs.

A ModelGateway over a fake `chat` (scripted ChatResults, recorded requests) is served on a loopback
port by the aiohttp adapter; the SDKs' parsed objects are checked, and so is what the fake chat
received: the messages (roles, tool_calls, tool_call_id), the tools and the sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from prorl_server.errors import ContextLengthExceeded, LLMError
from prorl_server.gateway.aiohttp_adapter import GatewayServer
from prorl_server.gateway.app import ModelGateway
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import ApiToolCall, ChatResult, Sampling, TokenBackend
from prorl_server.llm.factory import build_backend
from prorl_server.llm.job_chat import JobChat
from prorl_server.sandbox.runtime.relay import HttpRequest
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer

KEY = "sk-test-gateway"
MODEL = "policy"
DEFAULT = Sampling(max_tokens=256, temperature=0.7, model="backend-model")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
OPENAI_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]
ANTHROPIC_TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]

HERMES_REPLY = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def text(content: str, finish: str = "stop", **fields: Any) -> ChatResult:
    return ChatResult(text=content, finish_reason=finish, prompt_tokens=11, completion_tokens=5, **fields)


def structured(*calls: tuple[str, str, dict[str, Any]], content: str = "") -> ChatResult:
    api = tuple(ApiToolCall(call_id, name, json.dumps(arguments)) for call_id, name, arguments in calls)
    return ChatResult(text=content, finish_reason="tool_calls", prompt_tokens=11, completion_tokens=7, tool_calls=api)


@dataclass
class Received:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    sampling: Sampling


class FakeChat:
    """A scripted `ChatFn`: each call takes the next reply (a ChatResult, or an exception to raise)."""

    def __init__(self, *replies: ChatResult | BaseException) -> None:
        self.replies = list(replies)
        self.calls: list[Received] = []

    async def __call__(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        self.calls.append(Received(copy.deepcopy(list(messages)), copy.deepcopy(list(tools)), sampling))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply


@contextlib.asynccontextmanager
async def served(
    *replies: ChatResult | BaseException, api_key: str | None = KEY
) -> AsyncIterator[tuple[FakeChat, str]]:
    fake = FakeChat(*replies)
    server = GatewayServer(ModelGateway(fake, default_sampling=DEFAULT, model=MODEL, api_key=api_key))
    await server.start()
    try:
        yield fake, server.url
    finally:
        await server.close()


def openai_client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def anthropic_client(url: str, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


# --------------------------------------------------------------------------------------------
# OpenAI chat completions


async def test_chat_completion_text_and_sampling() -> None:
    async with served(text("Hello there.")) as (fake, url), openai_client(url) as client:
        completion = await client.chat.completions.create(
            model="anything",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            ],
            max_completion_tokens=64,
            temperature=0.2,
            top_p=0.9,
            stop=["END"],
            seed=7,
        )
    assert completion.object == "chat.completion" and completion.model == "anything"
    choice = completion.choices[0]
    assert choice.message.content == "Hello there." and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        11,
        5,
        16,
    )
    [call] = fake.calls
    assert call.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert call.tools == []
    assert call.sampling == Sampling(
        max_tokens=64, temperature=0.2, top_p=0.9, stop=("END",), seed=7, model="backend-model"
    )


async def test_chat_defaults_come_from_the_job() -> None:
    async with served(text("ok")) as (fake, url), openai_client(url) as client:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert fake.calls[0].sampling == DEFAULT


async def test_chat_hermes_tool_call_and_result_round_trip() -> None:
    replies = (text(HERMES_REPLY), text("It is sunny in Paris."))
    async with served(*replies) as (fake, url), openai_client(url) as client:
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert message.content == "Let me check."
        assert message.tool_calls is not None
        [call] = message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert len(call.id) == 9 and call.id.isalnum()
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"})
        second = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert fake.calls[0].tools == CHAT_TOOLS
    # The reply goes back as it was sampled (the tool call still in its text), its result as a tool message.
    assert fake.calls[1].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": HERMES_REPLY,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "sunny, 24C"},
    ]


async def test_chat_an_edited_reply_stays_as_the_program_sent_it() -> None:
    replies = (text(HERMES_REPLY), text("Sunny."))
    async with served(*replies) as (fake, url), openai_client(url) as client:
        messages: list[Any] = [{"role": "user", "content": "Weather?"}]
        first = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
        message = first.choices[0].message
        assert message.tool_calls is not None
        edited = {**message.model_dump(exclude_none=True), "content": "Something else."}
        messages += [edited, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
        await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
    assert fake.calls[1].messages[1]["content"] == "Something else."
    assert fake.calls[1].messages[2]["name"] == "get_weather"


async def test_chat_structured_tool_calls_non_streamed() -> None:
    reply = structured(("call_a", "get_weather", {"city": "Oslo"}), ("call_b", "get_weather", {"city": "Rome"}))
    async with served(reply, text("done")) as (fake, url), openai_client(url) as client:
        first = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Two cities"}], tools=OPENAI_TOOLS
        )
        message = first.choices[0].message
        assert message.content is None and message.tool_calls is not None
        assert [(c.id, json.loads(c.function.arguments)) for c in message.tool_calls if c.type == "function"] == [
            ("call_a", {"city": "Oslo"}),
            ("call_b", {"city": "Rome"}),
        ]
        history: list[Any] = [
            {"role": "user", "content": "Two cities"},
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "call_a", "content": "cold"},
            {"role": "tool", "tool_call_id": "call_b", "content": "warm"},
        ]
        await client.chat.completions.create(model=MODEL, messages=history, tools=OPENAI_TOOLS)
    sent = fake.calls[1].messages
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in sent[1]["tool_calls"]] == ["call_a", "call_b"]
    assert [(m["tool_call_id"], m["name"], m["content"]) for m in sent[2:]] == [
        ("call_a", "get_weather", "cold"),
        ("call_b", "get_weather", "warm"),
    ]


async def test_chat_stream_text_with_usage() -> None:
    async with served(text("Streamed reply.")) as (_, url), openai_client(url) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Streamed reply."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 16
    assert all(c.object == "chat.completion.chunk" for c in chunks)


async def test_chat_stream_tool_calls() -> None:
    async with served(text(HERMES_REPLY)) as (_, url), openai_client(url) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=OPENAI_TOOLS, stream=True
        )
        chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks]
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert calls[0].index == 0 and calls[0].type == "function" and calls[0].id
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls if c.function)) == {"city": "Paris"}
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage is None


async def test_chat_stream_helper_assembles_the_completion() -> None:
    reply = structured(("call_z", "get_weather", {"city": "Lima"}), content="Checking.")
    async with (
        served(reply) as (_, url),
        openai_client(url) as client,
        client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "Lima?"}], tools=OPENAI_TOOLS
        ) as stream,
    ):
        final = await stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking." and final.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_z", "get_weather", '{"city": "Lima"}')
    ]


async def test_chat_length_and_tool_choice_none() -> None:
    cut = text('<tool_call>{"name": "get_weather"', finish="length")
    async with served(cut) as (fake, url), openai_client(url) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go"}], tools=OPENAI_TOOLS, tool_choice="none"
        )
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content == '<tool_call>{"name": "get_weather"'
    assert fake.calls[0].tools == []


async def test_chat_named_tool_choice_sends_that_tool_only() -> None:
    tools = [*OPENAI_TOOLS, {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    async with served(text("x")) as (fake, url), openai_client(url) as client:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Go"}],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "other"}},
        )
    assert [t["function"]["name"] for t in fake.calls[0].tools] == ["other"]


async def test_chat_unreadable_call_is_returned_as_text() -> None:
    broken = "<tool_call>{not json}</tool_call>"
    async with served(text(broken)) as (_, url), openai_client(url) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go"}], tools=OPENAI_TOOLS
        )
    message = completion.choices[0].message
    assert message.content == broken and message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


async def test_chat_other_parser_from_the_backend() -> None:
    mistral = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]'
    async with served(text(mistral, tool_call_parser="mistral")) as (_, url), openai_client(url) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Go"}], tools=OPENAI_TOOLS
        )
    message = completion.choices[0].message
    assert message.content == "Sure." and message.tool_calls is not None
    [call] = message.tool_calls
    assert call.type == "function" and json.loads(call.function.arguments) == {"city": "Nice"}


async def test_chat_errors() -> None:
    replies = (
        ContextLengthExceeded("backend b: prompt of 9000 tokens"),
        LLMError("no backend", reason="llm_unavailable"),
    )
    async with served(*replies) as (fake, url), openai_client(url) as client:
        user: list[Any] = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.BadRequestError) as context:
            await client.chat.completions.create(model=MODEL, messages=user)
        assert context.value.code == "context_length_exceeded"
        assert "maximum context length" in context.value.message
        with pytest.raises(openai.InternalServerError) as unavailable:
            await client.chat.completions.create(model=MODEL, messages=user)
        assert unavailable.value.status_code == 503
        with pytest.raises(openai.BadRequestError, match="only one choice") as n:
            await client.chat.completions.create(model=MODEL, messages=user, n=2)
        assert n.value.param == "n"
        image: list[Any] = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
        ]
        with pytest.raises(openai.BadRequestError, match="image_url") as parts:
            await client.chat.completions.create(model=MODEL, messages=image)
        assert parts.value.param == "messages[0].content[0]"
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model=MODEL, messages=user, extra_body={"temperature": "hot"})
    assert len(fake.calls) == 2


async def test_bad_key_is_401_for_both_sdks() -> None:
    async with served() as (fake, url):
        async with openai_client(url, key="wrong") as client:
            with pytest.raises(openai.AuthenticationError) as oa:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
            assert oa.value.code == "invalid_api_key"
        async with anthropic_client(url, key="wrong") as aclient:
            with pytest.raises(anthropic.AuthenticationError) as an:
                await aclient.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
            assert an.value.body == {
                "type": "error",
                "error": {"type": "authentication_error", "message": "invalid x-api-key"},
            }
    assert fake.calls == []


async def test_models_list() -> None:
    async with served() as (_, url), openai_client(url) as client, anthropic_client(url) as aclient:
        models = [model async for model in client.models.list()]
        assert [(m.id, m.object) for m in models] == [(MODEL, "model")]
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")
        listed = [model async for model in aclient.models.list()]
        assert [(m.id, m.type) for m in listed] == [(MODEL, "model")]


async def test_raw_http_errors() -> None:
    async with served(api_key=None) as (_, url), aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/nope", json={}) as response:
            assert response.status == 404
            body = await response.json()
            assert set(body["error"]) == {"message", "type", "param", "code"}
        async with session.post(f"{url}/v1/chat/completions", data=b"{oops") as response:
            assert response.status == 400
            assert "not valid JSON" in (await response.json())["error"]["message"]
        async with session.get(f"{url}/v1/chat/completions") as response:
            assert response.status == 405
        async with session.post(f"{url}/v1/messages", json={"messages": []}) as response:
            assert response.status == 400
            body = await response.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert "max_tokens" in body["error"]["message"]
        count = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 400}]}
        async with session.post(f"{url}/v1/messages/count_tokens", json=count) as response:
            assert response.status == 200
            assert 100 <= (await response.json())["input_tokens"] <= 120


# --------------------------------------------------------------------------------------------
# Anthropic messages


async def test_anthropic_text_and_sampling() -> None:
    async with served(text("Bonjour.")) as (fake, url), anthropic_client(url) as client:
        message = await client.messages.create(
            model="claude-whatever",
            max_tokens=99,
            system=[{"type": "text", "text": "You are terse."}],
            messages=[{"role": "user", "content": "Hello"}],
            stop_sequences=["STOP"],
            # Recent SDKs no longer list them; older clients and litellm still send them.
            extra_body={"temperature": 0.3, "top_p": 0.8},
        )
    assert message.type == "message" and message.role == "assistant" and message.model == "claude-whatever"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", "Bonjour.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 5)
    [call] = fake.calls
    assert call.messages == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    assert call.sampling == Sampling(max_tokens=99, temperature=0.3, top_p=0.8, stop=("STOP",), model="backend-model")


async def test_anthropic_tool_use_and_result_round_trip() -> None:
    replies = (text(HERMES_REPLY), text("Sunny.", finish="length"))
    async with served(*replies) as (fake, url), anthropic_client(url) as client:
        messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.messages.create(model=MODEL, max_tokens=50, messages=messages, tools=ANTHROPIC_TOOLS)
        assert first.stop_reason == "tool_use"
        assert [b.type for b in first.content] == ["text", "tool_use"]
        text_block, tool_use = first.content
        assert text_block.type == "text" and text_block.text == "Let me check."
        assert tool_use.type == "tool_use" and tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
        messages.append({"role": "assistant", "content": [block.model_dump() for block in first.content]})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tool_use.id, "content": [{"type": "text", "text": "24C"}]},
                    {"type": "text", "text": "Summarise."},
                ],
            }
        )
        second = await client.messages.create(model=MODEL, max_tokens=50, messages=messages, tools=ANTHROPIC_TOOLS)
    assert second.stop_reason == "max_tokens"
    assert fake.calls[0].tools == CHAT_TOOLS
    assert fake.calls[1].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": HERMES_REPLY,
            "tool_calls": [
                {
                    "id": tool_use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tool_use.id, "name": "get_weather", "content": "24C"},
        {"role": "user", "content": "Summarise."},
    ]


async def test_anthropic_stream_events() -> None:
    reply = structured(("call_s", "get_weather", {"city": "Bern"}), content="One moment.")
    async with served(reply) as (_, url), anthropic_client(url) as client:
        stream = await client.messages.create(
            model=MODEL,
            max_tokens=50,
            messages=[{"role": "user", "content": "Bern?"}],
            tools=ANTHROPIC_TOOLS,
            stream=True,
        )
        events = [event async for event in stream]
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]
    assert start.type == "message_start" and start.message.usage.input_tokens == 11
    tool_start = events[4]
    assert tool_start.type == "content_block_start" and tool_start.content_block.type == "tool_use"
    assert tool_start.content_block.id == "call_s"
    json_delta = events[5]
    assert json_delta.type == "content_block_delta" and json_delta.delta.type == "input_json_delta"
    assert json.loads(json_delta.delta.partial_json) == {"city": "Bern"}
    finish = events[7]
    assert finish.type == "message_delta" and finish.delta.stop_reason == "tool_use" and finish.usage.output_tokens == 7


async def test_anthropic_stream_helper_assembles_the_message() -> None:
    async with (
        served(text(HERMES_REPLY)) as (_, url),
        anthropic_client(url) as client,
        client.messages.stream(
            model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Paris?"}], tools=ANTHROPIC_TOOLS
        ) as stream,
    ):
        streamed_text = "".join([chunk async for chunk in stream.text_stream])
        final = await stream.get_final_message()
    assert streamed_text == "Let me check."
    assert final.stop_reason == "tool_use"
    tool_use = final.content[1]
    assert tool_use.type == "tool_use" and tool_use.input == {"city": "Paris"}


async def test_anthropic_system_messages_anywhere_in_the_conversation() -> None:
    """Claude Code puts `role: "system"` messages after the first user message: each is a system
    message where it stands (it used to be a 400)."""
    async with served(text("Done.")) as (fake, url), anthropic_client(url) as client:
        message = await client.messages.create(
            model=MODEL,
            max_tokens=32,
            system="Be brief.",
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "The date is"}, {"type": "text", "text": "today."}],
                },  # type: ignore[list-item]
                {"role": "user", "content": "Go on."},
            ],
        )
    assert message.content[0].text == "Done."  # type: ignore[union-attr]
    assert fake.calls[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "The date is\ntoday."},
        {"role": "user", "content": "Go on."},
    ]


async def test_anthropic_errors() -> None:
    async with served(ContextLengthExceeded("backend b: too long")) as (fake, url), anthropic_client(url) as client:
        with pytest.raises(anthropic.BadRequestError) as context:
            await client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
        error = context.value.body
        assert isinstance(error, dict)
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith("prompt is too long")
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            await client.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": []})
        image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
        with pytest.raises(anthropic.BadRequestError, match="'image' block"):
            await client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    assert len(fake.calls) == 1


# --------------------------------------------------------------------------------------------
# OpenAI responses


async def test_responses_function_call_round_trip() -> None:
    replies = (text(HERMES_REPLY), text("Sunny in Paris."))
    async with served(*replies) as (fake, url), openai_client(url) as client:
        tools: list[Any] = [
            {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
        ]
        first = await client.responses.create(
            model=MODEL, instructions="Be helpful.", input="Weather in Paris?", tools=tools, max_output_tokens=40
        )
        assert first.status == "completed" and first.output_text == "Let me check."
        assert [item.type for item in first.output] == ["message", "function_call"]
        call = first.output[1]
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert first.usage is not None and first.usage.total_tokens == 16
        follow: list[Any] = [
            {"role": "user", "content": "Weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ]
        second = await client.responses.create(model=MODEL, instructions="Be helpful.", input=follow, tools=tools)
    assert second.output_text == "Sunny in Paris."
    assert fake.calls[0].sampling.max_tokens == 40
    assert fake.calls[0].tools == CHAT_TOOLS
    assert fake.calls[1].messages == [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": HERMES_REPLY,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "sunny"},
    ]


async def test_responses_stream() -> None:
    reply = structured(("call_r", "get_weather", {"city": "Kyiv"}), content="Looking.")
    replies = (reply, text("Fine."), text("cut", finish="length"))
    async with served(*replies) as (_, url), openai_client(url) as client:
        tools: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
        stream = await client.responses.create(model=MODEL, input="Kyiv?", tools=tools, stream=True)
        events = [event async for event in stream]
        async with client.responses.stream(model=MODEL, input="again") as helper:
            final = await helper.get_final_response()
        cut = [event async for event in await client.responses.create(model=MODEL, input="more", stream=True)]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == "Looking."
    assert [item.type for item in completed.response.output] == ["message", "function_call"]
    assert final.status == "completed" and final.output_text == "Fine."
    # A reply cut by max_output_tokens ends the stream as the API does (the SDK's stream helper only
    # assembles completed responses).
    last = cut[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"


async def test_responses_is_stateless() -> None:
    async with served() as (fake, url), openai_client(url) as client:
        with pytest.raises(openai.BadRequestError, match="stateless") as refused:
            await client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
        assert refused.value.param == "previous_response_id"
    assert fake.calls == []


# --------------------------------------------------------------------------------------------
# The handler itself


async def test_cancellation_propagates() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow_chat(
        messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    gateway = ModelGateway(slow_chat, default_sampling=DEFAULT)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}).encode()
    task = asyncio.create_task(gateway(HttpRequest("POST", "/v1/chat/completions", {}, body)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()

    # Over HTTP: a client that hangs up cancels the turn.
    started.clear()
    cancelled.clear()
    server = GatewayServer(gateway)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(session.post(f"{server.url}/v1/chat/completions", data=body))
            await started.wait()
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        await asyncio.wait_for(cancelled.wait(), timeout=10)
    finally:
        await server.close()


async def test_a_token_backend_keeps_one_exact_trajectory_across_gateway_turns(tmp_path: Path) -> None:
    """The program gets the call without its markup, sends it back in OpenAI's shape, and the job's
    token conversation still sees its own reply as sampled (no "rewritten" refusal)."""
    folder = write_tiny_tokenizer(tmp_path / "tok")
    script = iter([HERMES_REPLY, "Sunny."])
    vllm = FakeVLLM(folder, lambda prompt: next(script))
    await vllm.start()
    settings = BackendSettings(id="v", kind="vllm", base_url=vllm.base_url, tokenizer_path=str(folder))
    backend = build_backend(settings, timeout_s=5, max_retries=0)
    assert isinstance(backend, TokenBackend)
    job = JobChat()

    async def chat(
        messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        return await job.chat(backend, messages, tools, sampling)

    server = GatewayServer(ModelGateway(chat, default_sampling=DEFAULT))
    await server.start()
    try:
        async with openai_client(server.url) as client:
            messages: list[Any] = [{"role": "user", "content": "Weather?"}]
            first = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
            message = first.choices[0].message
            assert message.content == "Let me check." and message.tool_calls is not None
            messages.append(message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"})
            second = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
    finally:
        await server.close()
        await backend.close()
        await vllm.stop()
    assert second.choices[0].message.content == "Sunny."
    first_prompt, second_prompt = (request["prompt"] for request in vllm.requests)
    sampled = [*vllm.tokenizer.encode(HERMES_REPLY, add_special_tokens=False).ids, vllm.eos]
    assert second_prompt[: len(first_prompt) + len(sampled)] == first_prompt + sampled
    assert "sunny" in vllm.tokenizer.decode(second_prompt[len(first_prompt) + len(sampled) :])
    token_ids, loss_mask, _ = job.token_trajectory()
    assert token_ids[: len(second_prompt)] == second_prompt
    assert sum(loss_mask) == len(sampled) + len(token_ids) - len(second_prompt)
