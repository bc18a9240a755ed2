"""What an agent reports while it runs, as plain values.

The recorder hands these to the job's event sink; the jobs layer turns them
into the contract's messages (jobs/wire.py), so agents never build protobufs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prorl_server.agents.outcomes import ToolOutput
from prorl_server.llm.base import ChatResult
from prorl_server.llm.tool_calls import ParsedCall


@dataclass(frozen=True)
class TurnSpan:
    """Where one model turn's sampled ids lie in the job's token trajectory."""

    turn: int
    start: int
    end: int
    policy_version: int
    logprobs_mode: str
    """"processed", "raw", or "" when the turn has no log-probs."""
    resampled: bool = False
    """Sampled again after a Pause aborted it (ChatResult.resampled)."""


@dataclass(frozen=True)
class ModelTurnEvent:
    turn: int
    result: ChatResult
    logprobs_mode: str
    """As in TurnSpan: "" when the backend gave no log-probs for this turn."""


@dataclass(frozen=True)
class ToolCallEvent:
    turn: int
    call: ParsedCall


@dataclass(frozen=True)
class ToolResultEvent:
    turn: int
    call: ParsedCall
    output: ToolOutput
    """As the trajectory keeps it (bounded by the recorder)."""


AgentEvent = ModelTurnEvent | ToolCallEvent | ToolResultEvent
EventSink = Callable[[AgentEvent], None]
