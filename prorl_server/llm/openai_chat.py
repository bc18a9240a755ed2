"""Any OpenAI-compatible /v1/chat/completions endpoint, over aiohttp.

Text in, text and tool calls out. Retries (tenacity) only what may succeed on
a second try: connection errors, 5xx answers and 429 (rate limited). Any
other 4xx is the request's fault and fails at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from prorl_server.errors import ContextLengthExceeded, LLMError
from prorl_server.llm.base import ApiToolCall, BackendInfo, ChatBackend, ChatResult, Sampling
from prorl_server.llm.base import about_context_length as _about_context_length


class _Retryable(Exception):
    """A transient failure: connection refused or reset, a 5xx or a 429."""


class OpenAIChatBackend(ChatBackend):
    def __init__(
        self,
        info: BackendInfo,
        *,
        api_key: str = "",
        timeout_s: float = 600.0,
        max_retries: int = 3,
        send_tools: bool = True,
    ) -> None:
        self.info = info
        self._api_key = api_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_retries = max_retries
        self._send_tools = send_tools
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers())
        return self._session

    def _payload(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": sampling.model or self.info.model or "default",
            "messages": list(messages),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
        }
        if sampling.top_p is not None:
            payload["top_p"] = sampling.top_p
        if sampling.stop:
            payload["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if tools and self._send_tools:
            payload["tools"] = list(tools)
        return payload

    async def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.info.base_url}/chat/completions"
        try:
            async with self.session.post(url, json=payload) as response:
                if response.status >= 400:
                    text = await response.text()
                    if response.status >= 500 or response.status == 429:
                        raise _Retryable(f"HTTP {response.status}: {text[:300]}")
                    if response.status == 400 and _about_context_length(text):
                        raise ContextLengthExceeded(f"backend {self.info.id}: {text[:300]}")
                    raise LLMError(
                        f"backend {self.info.id} refused the request: HTTP {response.status}: {text[:300]}",
                        reason="llm_bad_request",
                    )
                body: dict[str, Any] = await response.json(content_type=None)
                return body
        except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, ConnectionError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc

    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        payload = self._payload(messages, tools, sampling)
        started = time.perf_counter()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(lambda exc: isinstance(exc, _Retryable)),
                stop=stop_after_attempt(self._max_retries + 1),
                wait=wait_exponential(multiplier=0.2, max=5),
                reraise=True,
            ):
                with attempt:
                    body = await self._post(payload)
        except _Retryable as exc:
            raise LLMError(f"backend {self.info.id} unavailable after {self._max_retries + 1} attempts: {exc}") from exc
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
        try:
            async with self.session.get(
                f"{self.info.base_url}/models", timeout=aiohttp.ClientTimeout(total=5)
            ) as response:
                return response.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
