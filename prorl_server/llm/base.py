"""The LLM backend interface: one chat turn in, the sampled reply out."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict, get_args

from prorl_server.errors import InvalidArgument
from prorl_server.llm.backend_settings import ToolCallParser
from prorl_server.llm.chat_template import ChatTokenizer

TOOL_CALL_PARSERS: tuple[ToolCallParser, ...] = get_args(ToolCallParser)
"""Tool-call formats a model may write in its text (vLLM's --tool-call-parser names); the
parsers themselves are in llm/tool_calls.py."""


class FunctionCall(TypedDict):
    name: str
    arguments: str
    """The arguments as JSON text."""


class ToolCall(TypedDict):
    """An assistant message's tool call (OpenAI chat form)."""

    id: str
    type: str
    """Always "function"."""
    function: FunctionCall


class ChatMessage(TypedDict):
    """One message of a conversation as the job's chat takes it (OpenAI chat form): roles system,
    user, assistant (with `tool_calls`) and tool (with `tool_call_id` and, once its call is known,
    `name`). Backends and templates may read more keys a message carries (`reasoning_content`)."""

    role: str
    content: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]


@dataclass(frozen=True)
class Sampling:
    """Effective sampling parameters of one request."""

    max_tokens: int
    temperature: float
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Per request, over the backend's own (e.g. {"enable_thinking": False}); token backends only."""

    def optional_fields(self, *, seed_key: str = "seed") -> dict[str, Any]:
        """top_p, stop and the seed, only those that are set (backends' defaults otherwise)."""
        fields: dict[str, Any] = {}
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.stop:
            fields["stop"] = list(self.stop)
        if self.seed is not None:
            fields[seed_key] = self.seed
        return fields


@dataclass(frozen=True)
class ApiToolCall:
    """A tool call the backend returned in structured form."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class RoutedExperts:
    """The experts a mixture-of-experts model routed each token to, as the backend reported them
    (vLLM's `routed_experts`): `expert_ids[(t * num_layers + l) * top_k + k]` for token t of the
    sequence, layer l, choice k; `num_tokens` tokens from the sequence's start."""

    num_tokens: int
    num_layers: int
    top_k: int
    expert_ids: tuple[int, ...]


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
    switched_from_backend: str = ""
    """Set when this turn went to another backend than the job's previous turn."""
    model_wait_s: float = 0.0
    """Time this turn waited for a model slot before it was sent (not in latency_s)."""
    prefill_s: float | None = None
    decode_s: float | None = None
    tool_call_parser: str = ""
    """How to read tool calls written in `text` (llm/tool_calls.py PARSERS); "" for the default."""
    tool_role: bool = False
    """Whether results of calls written in `text` go back as `tool` messages: token backends whose
    template renders a tool role. (Calls from the API's `tool_calls` always do.)"""
    logprobs_mode: str = ""
    """"processed" (after temperature/top-p/top-k, the sampling distribution) or "raw" (before)."""
    token_offset: int = -1
    """Where token_ids start in the job's token trajectory (token backends; -1: none)."""
    resampled: bool = False
    """A Pause aborted this turn while it was being sampled; it was sampled again after Resume."""
    routed_experts: RoutedExperts | None = None
    """Token backends of MoE models that report it: the routing of the prompt and the sampled ids."""
    sampling_changes: tuple[tuple[str, str, str], ...] = ()
    """A gateway call's sampling fields that the job's overrode: (field, asked, used), for reading
    (gateway/sampling.py)."""


ChatFn = Callable[[Sequence[ChatMessage], Sequence[dict[str, Any]], Sampling], Awaitable[ChatResult]]
"""One model turn: (messages, tool schemas, sampling) -> the reply (the job's LLM session)."""


@dataclass
class BackendInfo:
    """Configuration of a backend, as AdminService reports it."""

    id: str
    kind: str
    base_url: str
    model: str
    max_in_flight: int = 0
    managed: bool = False
    weight: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str = ""
    """Tool-call format of the served model (vLLM's --tool-call-parser names); "" = hermes."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs_mode: str = ""
    """What the backend's log-probs are: "processed" or "raw"."""


@dataclass(frozen=True)
class Generation:
    """What a token backend sampled for one prompt."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    prompt_tokens: int
    latency_s: float
    prefill_s: float | None = None
    decode_s: float | None = None
    routed_experts: RoutedExperts | None = None
    """Where the backend reports it (vLLM started with --enable-return-routed-experts)."""


class LLMBackend(abc.ABC):
    """Any inference backend in the pool."""

    info: BackendInfo

    @abc.abstractmethod
    async def check_health(self) -> bool: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    loads_weights = False
    """Whether AdminService.UpdateWeights can load a checkpoint into it."""

    async def load_weights(self, model_path: str) -> None:
        """Serve the checkpoint at `model_path` from now on; keep the old weights on failure."""
        raise InvalidArgument(
            f"backend {self.info.id!r} ({self.info.kind}) cannot load weights through the service; "
            "update it yourself between Pause and Resume (docs/training.md)"
        )

    async def set_weights_version(self, policy_version: int) -> None:  # noqa: B027 - most backends keep no version
        """Told the version of the weights it loaded last (vLLM records it as its weight version)."""


class TokenBackend(LLMBackend):
    """Token ids in, sampled token ids and their log-probs out."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> ChatTokenizer: ...

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Generation:
        """Raises LLMError on a failure that is not the policy's."""


class ChatBackend(LLMBackend):
    """Messages in, text and tool calls out (OpenAI chat API)."""

    @abc.abstractmethod
    async def chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
        *,
        native_tools: bool = False,
    ) -> ChatResult:
        """One completion. Raises LLMError on a failure that is not the policy's.

        `native_tools`: send `tools` in the request even where the backend does not by default
        (an agent program on the model gateway expects tool calls from the API)."""
