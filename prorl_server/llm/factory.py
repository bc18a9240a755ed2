"""Builds a backend from its validated settings (config file or AddBackend alike)."""

from __future__ import annotations

from typing import assert_never

from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import BackendInfo, LLMBackend
from prorl_server.llm.hf_tokenizer import HFTokenizer
from prorl_server.llm.openai_chat import OpenAIChatBackend
from prorl_server.llm.token_http import HTTPTokenBackend, SGLangBackend, VLLMBackend


def backend_info(settings: BackendSettings) -> BackendInfo:
    """What AdminService reports about a backend built from `settings` (never its API key)."""
    return BackendInfo(
        id=settings.id,
        kind=settings.kind,
        base_url=settings.base_url,
        model=settings.model,
        max_in_flight=settings.max_in_flight,
        weight=settings.weight,
        extra={"tokenizer_path": settings.tokenizer_path} if settings.tokenizer_path else {},
        tool_call_parser=settings.tool_call_parser,
        chat_template_kwargs=dict(settings.chat_template_kwargs),
        logprobs_mode=settings.logprobs_mode,
    )


def build_backend(settings: BackendSettings, *, timeout_s: float, max_retries: int) -> LLMBackend:
    """Raises InvalidArgument when a token backend's tokenizer folder cannot be read."""
    info = backend_info(settings)
    api_key = settings.api_key.get_secret_value()
    token_class: type[HTTPTokenBackend]
    match settings.kind:
        case "openai_chat":
            return OpenAIChatBackend(info, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries)
        case "vllm":
            token_class = VLLMBackend
        case "sglang":
            token_class = SGLangBackend
        case _:
            assert_never(settings.kind)
    tokenizer = HFTokenizer(settings.tokenizer_path, template_kwargs=settings.chat_template_kwargs)
    return token_class(info, tokenizer, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries)
