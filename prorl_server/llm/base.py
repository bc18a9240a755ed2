"""The LLM backend interface: one chat turn in, the sampled reply out."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """Effective sampling parameters of one request."""

    max_tokens: int
    temperature: float
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str = ""


@dataclass(frozen=True)
class ApiToolCall:
    """A tool call the backend returned in structured form."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: tuple[ApiToolCall, ...] = ()
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    backend_id: str = ""
    latency_s: float = 0.0
    policy_version: int = 0


@dataclass
class BackendInfo:
    """Configuration of a backend, as AdminService reports it."""

    id: str
    kind: str
    base_url: str
    model: str
    max_in_flight: int = 0
    managed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class ChatBackend(abc.ABC):
    info: BackendInfo

    @abc.abstractmethod
    async def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], sampling: Sampling
    ) -> ChatResult:
        """One completion. Raises LLMError on a failure that is not the policy's."""

    @abc.abstractmethod
    async def check_health(self) -> bool: ...

    @abc.abstractmethod
    async def close(self) -> None: ...
