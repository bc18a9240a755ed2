"""Token-in/token-out backends over HTTP: vLLM and SGLang.

vLLM: POST {base_url}/completions (its OpenAI-compatible server, base_url
ending in /v1) with `prompt` as a list of token ids, `logprobs: 1` and vLLM's
`return_tokens_as_token_ids: true`, so each sampled token comes back as
"token_id:<id>" with its log-prob in `choices[0].logprobs`; with
`return_token_ids: true` vLLM also lists the sampled ids (`token_ids`), which
must be the same ids.

SGLang: POST {base_url}/generate (its native endpoint, base_url without /v1)
with `input_ids`, `sampling_params` and `return_logprob: true`; the sampled
ids and log-probs come back in `meta_info.output_token_logprobs` as
[logprob, token_id, text] triples.

Weight updates (both): vLLM through its RL endpoints (served with
VLLM_SERVER_DEV_MODE=1): POST /pause?mode=wait, /collective_rpc
`reload_weights` with the checkpoint's folder, /reset_prefix_cache (no KV of
the old weights is reused), /resume, then /update_weight_version; SGLang
through POST /update_weights_from_disk.

MoE routing: a vLLM started with --enable-return-routed-experts adds each
choice's `routed_experts` (a base64 `.npy` array of shape (tokens - 1,
layers, top_k) over the prompt and the sampled ids); it is passed on as is,
and is None where the server sends none.

Retries and error mapping: see http_client.py. The model's tokenizer and chat
template come from a local Hugging Face tokenizer folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from prorl_server.errors import InvalidArgument, LLMError, ProrlError, Unavailable
from prorl_server.llm.base import BackendInfo, Generation, RoutedExperts, Sampling, TokenBackend
from prorl_server.llm.chat_template import ChatTokenizer
from prorl_server.llm.http_client import HTTPClient
from prorl_server.llm.npy import decode_npy_base64


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
            routed = self.routed_experts(body)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LLMError(
                f"backend {self.info.id} sent a malformed answer ({exc!r}): {str(body)[:300]}",
                reason="llm_bad_response",
            ) from exc
        return Generation(
            tuple(ids),
            tuple(logprobs),
            finish,
            len(prompt_ids),
            time.perf_counter() - started,
            routed_experts=routed,
        )

    def payload(self, prompt_ids: list[int], sampling: Sampling) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, body: dict[str, Any]) -> tuple[list[int], list[float], str]:
        raise NotImplementedError

    def routed_experts(self, body: dict[str, Any]) -> RoutedExperts | None:
        """The answer's MoE routing, where the server reports one (else None)."""
        return None

    async def check_health(self) -> bool:
        return await self._http.healthy(self.health_path)

    async def close(self) -> None:
        await self._http.close()


class NoEndpoint(InvalidArgument):
    """vLLM answered 404: it has no such RL endpoint (not served with VLLM_SERVER_DEV_MODE=1, or older)."""


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
            "return_token_ids": True,
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
        sampled = choice.get("token_ids")  # vLLM's own list (return_token_ids); older servers send none
        if sampled is not None and [int(i) for i in sampled] != ids:
            raise ValueError(f"token_ids {sampled[:20]} are not the ids of the log-probs {ids[:20]}")
        return ids, values, str(choice.get("finish_reason") or "")

    def routed_experts(self, body: dict[str, Any]) -> RoutedExperts | None:
        encoded = body["choices"][0].get("routed_experts")
        if encoded is None:
            return None
        shape, values = decode_npy_base64(str(encoded))
        if len(shape) != 3:
            raise ValueError(f"routed_experts has shape {shape}, not (tokens, layers, top_k)")
        return RoutedExperts(num_tokens=shape[0], num_layers=shape[1], top_k=shape[2], expert_ids=tuple(values))

    # --- weight updates through vLLM's RL API (VLLM_SERVER_DEV_MODE=1) --------------------

    loads_weights = True
    _weights_path = ""
    """The checkpoint it loaded last through the service ("" until the first)."""

    @property
    def server_root(self) -> str:
        """The server's root (the RL endpoints are not under /v1)."""
        return self.info.base_url.removesuffix("/v1")

    async def _control(self, path: str, payload: dict[str, Any] | None = None, **params: str) -> str:
        """One POST to an RL endpoint, not retried (a failed reload must be seen as it is), on a
        connection of its own: vLLM's API server closes a connection after a 500 from an uncaught
        error (a failed reload is one), so the next request on a kept-alive connection was reset
        (vLLM 0.32); that reset, not vLLM, had failed the reload of the previous weights."""
        url = f"{self.server_root}{path}"
        session = self._http.session
        try:
            async with (
                aiohttp.ClientSession(
                    timeout=session.timeout,
                    headers=session.headers,
                    connector=aiohttp.TCPConnector(force_close=True),
                ) as fresh,
                fresh.post(url, json=payload, params=params or None) as response,
            ):
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(f"vLLM backend {self.info.id!r} was not reached at {url}: {exc!r}") from None
        if response.status == 404:
            raise NoEndpoint(
                f"vLLM backend {self.info.id!r} has no {path} endpoint: start it with VLLM_SERVER_DEV_MODE=1 "
                "(its RL endpoints), docs/llm.md"
            )
        if response.status >= 400:
            raise InvalidArgument(f"{path} answered HTTP {response.status}: {_error_message(text)}")
        return text

    async def load_weights(self, model_path: str) -> None:
        """Pause vLLM (finishing whatever it still runs), reload the weights in place from the
        checkpoint folder, drop its prefix cache (no KV of the old weights is reused), resume.

        A checkpoint folder vLLM could not read is refused before vLLM is paused, where that
        can be told from here (`_unreadable`). vLLM's in-place reload is not transactional: a
        checkpoint that fails half-way leaves the model's layers reset, on the meta device (the
        next forward pass crashed the engine here, vLLM 0.32). So on a failure the checkpoint it
        served before is loaded again, vLLM's own weight checksums must then read every tensor
        (none is left on the meta device), and only then does vLLM resume; the call fails
        saying so. If that cannot be done, vLLM is left paused."""
        previous = self._weights_path or await self._served_path()
        await self._refuse_unreadable(model_path, previous)
        await self._control("/pause", mode="wait")
        try:
            await self._reload(model_path)
        except InvalidArgument as exc:
            try:
                await self._reload(previous)
                await self._check_weights_readable()
            except ProrlError as again:
                # Its layers may be half reset: left paused, vLLM runs no forward pass on them
                # (one crashed the engine here), whoever else sends it requests.
                raise Unavailable(
                    f"vLLM backend {self.info.id!r} did not load {model_path!r} ({exc.message}) and could not "
                    f"load its previous weights {previous!r} back ({again.message}): it is left paused; "
                    "load weights into it yourself and POST /resume, or restart it"
                ) from None
            await self._control("/resume")
            raise InvalidArgument(
                f"vLLM backend {self.info.id!r} did not load {model_path!r}: {exc.message}; "
                f"it serves its previous weights {previous!r} again"
            ) from None
        except BaseException:
            await self._control("/resume")  # e.g. vLLM unreachable or cancelled: nothing was reset
            raise
        self._weights_path = model_path
        await self._control("/resume")

    async def _check_weights_readable(self) -> None:
        """vLLM's own checksums of its weights (POST /weight_checker): they fail on a tensor left
        on the meta device by a reload that stopped half-way. A vLLM without the endpoint (before
        0.32) is trusted on its reload's success, which ends by putting every layer's tensors back."""
        with contextlib.suppress(NoEndpoint):
            await self._control("/weight_checker", {"action": "checksum"})

    async def _refuse_unreadable(self, model_path: str, previous: str) -> None:
        """Refuse, before vLLM is paused or touched, a checkpoint folder it could not read, where
        vLLM runs on this host (a loopback address) and sees its files as they are here."""
        if (urlsplit(self.info.base_url).hostname or "") not in LOOPBACK:
            return
        why = await asyncio.to_thread(_unreadable, model_path, previous)
        if why:
            raise InvalidArgument(
                f"vLLM backend {self.info.id!r} was not asked to load {model_path!r}: {why}; "
                f"it serves its previous weights {previous!r}, untouched"
            )

    async def _reload(self, model_path: str) -> None:
        await self._control("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_path}})
        await self._control("/reset_prefix_cache")

    async def _served_path(self) -> str:
        """The folder vLLM was started with (its model list's `root`)."""
        url = f"{self.info.base_url}/models"
        try:
            async with self._http.session.get(url) as response:
                body = await response.json(content_type=None)
            return str(body["data"][0]["root"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise Unavailable(f"vLLM backend {self.info.id!r} did not say which weights it serves ({exc!r})") from None

    async def set_weights_version(self, policy_version: int) -> None:
        """vLLM's own record of the weights it serves (GET /weight_info) follows the policy version."""
        await self._control("/update_weight_version", {"new_version": str(policy_version)})


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


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
"""What vLLM's default loader reads from a checkpoint folder (vllm/model_executor/model_loader/default_loader.py)."""


def _unreadable(model_path: str, served: str) -> str:
    """Why vLLM cannot read the checkpoint folder `model_path`, or "" where it can or where that
    cannot be told from here: only an absolute path is checked, and only when the folder vLLM
    serves (`served`) is visible here at the same path, so that this host's files are vLLM's."""
    path, served_path = Path(model_path), Path(served)
    if not (path.is_absolute() and served_path.is_absolute() and served_path.is_dir()):
        return ""  # a hub repo id, or vLLM's files are not these: vLLM judges
    if not path.is_dir():
        return "no such folder on the vLLM host"
    if not any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
        return f"the folder has no weight files ({', '.join(WEIGHT_FILES)})"
    return ""


def _error_message(text: str) -> str:
    """vLLM's error text: {"error": {"message"}} or {"error": "..."} or {"detail"}, else the body."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = json.loads(text)
        error = body.get("error") or body.get("detail")
        if isinstance(error, dict):
            error = error.get("message")
        if error:
            return str(error)[:500]
    return text[:500]
