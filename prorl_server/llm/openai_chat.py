"""Any OpenAI-compatible /v1/chat/completions endpoint, over aiohttp.

Text in, text and tool calls out (no token ids: use a token backend for RL).
Retries and error mapping: see http_client.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prorl_server.errors import LLMError
from prorl_server.llm.base import ApiToolCall, BackendInfo, ChatBackend, ChatMessage, ChatResult, Sampling
from prorl_server.llm.http_client import HTTPClient


class OpenAIChatBackend(ChatBackend):
    def __init__(
        self,
        info: BackendInfo,
        *,
        api_key: str = "",
        timeout_s: float = 600.0,
        max_retries: int = 3,
        send_tools: bool = False,
    ) -> None:
        self.info = info
        self._http = HTTPClient(
            backend_id=info.id, base_url=info.base_url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries
        )
        # Off by default: servers such as vLLM refuse `tools` unless started with a
        # tool parser. The loop describes the tools in the system prompt anyway.
        self._send_tools = send_tools

    def _payload(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
        native_tools: bool = False,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": sampling.model or self.info.model or "default",
            "messages": list(messages),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
        }
        payload.update(sampling.optional_fields())
        if tools and (self._send_tools or native_tools):
            payload["tools"] = list(tools)
        kwargs = {**self.info.chat_template_kwargs, **sampling.chat_template_kwargs}
        if kwargs:  # vLLM's and SGLang's chat endpoints take them; sent only when set
            payload["chat_template_kwargs"] = kwargs
        return payload

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
        *,
        native_tools: bool = False,
    ) -> ChatResult:
        started = time.perf_counter()
        body = await self._http.post("/chat/completions", self._payload(messages, tools, sampling, native_tools))
        return self._parse(body, time.perf_counter() - started)

    def _parse(self, body: dict[str, Any], latency_s: float) -> ChatResult:
        try:
            choice = body["choices"][0]
            message = choice.get("message") or {}
            usage = body.get("usage") or {}
            calls = tuple(
                ApiToolCall(
                    id=str(call.get("id") or f"call_{index}"),
                    name=str(call["function"]["name"]),
                    arguments_json=str(call["function"].get("arguments") or "{}"),
                )
                for index, call in enumerate(message.get("tool_calls") or [])
            )
            return ChatResult(
                text=message.get("content") or "",
                finish_reason=str(choice.get("finish_reason") or ""),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                tool_calls=calls,
                backend_id=self.info.id,
                latency_s=latency_s,
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMError(
                f"backend {self.info.id} sent a malformed completion ({exc!r}): {str(body)[:300]}",
                reason="llm_bad_response",
            ) from exc

    async def check_health(self) -> bool:
        return await self._http.healthy("/models")

    async def close(self) -> None:
        await self._http.close()
