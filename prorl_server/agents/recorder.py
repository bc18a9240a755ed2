"""Records a trajectory as it happens and reports its events.

Tool output is bounded here, where every result enters the trajectory, the
events and the model's next prompt: a job keeps at most
`TOOL_OUTPUT_BUDGET_BYTES` of it (UTF-8), each result cut head and tail (the
rule of sandbox/output.py) to what is left, and to `SPENT_RESULT_BYTES` once
the budget is spent. The sandbox caps each result before (sandbox.max_output_bytes);
this budget is what keeps a job's events and result readable over gRPC (4 MiB
per message by default) whatever its commands print.

The recorder holds plain values; the jobs layer turns them into the
contract's messages (jobs/wire.py).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from prorl_server.agents.events import EventSink, ModelTurnEvent, ToolCallEvent, ToolResultEvent, TurnSpan
from prorl_server.agents.outcomes import ToolOutput
from prorl_server.llm.base import ChatMessage, ChatResult, RoutedExperts
from prorl_server.llm.tool_calls import ParsedCall
from prorl_server.sandbox.output import cap_text

TOOL_OUTPUT_BUDGET_BYTES = 1 << 20
SPENT_RESULT_BYTES = 512
LOGPROBS_MODES = ("processed", "raw")


class TurnObserver(Protocol):
    """Told of every model turn and tool call (metrics)."""

    def model_turn(self, backend: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None: ...

    def tool_call(self, tool: str, seconds: float) -> None: ...


@dataclasses.dataclass(frozen=True)
class RecorderMark:
    """A turn boundary of a recorder (TrajectoryRecorder.mark): its lists only grow."""

    turn: int
    messages: int
    policy_versions: int
    turn_spans: int
    num_turns: int
    format_errors: int
    tool_output_left: int
    routed_experts: RoutedExperts | None


class TrajectoryRecorder:
    def __init__(
        self,
        emit: EventSink,
        observer: TurnObserver | None = None,
        *,
        tool_output_budget: int = TOOL_OUTPUT_BUDGET_BYTES,
    ) -> None:
        self._emit = emit
        self._observer = observer
        self._tool_output_left = tool_output_budget
        self._tool_output_budget = tool_output_budget
        self.messages: list[ChatMessage] = []
        self.policy_versions: list[int] = []
        self.turn_spans: list[TurnSpan] = []
        self.routed_experts: RoutedExperts | None = None
        """The last model turn's MoE routing (it covers the whole trajectory), where reported."""
        self.num_turns = 0
        self.format_errors = 0
        self.llm_s = 0.0
        self.tools_s = 0.0

    def mark(self, turn: int) -> RecorderMark:
        """The trajectory as it stands after `turn`'s tool results."""
        return RecorderMark(
            turn,
            len(self.messages),
            len(self.policy_versions),
            len(self.turn_spans),
            self.num_turns,
            self.format_errors,
            self._tool_output_left,
            self.routed_experts,
        )

    def branch(self, mark: RecorderMark, emit: EventSink, observer: TurnObserver | None = None) -> TrajectoryRecorder:
        """A recorder for a fork: this one's trajectory up to `mark`, its events to `emit`.
        Time spent (llm_s, tools_s) starts at 0: it is the fork's own."""
        other = TrajectoryRecorder(emit, observer, tool_output_budget=self._tool_output_budget)
        other.messages = [m.copy() for m in self.messages[: mark.messages]]
        other.policy_versions = self.policy_versions[: mark.policy_versions]
        other.turn_spans = self.turn_spans[: mark.turn_spans]
        other.num_turns = mark.num_turns
        other.format_errors = mark.format_errors
        other._tool_output_left = mark.tool_output_left
        other.routed_experts = mark.routed_experts
        return other

    def add_message(self, message: ChatMessage) -> None:
        self.messages.append(message)

    def model_turn(self, turn: int, result: ChatResult) -> None:
        self.num_turns += 1
        self.llm_s += result.latency_s
        self.policy_versions.append(result.policy_version)
        logprobs_mode = result.logprobs_mode if result.logprobs and result.logprobs_mode in LOGPROBS_MODES else ""
        if result.token_offset >= 0:
            end = result.token_offset + len(result.token_ids)
            self.turn_spans.append(
                TurnSpan(turn, result.token_offset, end, result.policy_version, logprobs_mode, result.resampled)
            )
            self.routed_experts = result.routed_experts
        if self._observer is not None:
            self._observer.model_turn(
                result.backend_id, result.latency_s, result.prompt_tokens, result.completion_tokens
            )
        self._emit(ModelTurnEvent(turn, result, logprobs_mode))

    def tool_call(self, turn: int, call: ParsedCall) -> None:
        self._emit(ToolCallEvent(turn, call))

    def bound(self, output: ToolOutput) -> ToolOutput:
        """The output as the trajectory keeps it: cut to what is left of the job's budget."""
        spent = self._tool_output_left < SPENT_RESULT_BYTES
        text, cut = cap_text(output.output, max(self._tool_output_left, SPENT_RESULT_BYTES))
        if cut and spent:
            text += (
                f"\n[this job's tool output budget ({self._tool_output_budget} bytes) is spent: "
                f"each result is cut to {SPENT_RESULT_BYTES} bytes]"
            )
        self._tool_output_left = max(self._tool_output_left - len(text.encode()), 0)
        return dataclasses.replace(output, output=text, truncated=output.truncated or cut)

    def tool_result(self, turn: int, call: ParsedCall, output: ToolOutput) -> ToolOutput:
        """Record one tool result; returns it as kept (bounded, see `bound`)."""
        output = self.bound(output)
        self.tools_s += output.duration_s
        if self._observer is not None:
            self._observer.tool_call(call.name, output.duration_s)
        if output.error:
            self.format_errors += 1
        self._emit(ToolResultEvent(turn, call, output))
        return output
