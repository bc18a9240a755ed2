"""What the phases of a job hand on: value types only, imported by every agent module.

`run` returns a `RunOutcome` (how the agent stopped and what it submitted),
`evaluate` receives it and returns an `EvalOutcome`; a phase that raises is
classified into a `FailureInfo`. Nothing here imports other agent modules,
so there is no import cycle between the loop, the tools and the recorder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from prorl_server.sandbox.output import cap_text

StopReason = Literal["finish", "max_turns", "context_length", "agent_timeout", "program_exit", "program_timeout"]
""""finish" (the agent called finish), "max_turns", "context_length" (the conversation
outgrew the model's context: a policy outcome, evaluated as usual), or "agent_timeout" (the
task's own time for the agent ran out: a Harbor task's [agent] timeout_sec; evaluated as
usual, on what the agent left); for an agent program (the command family) "program_exit"
(it ended by itself, whatever its exit status) or "program_timeout" (it ran out of its time
and was killed)."""

# A result's details go out in the evaluation event and in the result: each text in them
# (log tails, a SWE patch) is cut head and tail to MAX_DETAIL_TEXT_BYTES, and all of them
# together to about MAX_DETAILS_BYTES, so that a result stays readable over gRPC.
MAX_DETAIL_TEXT_BYTES = 64 << 10
MAX_DETAILS_BYTES = 256 << 10
MAX_FAILURE_MESSAGE_BYTES = 4 << 10


@dataclass(frozen=True)
class Limits:
    max_turns: int
    tool_timeout_s: float


@dataclass(frozen=True)
class TaskNeeds:
    """What a task instance itself asks of its job (a Harbor task's task.toml), applied at
    Submit where the request does not say otherwise (jobs/validation.py)."""

    cpus: float | None = None
    memory_mib: int | None = None
    resources_from: str = ""
    """Where cpus and memory_mib come from, for messages."""
    budget_s: float = 0.0
    """The least job budget that lets the task's own time limits play out (0: none)."""
    budget_from: str = ""
    """How budget_s is made up, for messages."""


@dataclass(frozen=True)
class ToolOutput:
    output: str
    exit_code: int | None = None
    truncated: bool = False
    error: bool = False
    """The call could not run as asked (a policy format error)."""
    duration_s: float = 0.0
    ends_episode: bool = False
    """The agent is done (finish): the loop stops after this call."""
    answer: str | None = None
    """What the agent submitted with the call that ended the episode, if anything."""


@dataclass(frozen=True)
class RunOutcome:
    """How the agent's run ended; families whose submission is more than an answer extend it."""

    stop_reason: StopReason
    answer: str | None = None
    """The finish call's answer; None when the agent stopped without one."""


def _cap_texts(value: Any, limit: int) -> Any:
    if isinstance(value, str):
        return cap_text(value, limit)[0]
    if isinstance(value, dict):
        return {_cap_texts(str(key), limit): _cap_texts(item, limit) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cap_texts(item, limit) for item in value]
    return value


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, default=str).encode())


def bound_details(details: dict[str, Any]) -> dict[str, Any]:
    """`details` with every text cut to MAX_DETAIL_TEXT_BYTES (harder when there are many),
    and fields that still do not fit MAX_DETAILS_BYTES replaced by a note of their size."""
    for limit in (MAX_DETAIL_TEXT_BYTES, 1024):
        bounded: dict[str, Any] = _cap_texts(details, limit)
        if _json_bytes(bounded) <= MAX_DETAILS_BYTES:
            return bounded
    kept: dict[str, Any] = {}
    room = MAX_DETAILS_BYTES
    for key, value in sorted(details.items(), key=lambda item: _json_bytes(item[1])):
        for limit in (MAX_DETAIL_TEXT_BYTES, 1024):
            candidate = _cap_texts(value, limit)
            if _json_bytes(candidate) <= room:
                break
        else:
            candidate = f"[omitted: {_json_bytes(value)} bytes of details]"
        kept[_cap_texts(str(key), 1024)] = candidate
        room -= _json_bytes(candidate)
    return kept


@dataclass
class EvalOutcome:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)
    """Bounded on construction (see `bound_details`); the keys of each family are documented
    in docs/contract.md."""

    def __post_init__(self) -> None:
        self.details = bound_details(self.details)


@dataclass
class FailureInfo:
    """How a handler classifies an exception: infrastructure or policy."""

    infrastructure: bool
    reason: str
    message: str

    def __post_init__(self) -> None:
        self.message = cap_text(self.message, MAX_FAILURE_MESSAGE_BYTES)[0]
