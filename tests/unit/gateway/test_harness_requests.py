"""The requests real agent harnesses sent, replayed against the model gateway.

tests/data/harness_requests/<harness>-<version>/NN.json were recorded from the real programs
(scripts/record_harness_requests.py: Codex CLI, Claude Code, Gemini CLI, OpenCode, Qwen Code, each
configured only as its documentation says). Each request is replayed as it was sent (method, path,
headers, body; the key put back) against a ModelGateway over a scripted model that answers with a
call of one of the offered tools (a namespaced one when there is one) or with text. Each must get a
200 in its provider's reply shape; the model must have been offered exactly the request's own
function tools, under the names responses_tools.flat_name gives, hosted tools left out and
recorded; the call must come back under the program's own name (and namespace); and each system
message must reach the model as a system message. A harness upgrade that changes what it sends is
caught by recording again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from prorl_server.gateway.app import ModelGateway
from prorl_server.gateway.chains import CallChains
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import ApiToolCall, ChatResult, Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse
from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer

DATA = Path(__file__).resolve().parents[2] / "data" / "harness_requests"
TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
HARNESSES = ("codex", "claude-code", "gemini-cli", "opencode", "qwen-code")
KEY = "sk-replay"
RECORDED = sorted(DATA.glob("*/*.json"))
GEMINI = re.compile(r"^/(v1beta|v1alpha|v1)/models/[^/:]+:(generateContent|streamGenerateContent)$")


def flat_name(namespace: str, name: str) -> str:
    """The name a namespace's function is offered under (docs/llm.md; written out again here so
    that this test does not take it from the code it checks)."""
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@dataclass
class ReplayModel:
    """A scripted ChatFn: a call of the chosen tool when tools are offered, else text."""

    calls: list[tuple[list[dict[str, Any]], list[str]]] = field(default_factory=list)
    choose: str | None = None

    async def __call__(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        names = [tool["function"]["name"] for tool in tools]
        self.calls.append((list(messages), names))
        if self.choose is not None and self.choose in names:
            call = ApiToolCall("call_replay", self.choose, "{}")
            return ChatResult(
                text="", finish_reason="tool_calls", prompt_tokens=9, completion_tokens=3, tool_calls=(call,)
            )
        return ChatResult(text="Replayed.", finish_reason="stop", prompt_tokens=9, completion_tokens=2)


def expected_tools(route: str, body: dict[str, Any]) -> tuple[list[str], list[str], dict[str, tuple[str, str | None]]]:
    """From the request alone: the names the model must be offered, the tool types left out, and
    per offered name the (name, namespace) the program must get back."""
    offered: list[str] = []
    left_out: list[str] = []
    back: dict[str, tuple[str, str | None]] = {}
    for tool in body.get("tools") or []:
        if route == "responses":
            kind = tool.get("type")
            if kind in ("function", "custom"):
                offered.append(tool["name"])
                back[tool["name"]] = (tool["name"], None)
            elif kind == "namespace":
                for inner in tool["tools"]:
                    if inner.get("type") in ("function", "custom"):
                        name = flat_name(tool["name"], inner["name"])
                        offered.append(name)
                        back[name] = (inner["name"], tool["name"])
                    else:
                        left_out.append(f"{tool['name']}.{inner.get('type')}")
            else:
                left_out.append(kind)
        elif route == "messages":
            if tool.get("type") in (None, "custom"):
                offered.append(tool["name"])
                back[tool["name"]] = (tool["name"], None)
            else:
                left_out.append(tool["type"])
        elif route == "chat":
            offered.append(tool["function"]["name"])
            back[tool["function"]["name"]] = (tool["function"]["name"], None)
        elif route == "gemini":
            for key, value in tool.items():
                if key == "functionDeclarations":
                    for declaration in value:
                        offered.append(declaration["name"])
                        back[declaration["name"]] = (declaration["name"], None)
                else:
                    left_out.append(key)
    return offered, left_out, back


def route_of(path: str) -> str:
    plain = urlsplit(path).path
    if GEMINI.match(plain):
        return "gemini"
    plain = plain.removeprefix("/v1")
    return {"/responses": "responses", "/messages": "messages", "/chat/completions": "chat"}.get(plain, "other")


def with_key(headers: dict[str, str]) -> dict[str, str]:
    """The recorded headers with the replay's key where the harness sent its own."""
    replayed = {name: value for name, value in headers.items() if name != "content-length"}
    for name in ("x-api-key", "x-goog-api-key"):
        if name in replayed:
            replayed[name] = KEY
    if "authorization" in replayed:
        replayed["authorization"] = f"Bearer {KEY}"
    return replayed


async def body_of(response: HttpResponse) -> bytes:
    if isinstance(response.body, bytes):
        return response.body
    return b"".join([piece async for piece in response.body])


def events(raw: bytes) -> list[dict[str, Any]]:
    found = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            found.append(json.loads(line[6:]))
    return found


def calls_in_reply(route: str, body: dict[str, Any], raw: bytes, content_type: str) -> list[tuple[str, str | None]]:
    """(name, namespace) of each call in the reply, checking the reply's shape on the way."""
    streamed = content_type.startswith("text/event-stream")
    if route == "responses":
        response = events(raw)[-1]["response"] if streamed else json.loads(raw)
        assert response["object"] == "response" and response["status"] == "completed"
        items = response["output"]
        assert items and all(item["type"] in ("message", "function_call", "custom_tool_call") for item in items)
        return [(item["name"], item.get("namespace")) for item in items if item["type"] != "message"]
    if route == "messages":
        if streamed:
            found = events(raw)
            assert found[0]["type"] == "message_start" and found[-1]["type"] == "message_stop"
            blocks = [event["content_block"] for event in found if event["type"] == "content_block_start"]
        else:
            message = json.loads(raw)
            assert message["type"] == "message" and message["role"] == "assistant"
            blocks = message["content"]
        return [(block["name"], None) for block in blocks if block["type"] == "tool_use"]
    if route == "chat":
        if streamed:
            chunks = events(raw)
            assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
            deltas = [
                call
                for chunk in chunks
                for choice in chunk["choices"]
                for call in choice["delta"].get("tool_calls") or []
            ]
            return [(call["function"]["name"], None) for call in deltas if call.get("function", {}).get("name")]
        completion = json.loads(raw)
        assert completion["object"] == "chat.completion"
        message = completion["choices"][0]["message"]
        return [(call["function"]["name"], None) for call in message.get("tool_calls") or []]
    if route == "gemini":
        answers = events(raw) if streamed else json.loads(raw)
        answers = answers if isinstance(answers, list) else [answers]
        parts = [part for answer in answers for part in answer["candidates"][0]["content"]["parts"]]
        assert answers[-1]["usageMetadata"]["totalTokenCount"] > 0
        return [(part["functionCall"]["name"], None) for part in parts if "functionCall" in part]
    return []


def system_texts(route: str, body: dict[str, Any]) -> int:
    """How many system messages the request carries (each must reach the model as one)."""
    if route == "messages":
        return int(bool(body.get("system"))) + sum(1 for m in body.get("messages", []) if m.get("role") == "system")
    if route == "responses":
        items = body.get("input") if isinstance(body.get("input"), list) else []
        roles = [item.get("role") for item in items if item.get("type", "message") == "message"]
        return int(bool(body.get("instructions"))) + sum(1 for role in roles if role in ("system", "developer"))
    if route == "chat":
        return sum(1 for m in body.get("messages", []) if m.get("role") in ("system", "developer"))
    if route == "gemini":
        return int(bool(body.get("systemInstruction")))
    return 0


def test_every_harness_has_recorded_requests() -> None:
    recorded = {path.parent.name.rsplit("-", 1)[0] for path in RECORDED}
    assert set(HARNESSES) <= recorded, f"no recorded requests for {set(HARNESSES) - recorded}"
    for path in RECORDED:
        entry = load(path)
        assert path.parent.name == f"{entry['harness']}-{entry['version']}"
        if entry["method"] == "POST":  # the model calls (the others: Claude Code's key-less HEAD / probe, a 401)
            assert entry["status"] == 200, f"{path}: the gateway answered {entry['status']} when it was recorded"
        assert all(
            value == "<redacted>"
            for name, value in entry["headers"].items()
            if name in ("authorization", "x-api-key", "x-goog-api-key")
        )


@pytest.mark.parametrize("path", RECORDED, ids=[f"{p.parent.name}/{p.stem}" for p in RECORDED])
async def test_a_recorded_request_is_answered_as_its_harness_expects(path: Path) -> None:
    entry = load(path)
    route = route_of(entry["path"])
    body = entry["body"] if isinstance(entry["body"], dict) else {}
    offered, left_out, back = expected_tools(route, body)
    namespaced = [name for name, (_, namespace) in back.items() if namespace is not None]
    model = ReplayModel(choose=(namespaced or offered or [None])[0])
    noted: list[list[str]] = []
    gateway = ModelGateway(
        model, default_sampling=Sampling(max_tokens=512, temperature=1.0), api_key=KEY, on_left_out=noted.append
    )
    raw_body = json.dumps(entry["body"]).encode() if entry["body"] is not None else b""
    request = HttpRequest(entry["method"], entry["path"], with_key(entry["headers"]), raw_body)
    response = await gateway(request)
    raw = await body_of(response)
    assert response.status == entry["status"], raw.decode()[:2000]
    if route == "other":
        return
    assert gateway.admit(HttpRequest(request.method, request.path, request.headers)) is None
    assert len(model.calls) == 1
    messages, names = model.calls[0]
    choice = body.get("tool_choice")
    if choice in (None, "auto") or (isinstance(choice, dict) and choice.get("type") == "auto"):
        assert names == offered
    assert noted == ([left_out] if left_out else [])
    reply_calls = calls_in_reply(route, body, raw, response.headers.get("content-type", ""))
    if model.choose is not None and model.choose in names:
        assert reply_calls == [back[model.choose]]
    else:
        assert reply_calls == []
    roles = [message["role"] for message in messages]
    assert set(roles) <= {"system", "user", "assistant", "tool"}
    assert roles.count("system") == system_texts(route, body)
    for message in messages:
        for call in message.get("tool_calls") or []:
            # A call echoed from the history is under the name the model was offered.
            assert call["function"]["name"] in names or not names


# --------------------------------------------------------------------------------------------
# Exact chains: each harness's recorded tool loop on the job's CallChains


def qwen_tokenizer(folder: Path) -> Path:
    """The fake vLLM's byte-level tokenizer with Qwen2.5-Instruct's real chat template (tools,
    <tool_call>, <tool_response>): the set-up the harnesses were first tried on."""
    write_tiny_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "Qwen--Qwen2.5-7B-Instruct.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def echoed_call(route: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The last tool call the harness sent back in this request's history, as the model must have
    written it (hermes JSON, under the name the model was offered)."""
    found: dict[str, Any] | None = None
    if route == "responses":
        for item in body.get("input") or []:
            if item.get("type") == "function_call":
                name = item["name"] if not item.get("namespace") else flat_name(item["namespace"], item["name"])
                found = {"name": name, "arguments": json.loads(item.get("arguments") or "{}")}
    elif route == "messages":
        for message in body.get("messages", []):
            for block in message["content"] if isinstance(message["content"], list) else []:
                if message["role"] == "assistant" and block.get("type") == "tool_use":
                    found = {"name": block["name"], "arguments": block["input"]}
    elif route == "chat":
        for message in body.get("messages", []):
            for call in message.get("tool_calls") or []:
                found = {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
    elif route == "gemini":
        for content in body.get("contents", []):
            for part in content.get("parts", []):
                if "functionCall" in part:
                    found = {"name": part["functionCall"]["name"], "arguments": part["functionCall"].get("args", {})}
    return found


TOOL_LOOPS = sorted({path.parent for path in RECORDED})


@pytest.mark.parametrize("folder", TOOL_LOOPS, ids=[folder.name for folder in TOOL_LOOPS])
async def test_a_harness_tool_loop_is_one_exact_token_chain(folder: Path, tmp_path: Path) -> None:
    """The harness's model call that ran the shell, then its call with the result, replayed on the
    job's CallChains over a fake vLLM (Qwen2.5's template): the model's reply is the call the harness
    echoed, so the second call continues the first's token chain exactly."""
    entries = [load(path) for path in RECORDED if path.parent == folder]
    calls = [entry for entry in entries if entry["method"] == "POST" and route_of(entry["path"]) != "other"]
    loop = [
        (i, entry) for i, entry in enumerate(calls) if echoed_call(route_of(entry["path"]), entry["body"]) is not None
    ][:1]
    assert loop, f"{folder.name}: no recorded call sends a tool result back"
    later_index, later = loop[0]
    earlier = calls[later_index - 1]
    call = echoed_call(route_of(later["path"]), later["body"])
    replies = iter([f"<tool_call>\n{json.dumps(call)}\n</tool_call>", "Done."])
    vllm = FakeVLLM(qwen_tokenizer(tmp_path / "tok"), lambda prompt: next(replies))
    vllm.max_model_len = 1 << 20  # one token per byte: Claude Code's calls are about 76 KB
    await vllm.start()
    router = BackendRouter(health_interval_s=0)
    settings = BackendSettings(id="v", kind="vllm", base_url=vllm.base_url, tokenizer_path=str(tmp_path / "tok"))
    router.add(build_backend(settings, timeout_s=30, max_retries=0))
    chains = CallChains("job", router, job_sampling=Sampling(max_tokens=512, temperature=1.0))
    gateway = ModelGateway(chains.chat, default_sampling=Sampling(max_tokens=512, temperature=1.0), api_key=KEY)
    try:
        for entry in (earlier, later):
            body = json.dumps(entry["body"]).encode()
            response = await gateway(HttpRequest(entry["method"], entry["path"], with_key(entry["headers"]), body))
            assert response.status == 200, (await body_of(response)).decode()[:2000]
            await body_of(response)
    finally:
        await router.close()
        await vllm.stop()
    (chain,) = chains.token_chains()
    assert chain.calls == [0, 1]
    first, second = (request["prompt"] for request in vllm.requests)
    sampled = chain.token_ids[len(first) : chain.turn_spans[0][1]]
    assert second[: len(first) + len(sampled)] == first + sampled
    assert "<tool_call>" in vllm.tokenizer.decode(sampled)
    assert chain.token_ids[: len(second)] == second
    assert "prorl-recorded" in vllm.tokenizer.decode(second[len(first) + len(sampled) :])
