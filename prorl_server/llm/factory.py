"""Builds a backend of any kind from its settings (config file or AddBackend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prorl_server.errors import InvalidArgument
from prorl_server.llm.base import TOOL_CALL_PARSERS as PARSERS
from prorl_server.llm.base import BackendInfo, LLMBackend
from prorl_server.llm.hf_tokenizer import HFTokenizer
from prorl_server.llm.openai_chat import OpenAIChatBackend
from prorl_server.llm.token_http import SGLangBackend, VLLMBackend

KINDS = ("openai_chat", "vllm", "sglang")


@dataclass(frozen=True)
class BackendSpec:
    id: str
    kind: str
    base_url: str
    model: str = ""
    api_key: str = field(default="", repr=False)
    max_in_flight: int = 0
    tokenizer_path: str = ""
    weight: float = 1.0
    tool_call_parser: str = "hermes"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs_mode: str = "processed"


def build_backend(spec: BackendSpec, *, timeout_s: float, max_retries: int) -> LLMBackend:
    info = BackendInfo(
        id=spec.id,
        kind=spec.kind,
        base_url=spec.base_url.rstrip("/"),
        model=spec.model,
        max_in_flight=spec.max_in_flight,
        weight=spec.weight,
        extra={"tokenizer_path": spec.tokenizer_path} if spec.tokenizer_path else {},
        tool_call_parser=spec.tool_call_parser,
        chat_template_kwargs=dict(spec.chat_template_kwargs),
        logprobs_mode=spec.logprobs_mode,
    )
    if spec.tool_call_parser and spec.tool_call_parser not in PARSERS:
        raise InvalidArgument(
            f"backend {spec.id!r}: unknown tool_call_parser {spec.tool_call_parser!r}; use one of {', '.join(PARSERS)}"
        )
    if spec.logprobs_mode not in ("processed", "raw", ""):
        raise InvalidArgument(f"backend {spec.id!r}: logprobs_mode must be processed or raw")
    if spec.kind == "openai_chat":
        return OpenAIChatBackend(info, api_key=spec.api_key, timeout_s=timeout_s, max_retries=max_retries)
    if spec.kind in ("vllm", "sglang"):
        if not spec.tokenizer_path:
            raise InvalidArgument(
                f"backend {spec.id!r} of kind {spec.kind} needs tokenizer_path: a local Hugging Face tokenizer "
                "folder (tokenizer.json and tokenizer_config.json) of the model it serves"
            )
        backend_class = VLLMBackend if spec.kind == "vllm" else SGLangBackend
        return backend_class(
            info,
            HFTokenizer(spec.tokenizer_path, template_kwargs=spec.chat_template_kwargs),
            api_key=spec.api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
        )
    raise InvalidArgument(f"unknown backend kind {spec.kind!r}; use one of {', '.join(KINDS)}")
