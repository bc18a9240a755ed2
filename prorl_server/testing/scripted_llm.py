"""Scripted fake LLMs: test doubles with no model, a script decides each reply.

Two of them, driven by the same kind of script:
- `ScriptedLLMServer` speaks the OpenAI chat API over real HTTP on a loopback
  port, so tests drive the real server (and its HTTP backend) through an
  exact, known tool-call sequence;
- `ScriptedChatBackend` is a `ChatBackend` in process (no HTTP, no server):
  `pool.add(backend)` like any backend, for fast tests of the router, the
  session and the job pipeline. It records the requests it received.

A script is a function of the request's messages returning a `ScriptedReply`,
or a list of replies (text or `ScriptedReply`): the reply to a conversation's
n-th model turn is the n-th of the list, whichever job asks and however often
a turn is sent again.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from prorl_server.errors import ContextLengthExceeded, InvalidArgument, LLMError
from prorl_server.llm.base import ApiToolCall, BackendInfo, ChatBackend, ChatMessage, ChatResult, Sampling
from prorl_server.llm.http_client import about_context_length


@dataclass
class ScriptedReply:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """In the OpenAI form: {"id", "type": "function", "function": {"name", "arguments"}} (see api_tool_call)."""
    finish_reason: str = "stop"
    delay_s: float = 0.0
    status: int = 200
    error_message: str = "scripted failure"
    """The error body's message when status is not 200."""
    wait_for: asyncio.Event | None = None
    """The reply is held (after `delay_s`) until this event is set: lets a test keep a job in
    its model turn for exactly as long as it needs, without sleeping. Cancelling the request
    ends the wait."""


Script = Callable[[list[ChatMessage]], ScriptedReply]
Replies = Sequence[ScriptedReply | str]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A reply that calls a tool in the `<tool_call>` text convention."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def api_tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    """A structured tool call, as an OpenAI chat completion carries it (for ScriptedReply.tool_calls)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def turn_index(messages: Sequence[ChatMessage]) -> int:
    """How many assistant turns the conversation already has."""
    return sum(1 for message in messages if message.get("role") == "assistant")


def user_prompt(messages: Sequence[ChatMessage]) -> str:
    return next((str(m.get("content", "")) for m in messages if m.get("role") == "user"), "")


def script_of(script: Script | Replies) -> Script:
    """A script from a function (as it is) or a list of replies, one per model turn."""
    if callable(script):
        return script
    if isinstance(script, str):
        raise TypeError("a script is a function or a list of replies, not one reply: use [reply]")
    replies = [reply if isinstance(reply, ScriptedReply) else ScriptedReply(reply) for reply in script]

    def by_turn(messages: list[ChatMessage]) -> ScriptedReply:
        turn = turn_index(messages)
        if turn < len(replies):
            return replies[turn]
        return ScriptedReply(status=400, error_message=f"the script has no reply for model turn {turn + 1}")

    return by_turn


def _usage(messages: Sequence[ChatMessage], reply: ScriptedReply) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens): about four characters a token."""
    return sum(len(str(m.get("content", ""))) // 4 for m in messages), max(1, len(reply.content) // 4)


class ScriptedLLMServer:
    """Serves /v1/chat/completions from a script on a free loopback port."""

    def __init__(self, script: Script | Replies) -> None:
        self.script = script_of(script)
        self.requests: list[dict[str, Any]] = []
        self.authorizations: list[str] = []
        """The Authorization header of each chat request ("" when absent)."""
        self.in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        # Like vLLM and SGLang, stop working on a request whose client went away.
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.authorizations.append(request.headers.get("Authorization", ""))
        reply = self.script(body["messages"])
        self.in_flight += 1
        try:
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.wait_for is not None:
                await reply.wait_for.wait()
        finally:
            self.in_flight -= 1
        if reply.status != 200:
            return web.json_response({"error": {"message": reply.error_message}}, status=reply.status)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        prompt_tokens, completion_tokens = _usage(body["messages"], reply)
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "scripted"),
                "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )


@dataclass(frozen=True)
class ChatRequest:
    """One request a ScriptedChatBackend received (copies: later changes by the caller do not show)."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    sampling: Sampling


class ScriptedChatBackend(ChatBackend):
    """A scripted fake chat backend in process: no HTTP, no model.

    Replies carry tool calls in their text (`tool_call_text`, read with the hermes parser, as
    `info.tool_call_parser` says) or structured (`ScriptedReply.tool_calls`). A reply's status
    other than 200 fails the request as an HTTP backend would: 5xx and 429 as an unavailable
    backend, a 400 about the context length as ContextLengthExceeded, any other as a refusal.
    """

    def __init__(
        self,
        script: Script | Replies,
        *,
        backend_id: str = "scripted",
        max_in_flight: int = 0,
        weight: float = 1.0,
    ) -> None:
        self.script = script_of(script)
        self.info = BackendInfo(
            id=backend_id,
            kind="scripted",
            base_url="in-process",
            model="scripted",
            max_in_flight=max_in_flight,
            weight=weight,
            tool_call_parser="hermes",
        )
        self.requests: list[ChatRequest] = []
        self.in_flight = 0
        self.healthy = True
        """What check_health answers."""
        self.closed = False

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
        *,
        native_tools: bool = False,
    ) -> ChatResult:
        request = ChatRequest(copy.deepcopy(list(messages)), copy.deepcopy(list(tools)), sampling)
        self.requests.append(request)
        reply = self.script(copy.deepcopy(request.messages))
        started = time.perf_counter()
        self.in_flight += 1
        try:
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.wait_for is not None:
                await reply.wait_for.wait()
        finally:
            self.in_flight -= 1
        if reply.status != 200:
            raise self._failure(reply)
        prompt_tokens, completion_tokens = _usage(request.messages, reply)
        return ChatResult(
            text=reply.content,
            finish_reason=reply.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            tool_calls=tuple(_api_call(call, index) for index, call in enumerate(reply.tool_calls)),
            backend_id=self.info.id,
            latency_s=time.perf_counter() - started,
        )

    def _failure(self, reply: ScriptedReply) -> LLMError | ContextLengthExceeded:
        where = f"backend {self.info.id}"
        if reply.status >= 500 or reply.status == 429:
            return LLMError(f"{where} unavailable: HTTP {reply.status}: {reply.error_message}")
        if reply.status == 400 and about_context_length(reply.error_message):
            return ContextLengthExceeded(f"{where}: {reply.error_message}")
        return LLMError(
            f"{where} refused the request: HTTP {reply.status}: {reply.error_message}", reason="llm_bad_request"
        )

    async def check_health(self) -> bool:
        return self.healthy

    async def close(self) -> None:
        self.closed = True


def _api_call(call: dict[str, Any], index: int) -> ApiToolCall:
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    return ApiToolCall(
        id=str(call.get("id") or f"call_{index}"),
        name=str(function["name"]),
        arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
    )


class LoadableScriptedBackend(ScriptedChatBackend):
    """A scripted backend that "loads weights" as the embedded model and SGLang do: a checkpoint
    path under /ckpt/ loads (it then serves `weights`, the file's name), any other is refused
    as a missing file would be, and so is every path while `refuse` is set."""

    loads_weights = True

    def __init__(self, script: Script | Replies, **options: Any) -> None:
        super().__init__(script, **options)
        self.weights = "initial"
        self.loaded: list[str] = []
        self.in_flight_at_load: list[int] = []
        self.refuse = False

    async def load_weights(self, model_path: str) -> None:
        if self.refuse or not model_path.startswith("/ckpt/"):
            raise InvalidArgument(f"no checkpoint at {model_path}")
        self.in_flight_at_load.append(self.in_flight)
        self.weights = model_path.rsplit("/", 1)[-1]
        self.loaded.append(model_path)
