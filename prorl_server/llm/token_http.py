"""Token-in/token-out backends over HTTP: vLLM and SGLang.

vLLM: POST {base_url}/completions (its OpenAI-compatible server, base_url
ending in /v1) with `prompt` as a list of token ids, `logprobs: 1` and vLLM's
`return_tokens_as_token_ids: true`, so each sampled token comes back as
"token_id:<id>" with its log-prob in `choices[0].logprobs`.

SGLang: POST {base_url}/generate (its native endpoint, base_url without /v1)
with `input_ids`, `sampling_params` and `return_logprob: true`; the sampled
ids and log-probs come back in `meta_info.output_token_logprobs` as
[logprob, token_id, text] triples.

Retries and error mapping: see http_client.py. The model's tokenizer and chat
template come from a local Hugging Face tokenizer folder.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prorl_server.errors import InvalidArgument, LLMError, Unavailable
from prorl_server.llm.base import BackendInfo, Generation, Sampling, TokenBackend
from prorl_server.llm.chat_template import ChatTokenizer
from prorl_server.llm.http_client import HTTPClient


class HTTPTokenBackend(TokenBackend):
    path = ""
    health_path = "/models"

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
        self._http = HTTPClient(
            backend_id=info.id, base_url=info.base_url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries
        )

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        started = time.perf_counter()
        body = await self._http.post(self.path, self.payload(list(prompt_ids), sampling))
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
        return await self._http.healthy(self.health_path)

    async def close(self) -> None:
        await self._http.close()


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
        payload.update(sampling.optional_fields())
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
        params.update(sampling.optional_fields(seed_key="sampling_seed"))
        return {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}

    def parse(self, body: dict[str, Any]) -> tuple[list[int], list[float], str]:
        meta = body["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(triple[1]) for triple in triples]
        values = [float(triple[0]) if triple[0] is not None else 0.0 for triple in triples]
        finish = meta.get("finish_reason") or {}
        return ids, values, str(finish.get("type") if isinstance(finish, dict) else finish)

    loads_weights = True

    async def load_weights(self, model_path: str) -> None:
        """SGLang's POST /update_weights_from_disk: it finishes the requests under way,
        loads the checkpoint, and keeps the old weights if that fails."""
        try:
            body = await self._http.post("/update_weights_from_disk", {"model_path": model_path})
        except LLMError as exc:
            if exc.reason == "llm_bad_request":  # SGLang answers 400 when it cannot load the checkpoint
                raise InvalidArgument(
                    f"SGLang backend {self.info.id!r} did not load {model_path!r}: {exc.message}"
                ) from None
            raise Unavailable(
                f"SGLang backend {self.info.id!r} was not reached to load weights: {exc.message}"
            ) from None
        if not body.get("success"):
            raise InvalidArgument(
                f"SGLang backend {self.info.id!r} did not load {model_path!r}: {body.get('message', 'no reason given')}"
            )
