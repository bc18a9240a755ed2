"""What real harnesses send besides flat function tools, and Google's Gemini API, on the gateway.

Responses `namespace` tools (Codex CLI's sub-agent functions) and `custom` tools are offered to the
model under flat names and answered under the program's own; hosted tools (web search, file
search, ...) are left out of what the model sees and recorded, on every protocol. Gemini's
generateContent is driven over raw HTTP (no Google SDK in the environment) as the google-genai
SDK sends it. The last tests run each protocol through the job's real `CallChains` on a fake
vLLM: the calls of a tool loop form one exact token chain.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from prorl_server.gateway.aiohttp_adapter import GatewayServer
from prorl_server.gateway.app import ModelGateway
from prorl_server.gateway.chains import CallChains
from prorl_server.gateway.responses_tools import flat_name
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer
from tests.unit.gateway.test_gateway_protocols import DEFAULT, KEY, MODEL, WEATHER, FakeChat, structured, text

SPAWN = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}
NAMESPACE_TOOL = {
    "type": "namespace",
    "name": "multi_agent",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Start one.", "strict": False, "parameters": SPAWN},
        {"type": "function", "name": "wait", "description": "Wait for one.", "parameters": {"type": "object"}},
    ],
}
SHELL_TOOL = {"type": "function", "name": "shell", "description": "Run a command.", "parameters": WEATHER}
PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
]


@contextlib.asynccontextmanager
async def gateway(*replies: Any) -> AsyncIterator[tuple[FakeChat, str, list[list[str]]]]:
    fake = FakeChat(*replies)
    noted: list[list[str]] = []
    server = GatewayServer(
        ModelGateway(fake, default_sampling=DEFAULT, model=MODEL, api_key=KEY, on_left_out=noted.append)
    )
    await server.start()
    try:
        yield fake, server.url, noted
    finally:
        await server.close()


async def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    sent = {"authorization": f"Bearer {KEY}"} if headers is None else headers
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=sent) as response:
        raw = await response.text()
        kind = response.headers.get("content-type", "")
        return response.status, (json.loads(raw) if kind.startswith("application/json") else None), raw


def names(tools: list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


# --------------------------------------------------------------------------------------------
# Responses: namespace, custom and hosted tools


def test_flat_names() -> None:
    assert flat_name("multi_agent", "spawn_agent") == "multi_agent__spawn_agent"
    assert flat_name("mcp__docs__", "search") == "mcp__docs__search"
    assert flat_name(None, "shell") == "shell"


async def test_a_namespace_tool_is_offered_flat_and_its_call_comes_back_under_its_namespace() -> None:
    call = structured(("call_1", "multi_agent__spawn_agent", {"message": "look"}))
    async with gateway(call, text("done")) as (fake, url, noted):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        tools: Any = [SHELL_TOOL, NAMESPACE_TOOL, *HOSTED]
        first = await client.responses.create(model=MODEL, input="Go.", tools=tools)
        (item,) = first.output
        assert item.type == "function_call"
        assert (item.name, item.namespace, item.call_id) == ("spawn_agent", "multi_agent", "call_1")
        assert json.loads(item.arguments) == {"message": "look"}
        history: Any = [
            {"role": "user", "content": "Go."},
            item.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": "call_1", "output": "agent 7 started"},
        ]
        second = await client.responses.create(model=MODEL, input=history, tools=tools)
        await client.close()
    assert second.output_text == "done"
    assert names(fake.calls[0].tools) == ["shell", "multi_agent__spawn_agent", "multi_agent__wait"]
    assert fake.calls[0].tools[1]["function"]["parameters"] == SPAWN
    assert noted == [["web_search", "file_search", "code_interpreter", "image_generation"]] * 2
    assistant, tool = fake.calls[1].messages[1:]
    assert assistant["tool_calls"][0]["function"]["name"] == "multi_agent__spawn_agent"
    assert tool == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "multi_agent__spawn_agent",
        "content": "agent 7 started",
    }


async def test_a_custom_tool_is_a_function_of_one_input_and_its_call_a_custom_tool_call() -> None:
    patch = "*** Begin Patch\n*** End Patch"
    async with gateway(structured(("call_p", "apply_patch", {"input": patch})), text("ok")) as (fake, url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        tools: Any = [PATCH_TOOL]
        first = await client.responses.create(model=MODEL, input="Fix it.", tools=tools)
        (item,) = first.output
        assert item.type == "custom_tool_call"
        assert (item.name, item.input, item.call_id) == ("apply_patch", patch, "call_p")
        history: Any = [
            {"role": "user", "content": "Fix it."},
            item.model_dump(exclude_none=True),
            {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"},
        ]
        await client.responses.create(model=MODEL, input=history, tools=tools)
        await client.close()
    (offered,) = fake.calls[0].tools
    assert offered["function"]["parameters"]["required"] == ["input"]
    assert "lark grammar" in offered["function"]["description"]
    call = fake.calls[1].messages[1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": patch}
    assert fake.calls[1].messages[2]["content"] == "Done!"


async def test_a_streamed_namespace_call_has_its_namespace_in_every_event() -> None:
    call = structured(("call_1", "multi_agent__wait", {}))
    async with gateway(call) as (_, url, _noted):
        status, _, raw = await post(
            f"{url}/v1/responses", {"model": MODEL, "input": "Go.", "tools": [NAMESPACE_TOOL], "stream": True}
        )
    assert status == 200
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert [(item["name"], item["namespace"]) for item in done] == [("wait", "multi_agent")]
    final = events[-1]["response"]["output"]
    assert final[0]["namespace"] == "multi_agent"


async def test_two_tools_with_one_flat_name_are_refused_naming_them() -> None:
    clash = {"type": "function", "name": "multi_agent__wait", "parameters": {"type": "object"}}
    async with gateway() as (_, url, _noted):
        status, body, _ = await post(
            f"{url}/v1/responses", {"model": MODEL, "input": "Go.", "tools": [clash, NAMESPACE_TOOL]}
        )
    assert status == 400
    assert "multi_agent__wait" in body["error"]["message"] and body["error"]["param"] == "tools[1].tools[1]"


async def test_anthropic_server_tools_are_left_out_and_recorded() -> None:
    request = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Search."}],
        "tools": [
            {"name": "get_weather", "input_schema": WEATHER},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
            {"type": "bash_20250124", "name": "bash"},
        ],
    }
    async with gateway(text("no search here")) as (fake, url, noted):
        status, body, _ = await post(f"{url}/v1/messages", request, {"x-api-key": KEY})
    assert status == 200 and body["content"][0]["text"] == "no search here"
    assert names(fake.calls[0].tools) == ["get_weather"]
    assert noted == [["web_search_20250305", "bash_20250124"]]


def test_the_job_counts_the_calls_that_left_each_tool_out() -> None:
    chains = CallChains("job", BackendRouter(health_interval_s=0))
    chains.note_left_out(["web_search", "file_search"])
    chains.note_left_out(["web_search", "web_search"])
    assert chains.report()["tools_left_out"] == {"web_search": 2, "file_search": 1}


# --------------------------------------------------------------------------------------------
# Gemini


def gemini_url(url: str, method: str = "generateContent", model: str = "gemini-2.5-pro") -> str:
    return f"{url}/v1beta/models/{model}:{method}"


GOOGLE_KEY = {"x-goog-api-key": KEY}
DECLARATIONS = [
    {
        "functionDeclarations": [
            {"name": "run_shell_command", "description": "Run.", "parametersJsonSchema": WEATHER},
            {
                "name": "read_file",
                "parameters": {"type": "OBJECT", "properties": {"path": {"type": "STRING"}}, "required": ["path"]},
            },
        ]
    },
    {"googleSearch": {}},
    {"codeExecution": {}},
]


async def test_gemini_text_system_instruction_sampling_and_usage() -> None:
    request = {
        "contents": [{"role": "user", "parts": [{"text": "Hi"}, {"text": "there"}]}],
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "generationConfig": {"temperature": 0.2, "topP": 0.9, "maxOutputTokens": 32, "stopSequences": ["END"]},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    }
    async with gateway(text("Hello.")) as (fake, url, _):
        status, body, _ = await post(gemini_url(url), request, GOOGLE_KEY)
    assert status == 200
    (candidate,) = body["candidates"]
    assert candidate["content"] == {"role": "model", "parts": [{"text": "Hello."}]}
    assert candidate["finishReason"] == "STOP"
    assert body["usageMetadata"] == {"promptTokenCount": 11, "candidatesTokenCount": 5, "totalTokenCount": 16}
    assert body["modelVersion"] == "gemini-2.5-pro"
    (received,) = fake.calls
    assert received.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert received.sampling.max_tokens == 32 and received.sampling.stop == ("END",)
    assert (received.sampling.temperature, received.sampling.top_p) == (0.2, 0.9)


async def test_gemini_function_call_and_response_round_trip() -> None:
    call = structured(("call_9", "run_shell_command", {"city": "ls"}))
    async with gateway(call, text("Two files.")) as (fake, url, noted):
        first_request = {"contents": [{"role": "user", "parts": [{"text": "List."}]}], "tools": DECLARATIONS}
        status, first, _ = await post(gemini_url(url), first_request, GOOGLE_KEY)
        assert status == 200
        parts = first["candidates"][0]["content"]["parts"]
        assert parts == [{"functionCall": {"id": "call_9", "name": "run_shell_command", "args": {"city": "ls"}}}]
        history = [
            *first_request["contents"],
            first["candidates"][0]["content"],
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"id": "call_9", "name": "run_shell_command", "response": {"output": "a b"}}}
                ],
            },
        ]
        status, second, _ = await post(gemini_url(url), {"contents": history, "tools": DECLARATIONS}, GOOGLE_KEY)
    assert status == 200 and second["candidates"][0]["content"]["parts"] == [{"text": "Two files."}]
    assert names(fake.calls[0].tools) == ["run_shell_command", "read_file"]
    # The OpenAPI-style schema is offered as JSON Schema.
    assert fake.calls[0].tools[1]["function"]["parameters"]["properties"] == {"path": {"type": "string"}}
    assert noted == [["googleSearch", "codeExecution"]] * 2
    assistant, tool = fake.calls[1].messages[1:]
    assert assistant["tool_calls"][0]["id"] == "call_9"
    assert tool == {"role": "tool", "tool_call_id": "call_9", "name": "run_shell_command", "content": "a b"}


async def test_gemini_calls_without_ids_get_stable_ids_from_their_place() -> None:
    history = [
        {"role": "user", "parts": [{"text": "Go."}]},
        {
            "role": "model",
            "parts": [
                {"text": "Two."},
                {"functionCall": {"name": "a", "args": {}}},
                {"functionCall": {"name": "b", "args": {}}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "b", "response": {"x": 1}}},
                {"functionResponse": {"name": "a", "response": {"output": "A"}}},
            ],
        },
    ]
    async with gateway(text("ok")) as (fake, url, _):
        status, _, _ = await post(gemini_url(url), {"contents": history}, GOOGLE_KEY)
    assert status == 200
    assistant, first, second = fake.calls[0].messages[1:]
    assert [call["id"] for call in assistant["tool_calls"]] == ["call_1_1", "call_1_2"]
    assert (first["tool_call_id"], first["content"]) == ("call_1_2", '{"x": 1}')
    assert (second["tool_call_id"], second["content"]) == ("call_1_1", "A")


async def test_gemini_stream_with_and_without_alt_sse() -> None:
    async with gateway(text("Hi."), text("Hi.", finish="length")) as (_, url, _noted):
        request = {"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}
        status, _, raw = await post(gemini_url(url, "streamGenerateContent") + "?alt=sse", request, GOOGLE_KEY)
        assert status == 200
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1]["candidates"][0]["content"]["parts"] == [{"text": "Hi."}]
        assert events[-1]["usageMetadata"]["totalTokenCount"] == 16
        status, array, _ = await post(gemini_url(url, "streamGenerateContent"), request, GOOGLE_KEY)
    assert status == 200 and array[0]["candidates"][0]["finishReason"] == "MAX_TOKENS"


async def test_gemini_tool_config_modes() -> None:
    async with gateway(text("a"), text("b")) as (fake, url, _):
        contents = [{"role": "user", "parts": [{"text": "Go."}]}]
        none = {"contents": contents, "tools": DECLARATIONS, "toolConfig": {"functionCallingConfig": {"mode": "NONE"}}}
        anyone = {
            "contents": contents,
            "tools": DECLARATIONS,
            "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["read_file"]}},
        }
        assert (await post(gemini_url(url), none, GOOGLE_KEY))[0] == 200
        assert (await post(gemini_url(url), anyone, GOOGLE_KEY))[0] == 200
    assert fake.calls[0].tools == [] and names(fake.calls[1].tools) == ["read_file"]


async def test_gemini_keys_errors_and_count() -> None:
    request = {"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}
    async with gateway(text("by query key")) as (_, url, _noted):
        status, body, _ = await post(gemini_url(url), request, {})
        assert status == 401 and body["error"]["status"] == "UNAUTHENTICATED"
        status, body, _ = await post(gemini_url(url), request, {"x-goog-api-key": "wrong"})
        assert status == 401 and body["error"]["code"] == 401
        status, body, _ = await post(gemini_url(url) + f"?key={KEY}", request, {})
        assert status == 200 and body["candidates"][0]["content"]["parts"][0]["text"] == "by query key"
        image = {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]}
        status, body, _ = await post(gemini_url(url), image, GOOGLE_KEY)
        assert status == 400 and body["error"]["status"] == "INVALID_ARGUMENT"
        assert "contents[0].parts[0]" in body["error"]["message"]
        status, body, _ = await post(
            gemini_url(url), {**request, "generationConfig": {"candidateCount": 2}}, GOOGLE_KEY
        )
        assert status == 400 and "candidateCount" in body["error"]["message"]
        status, body, _ = await post(gemini_url(url, "countTokens"), request, GOOGLE_KEY)
        assert status == 200 and body["totalTokens"] > 0
        status, body, _ = await post(gemini_url(url, "embedContent"), request, GOOGLE_KEY)
        assert status == 404 and body["error"]["status"] == "NOT_FOUND"
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1beta/models", headers=GOOGLE_KEY) as got:
            listed = await got.json()
        assert listed["models"][0]["name"] == f"models/{MODEL}"


# --------------------------------------------------------------------------------------------
# Exact chains through the job's CallChains


@contextlib.asynccontextmanager
async def chained(
    tmp_path: Path, script: Callable[[list[int]], str]
) -> AsyncIterator[tuple[CallChains, FakeVLLM, str]]:
    """A gateway on the job's real CallChains over a fake vLLM (a tiny tokenizer, Qwen-like
    ChatML template, hermes calls)."""
    folder = write_tiny_tokenizer(tmp_path / "tok")
    vllm = FakeVLLM(folder, script)
    vllm.max_model_len = 1 << 16  # one token per byte: real harness prompts are long
    await vllm.start()
    router = BackendRouter(health_interval_s=0)
    router.add(
        build_backend(
            BackendSettings(id="v", kind="vllm", base_url=vllm.base_url, tokenizer_path=str(folder)),
            timeout_s=5,
            max_retries=0,
        )
    )
    chains = CallChains("job", router, job_sampling=Sampling(max_tokens=1024, temperature=1.0))
    server = GatewayServer(
        ModelGateway(chains.chat, default_sampling=DEFAULT, api_key=KEY, on_left_out=chains.note_left_out)
    )
    await server.start()
    try:
        yield chains, vllm, server.url
    finally:
        await server.close()
        await router.close()
        await vllm.stop()


def assert_one_chain(chains: CallChains, vllm: FakeVLLM, calls: int) -> None:
    (chain,) = chains.token_chains()
    assert chain.calls == list(range(calls))
    prompts = [request["prompt"] for request in vllm.requests]
    for earlier, later in itertools.pairwise(prompts):
        assert later[: len(earlier)] == earlier
    assert chain.token_ids[: len(prompts[-1])] == prompts[-1]


def scripted(*replies: str) -> Callable[[list[int]], str]:
    queue = list(replies)
    return lambda prompt: queue.pop(0)


HERMES_SPAWN = '<tool_call>{"name": "multi_agent__spawn_agent", "arguments": {"message": "x"}}</tool_call>'
HERMES_SHELL = '<tool_call>{"name": "run_shell_command", "arguments": {"city": "ls"}}</tool_call>'


async def test_responses_namespace_calls_form_one_exact_chain(tmp_path: Path) -> None:
    async with chained(tmp_path, scripted(HERMES_SPAWN, "All done.")) as (chains, vllm, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        tools: Any = [NAMESPACE_TOOL, {"type": "web_search"}]
        base: Any = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Go."}]
        first = await client.responses.create(model=MODEL, input=base, tools=tools, store=False)
        (item,) = first.output
        assert (item.type, item.namespace) == ("function_call", "multi_agent")
        history = [
            *base,
            item.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": item.call_id, "output": "ok"},
        ]
        second = await client.responses.create(model=MODEL, input=history, tools=tools, store=False)
        await client.close()
    assert second.output_text == "All done."
    assert_one_chain(chains, vllm, 2)
    assert chains.report()["tools_left_out"] == {"web_search": 2}


async def test_gemini_calls_form_one_exact_chain(tmp_path: Path) -> None:
    first_request = {
        "contents": [{"role": "user", "parts": [{"text": "List."}]}],
        "systemInstruction": {"parts": [{"text": "You are a CLI."}]},
        "tools": DECLARATIONS,
    }
    async with chained(tmp_path, scripted(HERMES_SHELL, "Two files.")) as (chains, vllm, url):
        status, first, _ = await post(gemini_url(url), first_request, GOOGLE_KEY)
        assert status == 200
        reply = first["candidates"][0]["content"]
        call = reply["parts"][0]["functionCall"]
        answer = {"functionResponse": {"id": call["id"], "name": call["name"], "response": {"output": "a b"}}}
        contents = [*first_request["contents"], reply, {"role": "user", "parts": [answer]}]
        status, second, _ = await post(gemini_url(url), {**first_request, "contents": contents}, GOOGLE_KEY)
    assert status == 200 and second["candidates"][0]["content"]["parts"] == [{"text": "Two files."}]
    assert_one_chain(chains, vllm, 2)


async def test_anthropic_system_messages_mid_conversation_keep_one_exact_chain(tmp_path: Path) -> None:
    async with chained(tmp_path, scripted("First.", "Second.")) as (chains, vllm, url):
        base = {"model": MODEL, "max_tokens": 32, "system": [{"type": "text", "text": "You are a CLI."}]}
        messages: list[Any] = [
            {"role": "user", "content": [{"type": "text", "text": "One."}]},
            {"role": "system", "content": "Reminder: be brief."},
        ]
        status, first, _ = await post(f"{url}/v1/messages", {**base, "messages": messages}, {"x-api-key": KEY})
        assert status == 200
        messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "Two."}]
        status, second, _ = await post(f"{url}/v1/messages", {**base, "messages": messages}, {"x-api-key": KEY})
    assert status == 200 and second["content"][0]["text"] == "Second."
    assert_one_chain(chains, vllm, 2)
    assert "Reminder: be brief." in vllm.tokenizer.decode(vllm.requests[0]["prompt"])


@pytest.mark.parametrize("path", ["/v1beta/models/m:generateContent", "/v1/models/m:generateContent"])
async def test_gemini_paths_with_either_version_prefix(path: str) -> None:
    async with gateway(text("ok")) as (_, url, _noted):
        status, body, _ = await post(f"{url}{path}", {"contents": [{"parts": [{"text": "Hi"}]}]}, GOOGLE_KEY)
    assert status == 200 and body["candidates"][0]["content"]["parts"] == [{"text": "ok"}]


async def test_the_root_answers_a_probe_with_the_key_and_is_401_without() -> None:
    async with gateway() as (_, url, _noted), aiohttp.ClientSession() as session:
        async with session.head(f"{url}/", headers={"x-api-key": KEY}) as keyed:
            assert keyed.status == 200
        async with session.head(f"{url}/") as keyless:
            assert keyless.status == 401
