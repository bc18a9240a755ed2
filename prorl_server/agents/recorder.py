"""Records a trajectory as it happens and emits its events.

Tool output is bounded here, where every result enters the trajectory, the
events and the model's next prompt: a job keeps at most
`TOOL_OUTPUT_BUDGET_BYTES` of it (UTF-8), each result cut head and tail (the
rule of sandbox/output.py) to what is left, and to `SPENT_RESULT_BYTES` once
the budget is spent. The sandbox caps each result before (sandbox.max_output_bytes);
this budget is what keeps a job's events and result readable over gRPC (4 MiB
per message by default) whatever its commands print.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf.duration_pb2 import Duration

from prorl_client import v1
from prorl_server.agents.tool_calls import ParsedCall
from prorl_server.agents.tools import ToolOutput
from prorl_server.llm.base import ChatResult
from prorl_server.sandbox.output import cap_text

LOGPROBS_MODES = {"processed": v1.LOGPROBS_MODE_PROCESSED, "raw": v1.LOGPROBS_MODE_RAW}

EventSink = Callable[..., Any]
"""Appends one event: called with exactly one keyword, the event kind."""

TOOL_OUTPUT_BUDGET_BYTES = 1 << 20
SPENT_RESULT_BYTES = 512


def duration(seconds: float) -> Duration:
    value = Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


class TurnObserver(Protocol):
    """Told of every model turn and tool call (metrics)."""

    def model_turn(self, backend: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None: ...

    def tool_call(self, tool: str, seconds: float) -> None: ...


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
        self.messages: list[dict[str, Any]] = []
        self.policy_versions: list[int] = []
        self.turn_spans: list[v1.TurnSpan] = []
        self.num_turns = 0
        self.format_errors = 0
        self.llm_s = 0.0
        self.tools_s = 0.0

    def add_message(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def model_turn(self, turn: int, result: ChatResult) -> None:
        self.num_turns += 1
        self.llm_s += result.latency_s
        self.policy_versions.append(result.policy_version)
        logprobs_mode = v1.LOGPROBS_MODE_UNSPECIFIED
        if result.logprobs:
            logprobs_mode = LOGPROBS_MODES.get(result.logprobs_mode, v1.LOGPROBS_MODE_UNSPECIFIED)
        if result.token_offset >= 0:
            end = result.token_offset + len(result.token_ids)
            self.turn_spans.append(
                v1.TurnSpan(
                    turn=turn,
                    start=result.token_offset,
                    end=end,
                    policy_version=result.policy_version,
                    logprobs_mode=logprobs_mode,
                )
            )
        if self._observer is not None:
            self._observer.model_turn(
                result.backend_id, result.latency_s, result.prompt_tokens, result.completion_tokens
            )
        self._emit(
            model_turn=v1.ModelTurn(
                turn=turn,
                prompt_token_count=result.prompt_tokens,
                completion_token_count=result.completion_tokens,
                token_ids=result.token_ids,
                logprobs=result.logprobs,
                text=result.text,
                finish_reason=result.finish_reason,
                backend_id=result.backend_id,
                latency=duration(result.latency_s),
                policy_version=result.policy_version,
                switched_from_backend=result.switched_from_backend,
                prefill=duration(result.prefill_s) if result.prefill_s is not None else None,
                decode=duration(result.decode_s) if result.decode_s is not None else None,
                logprobs_mode=logprobs_mode,
                token_offset=result.token_offset,
            )
        )

    def tool_call(self, turn: int, call: ParsedCall) -> None:
        self._emit(
            tool_call=v1.ToolCall(
                turn=turn,
                call=v1.ToolCallSpec(id=call.id, name=call.name, arguments_json=call.arguments_json),
            )
        )

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
        self._emit(
            tool_result=v1.ToolResult(
                turn=turn,
                call_id=call.id,
                name=call.name,
                output=output.output,
                exit_code=output.exit_code,
                truncated=output.truncated,
                duration=duration(output.duration_s),
                error=output.error,
            )
        )
        return output

    def to_proto(self, tokens: tuple[list[int], list[int], list[float]] = ([], [], [])) -> v1.Trajectory:
        """The trajectory; `tokens` is (token_ids, loss_mask, logprobs) when the backend gave ids."""
        token_ids, loss_mask, logprobs = tokens
        return v1.Trajectory(
            messages=[_message(m) for m in self.messages],
            token_ids=token_ids,
            loss_mask=loss_mask,
            logprobs=logprobs,
            turn_policy_versions=self.policy_versions,
            turn_spans=self.turn_spans,
            format_errors=self.format_errors,
            num_turns=self.num_turns,
        )


def _message(message: dict[str, Any]) -> v1.Message:
    calls = [
        v1.ToolCallSpec(
            id=str(call.get("id", "")),
            name=str(call.get("function", {}).get("name", "")),
            arguments_json=str(call.get("function", {}).get("arguments", "")),
        )
        for call in message.get("tool_calls") or []
    ]
    return v1.Message(
        role=str(message.get("role", "")),
        content=str(message.get("content") or ""),
        tool_calls=calls,
        tool_call_id=str(message.get("tool_call_id", "")),
        name=str(message.get("name", "")),
    )
