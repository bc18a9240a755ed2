"""A scripted fake LLM server: a test double speaking the OpenAI chat API.

It is what it says: no model. A script (a function of the request's
messages) decides each reply, so tests drive the real server through an exact,
known tool-call sequence over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class ScriptedReply:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    delay_s: float = 0.0
    status: int = 200
    error_message: str = "scripted failure"
    """The error body's message when status is not 200."""


Script = Callable[[list[dict[str, Any]]], ScriptedReply]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A reply that calls a tool in the `<tool_call>` text convention."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def turn_index(messages: list[dict[str, Any]]) -> int:
    """How many assistant turns the conversation already has."""
    return sum(1 for message in messages if message.get("role") == "assistant")


def user_prompt(messages: list[dict[str, Any]]) -> str:
    return next((str(m.get("content", "")) for m in messages if m.get("role") == "user"), "")


class ScriptedLLMServer:
    """Serves /v1/chat/completions from a script on a free loopback port."""

    def __init__(self, script: Script) -> None:
        self.script = script
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
        finally:
            self.in_flight -= 1
        if reply.status != 200:
            return web.json_response({"error": {"message": reply.error_message}}, status=reply.status)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        prompt_tokens = sum(len(str(m.get("content", ""))) // 4 for m in body["messages"])
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "scripted"),
                "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max(1, len(reply.content) // 4),
                    "total_tokens": prompt_tokens + max(1, len(reply.content) // 4),
                },
            }
        )
