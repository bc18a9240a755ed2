"""Records a trajectory as it happens and emits its events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf.duration_pb2 import Duration

from prorl_client import v1
from prorl_server.agents.tool_calls import ParsedCall
from prorl_server.agents.tools import ToolOutput
from prorl_server.llm.base import ChatResult

EventSink = Callable[..., Any]
"""Appends one event: called with exactly one keyword, the event kind."""


def duration(seconds: float) -> Duration:
    value = Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


class TurnObserver(Protocol):
    """Told of every model turn and tool call (metrics)."""

    def model_turn(self, backend: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None: ...

    def tool_call(self, tool: str, seconds: float) -> None: ...


class TrajectoryRecorder:
    def __init__(self, emit: EventSink, observer: TurnObserver | None = None) -> None:
        self._emit = emit
        self._observer = observer
        self.messages: list[dict[str, Any]] = []
        self.policy_versions: list[int] = []
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
            )
        )

    def tool_call(self, turn: int, call: ParsedCall) -> None:
        self._emit(
            tool_call=v1.ToolCall(
                turn=turn,
                call=v1.ToolCallSpec(id=call.id, name=call.name, arguments_json=call.arguments_json),
            )
        )

    def tool_result(self, turn: int, call: ParsedCall, output: ToolOutput) -> None:
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

    def to_proto(self, tokens: tuple[list[int], list[int], list[float]] = ([], [], [])) -> v1.Trajectory:
        """The trajectory; `tokens` is (token_ids, loss_mask, logprobs) when the backend gave ids."""
        token_ids, loss_mask, logprobs = tokens
        return v1.Trajectory(
            messages=[_message(m) for m in self.messages],
            token_ids=token_ids,
            loss_mask=loss_mask,
            logprobs=logprobs,
            turn_policy_versions=self.policy_versions,
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
