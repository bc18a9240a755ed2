"""The settings of one inference backend: one model for the config file and AdminService.AddBackend.

The config file's `[[llm.backends]]` tables validate into `BackendSettings`
(config.py), and so does the `Backend` message of AddBackend
(api/backend_messages.py); llm/factory.py builds a backend from either.

The kinds and the tool-call formats are written here once, as literals; every
other list of them is derived with `typing.get_args`.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

ChatKind = Literal["openai_chat"]
"""Messages in, text out: any OpenAI-compatible /v1/chat/completions server."""
TokenKind = Literal["vllm", "sglang"]
"""Token ids in and out (exact token trajectories); they need the model's tokenizer."""
BackendKind = Literal[ChatKind, TokenKind]
"""What a backend can be configured or added as."""
ServedKind = Literal[BackendKind, "embedded"]
"""What a backend in the pool can be: the configurable kinds and the server's embedded model."""

BACKEND_KINDS: tuple[BackendKind, ...] = get_args(BackendKind)
TOKEN_KINDS: tuple[TokenKind, ...] = get_args(TokenKind)
SERVED_KINDS: tuple[ServedKind, ...] = get_args(ServedKind)

ToolCallParser = Literal[
    "hermes",
    "llama3_json",
    "mistral",
    "pythonic",
    "deepseek_v3",
    "openai",
    "kimi_k2",
    "deepseek_v31",
    "glm4",
    "glm45",
    "cohere",
    "granite",
]
"""Tool-call formats a model may write in its text (vLLM's --tool-call-parser names); the
parsers themselves are in llm/tool_calls.py."""

LogprobsMode = Literal["processed", "raw"]

BACKEND_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class BackendSettings(BaseModel):
    """One inference backend. Immutable: a change is a new backend (RemoveBackend, AddBackend)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    """Unique in the pool: 1-64 characters of A-Z a-z 0-9 . _ : -"""
    kind: BackendKind = "openai_chat"
    base_url: str
    """e.g. http://127.0.0.1:8000/v1 (SGLang's native API: http://127.0.0.1:30000)"""
    model: str = ""
    """Model name sent in requests."""
    api_key: SecretStr = SecretStr("")
    """Sent as a bearer token to the backend; never logged or shown."""
    max_in_flight: int = Field(0, ge=0)
    """Most requests sent to it at once; 0: no limit."""
    tokenizer_path: str = Field("", validate_default=True)
    """vllm and sglang (required): a local Hugging Face tokenizer folder of the served model."""
    weight: float = Field(1.0, gt=0)
    """Relative capacity: new trajectories go to the fewest requests in flight per unit of weight."""
    tool_call_parser: ToolCallParser = "hermes"
    """How the served model writes tool calls in its text (vLLM's --tool-call-parser names): hermes
    (Qwen, `<tool_call>`), llama3_json, mistral, pythonic, deepseek_v3, openai (gpt-oss harmony), kimi_k2."""
    chat_template_kwargs: dict[str, Any] = {}
    """vllm and sglang: extra variables for the chat template, e.g. {"enable_thinking": false}."""
    logprobs_mode: LogprobsMode = "processed"
    """What the server's log-probs are: "processed" (after temperature/top-p/top-k; start vLLM with
    --logprobs-mode processed_logprobs) or "raw" (vLLM's default). Reported on every model turn."""

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not BACKEND_ID.match(value):
            raise ValueError("use 1-64 characters of A-Z a-z 0-9 . _ : -")
        return value

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://, e.g. http://127.0.0.1:8000/v1")
        return value.rstrip("/")

    @field_validator("tokenizer_path")
    @classmethod
    def _token_kinds_need_a_tokenizer(cls, value: str, info: ValidationInfo) -> str:
        kind = info.data.get("kind")  # absent when the kind itself is invalid
        if kind in TOKEN_KINDS and not value:
            raise ValueError(
                f"kind {kind} needs tokenizer_path: a local Hugging Face tokenizer folder "
                "(tokenizer.json and tokenizer_config.json) of the model it serves"
            )
        return value
