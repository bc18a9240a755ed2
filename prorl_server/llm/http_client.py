"""What every HTTP backend shares: one aiohttp session, JSON posts with retries
(tenacity) on what may succeed on a second try, a health probe.

Retried: connection errors, 5xx, 429. A 400 saying the prompt does not fit
the model's context becomes ContextLengthExceeded (a policy outcome); any
other 4xx fails at once as the request's fault. A request still unanswered
after the backend's timeout (llm.request_timeout_s) fails at once too, as
`llm_timeout`: waiting that long again would not help the job.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from prorl_server.errors import ContextLengthExceeded, LLMError

CONTEXT_LENGTH_HINTS = ("maximum context length", "context length", "context window", "too long", "max_model_len")


def about_context_length(error_text: str) -> bool:
    """Whether a backend's 400 says the prompt does not fit its context (vLLM, SGLang, OpenAI wording)."""
    lowered = error_text.lower()
    return any(hint in lowered for hint in CONTEXT_LENGTH_HINTS)


class TransientError(Exception):
    """Worth another try: connection refused or reset, a 5xx, a 429."""


class HTTPClient:
    def __init__(self, *, backend_id: str, base_url: str, api_key: str, timeout_s: float, max_retries: int) -> None:
        self._backend_id = backend_id
        self._base_url = base_url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def _post_once(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(f"{self._base_url}{path}", json=payload) as response:
                text = await response.text()
                if response.status >= 500 or response.status == 429:
                    raise TransientError(f"HTTP {response.status}: {text[:300]}")
                if response.status == 400 and about_context_length(text):
                    raise ContextLengthExceeded(f"backend {self._backend_id}: {text[:300]}")
                if response.status >= 400:
                    raise LLMError(
                        f"backend {self._backend_id} refused the request: HTTP {response.status}: {text[:300]}",
                        reason="llm_bad_request",
                    )
                result: dict[str, Any] = json.loads(text)
                return result
        except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, ConnectionError) as exc:
            raise TransientError(f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:  # the whole request's time (ClientTimeout.total) ran out
            raise LLMError(
                f"backend {self._backend_id} did not answer within {self._timeout.total:g}s (llm.request_timeout_s)",
                reason="llm_timeout",
            ) from exc

    async def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST JSON, retrying transient failures; LLMError once they are exhausted."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(TransientError),
                stop=stop_after_attempt(self._max_retries + 1),
                wait=wait_exponential(multiplier=0.2, max=5),
                reraise=True,
            ):
                with attempt:
                    return await self._post_once(path, payload)
        except TransientError as exc:
            raise LLMError(
                f"backend {self._backend_id} unavailable after {self._max_retries + 1} attempts: {exc}"
            ) from exc
        raise AssertionError("unreachable: tenacity either returned or raised")

    async def healthy(self, path: str) -> bool:
        try:
            async with self.session.get(f"{self._base_url}{path}", timeout=aiohttp.ClientTimeout(total=5)) as response:
                return response.status < 400
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
