"""Token-in/token-out backends over HTTP: vLLM and SGLang.

vLLM: POST {base_url}/completions (its OpenAI-compatible server, base_url
ending in /v1) with `prompt` as a list of token ids, `logprobs: 1` and vLLM's
`return_tokens_as_token_ids: true`, so each sampled token comes back as
"token_id:<id>" with its log-prob in `choices[0].logprobs`.

SGLang: POST {base_url}/generate (its native endpoint, base_url without /v1)
with `input_ids`, `sampling_params` and `return_logprob: true`; the sampled
ids and log-probs come back in `meta_info.output_token_logprobs` as
[logprob, token_id, text] triples.

Both retry (tenacity) only connection errors, 5xx and 429. The model's
tokenizer and chat template come from a local Hugging Face tokenizer folder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from prorl_server.errors import ContextLengthExceeded, LLMError
from prorl_server.llm.base import BackendInfo, Generation, Sampling, TokenBackend
from prorl_server.llm.base import about_context_length as _about_context_length
from prorl_server.llm.chat_template import ChatTokenizer


class TransientError(Exception):
    """Worth another try: connection refused or reset, a 5xx, a 429."""


class HTTPTokenBackend(TokenBackend):
    path = ""

    def __init__(
        self,
        info: BackendInfo,
        tokenizer: ChatTokenizer,
        *,
        api_key: str = "",
        timeout_s: float = 600.0,
        max_retries: int = 3,
    ) -> None:
        self.info = info
        self._tokenizer = tokenizer
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(f"{self.info.base_url}{self.path}", json=payload) as response:
                body = await response.text()
                if response.status >= 500 or response.status == 429:
                    raise TransientError(f"HTTP {response.status}: {body[:300]}")
                if response.status == 400 and _about_context_length(body):
                    raise ContextLengthExceeded(f"backend {self.info.id}: {body[:300]}")
                if response.status >= 400:
                    raise LLMError(
                        f"backend {self.info.id} refused the request: HTTP {response.status}: {body[:300]}",
                        reason="llm_bad_request",
                    )
                result: dict[str, Any] = json.loads(body)
                return result
        except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError, ConnectionError) as exc:
            raise TransientError(f"{type(exc).__name__}: {exc}") from exc

    async def _post_with_retries(self, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(TransientError),
                stop=stop_after_attempt(self._max_retries + 1),
                wait=wait_exponential(multiplier=0.2, max=5),
                reraise=True,
            ):
                with attempt:
                    return await self._post(payload)
        except TransientError as exc:
            raise LLMError(f"backend {self.info.id} unavailable after {self._max_retries + 1} attempts: {exc}") from exc
        raise AssertionError("unreachable")

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        started = time.perf_counter()
        body = await self._post_with_retries(self.payload(list(prompt_ids), sampling))
        try:
            ids, logprobs, finish = self.parse(body)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMError(
                f"backend {self.info.id} sent a malformed answer ({exc!r}): {str(body)[:300]}",
                reason="llm_bad_response",
            ) from exc
        return Generation(tuple(ids), tuple(logprobs), finish, len(prompt_ids), time.perf_counter() - started)

    def payload(self, prompt_ids: list[int], sampling: Sampling) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, body: dict[str, Any]) -> tuple[list[int], list[float], str]:
        raise NotImplementedError

    async def check_health(self) -> bool:
        try:
            async with self.session.get(
                f"{self.info.base_url}{self.health_path}", timeout=aiohttp.ClientTimeout(total=5)
            ) as response:
                return response.status < 400
        except (aiohttp.ClientError, TimeoutError):
            return False

    health_path = "/models"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class VLLMBackend(HTTPTokenBackend):
    path = "/completions"
    health_path = "/models"

    def payload(self, prompt_ids: list[int], sampling: Sampling) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": sampling.model or self.info.model,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.top_p is not None:
            payload["top_p"] = sampling.top_p
        if sampling.stop:
            payload["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        return payload

    def parse(self, body: dict[str, Any]) -> tuple[list[int], list[float], str]:
        choice = body["choices"][0]
        logprobs = choice["logprobs"]
        ids = [int(str(token).removeprefix("token_id:")) for token in logprobs["tokens"]]
        values = [float(v) if v is not None else 0.0 for v in logprobs["token_logprobs"]]
        if len(ids) != len(values):
            raise ValueError("tokens and token_logprobs differ in length")
        return ids, values, str(choice.get("finish_reason") or "")


class SGLangBackend(HTTPTokenBackend):
    path = "/generate"
    health_path = "/health"

    def payload(self, prompt_ids: list[int], sampling: Sampling) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature}
        if sampling.top_p is not None:
            params["top_p"] = sampling.top_p
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        return {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}

    def parse(self, body: dict[str, Any]) -> tuple[list[int], list[float], str]:
        meta = body["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(triple[1]) for triple in triples]
        values = [float(triple[0]) if triple[0] is not None else 0.0 for triple in triples]
        finish = meta.get("finish_reason") or {}
        return ids, values, str(finish.get("type") if isinstance(finish, dict) else finish)
