"""The one place where the server's values become the contract's messages, and back.

Agents report plain values (agents/events.py, agents/outcomes.py); the job
code turns them into `prorl.v1` messages here: events, the trajectory, the
result's details, times and durations.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from prorl_client import v1
from prorl_server.agents.events import AgentEvent, ModelTurnEvent, ToolCallEvent, ToolResultEvent, TurnSpan
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.gateway.chains import TokenChain
from prorl_server.jobs.record import JobView
from prorl_server.llm.base import ChatMessage, RoutedExperts

LOGPROBS_MODES = {"processed": v1.LOGPROBS_MODE_PROCESSED, "raw": v1.LOGPROBS_MODE_RAW}
PHASE_NAMES = {v1.PHASE_INIT: "init", v1.PHASE_RUN: "run", v1.PHASE_EVAL: "eval"}


def duration(seconds: float) -> Duration:
    value = Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def seconds(value: Duration) -> float:
    return float(value.seconds) + float(value.nanos) / 1e9


def timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    value = Timestamp()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def to_struct(data: dict[str, Any]) -> Struct:
    """A JSON-like dict as a Struct; values JSON cannot hold become their text."""
    struct = Struct()
    struct.update(json.loads(json.dumps(data, default=str)))
    return struct


def status_name(status: v1.JobStatus) -> str:
    """ "succeeded", "failed", ...: as metrics and logs name a status."""
    return v1.JobStatus.Name(status).removeprefix("JOB_STATUS_").lower()


def agent_event(event: AgentEvent) -> dict[str, Any]:
    """The event as the keyword EventLog.append takes (its kind and message)."""
    if isinstance(event, ModelTurnEvent):
        result = event.result
        return {
            "model_turn": v1.ModelTurn(
                turn=event.turn,
                prompt_token_count=result.prompt_tokens,
                completion_token_count=result.completion_tokens,
                token_ids=result.token_ids,
                logprobs=result.logprobs,
                text=result.text,
                finish_reason=result.finish_reason,
                backend_id=result.backend_id,
                latency=duration(result.latency_s),
                model_wait=duration(result.model_wait_s),
                policy_version=result.policy_version,
                switched_from_backend=result.switched_from_backend,
                prefill=duration(result.prefill_s) if result.prefill_s is not None else None,
                decode=duration(result.decode_s) if result.decode_s is not None else None,
                logprobs_mode=LOGPROBS_MODES.get(event.logprobs_mode, v1.LOGPROBS_MODE_UNSPECIFIED),
                token_offset=result.token_offset,
                resampled=result.resampled,
                sampling_changes=[
                    v1.SamplingChange(field=name, asked=asked, used=used)
                    for name, asked, used in result.sampling_changes
                ],
            )
        }
    if isinstance(event, ToolCallEvent):
        call = event.call
        return {
            "tool_call": v1.ToolCall(
                turn=event.turn,
                call=v1.ToolCallSpec(id=call.id, name=call.name, arguments_json=call.arguments_json),
            )
        }
    if isinstance(event, ToolResultEvent):
        output = event.output
        return {
            "tool_result": v1.ToolResult(
                turn=event.turn,
                call_id=event.call.id,
                name=event.call.name,
                output=output.output,
                exit_code=output.exit_code,
                truncated=output.truncated,
                duration=duration(output.duration_s),
                error=output.error,
            )
        }
    raise TypeError(f"not an agent event: {event!r}")


def turn_span(span: TurnSpan) -> v1.TurnSpan:
    return v1.TurnSpan(
        turn=span.turn,
        start=span.start,
        end=span.end,
        policy_version=span.policy_version,
        logprobs_mode=LOGPROBS_MODES.get(span.logprobs_mode, v1.LOGPROBS_MODE_UNSPECIFIED),
        resampled=span.resampled,
    )


def message(message: Mapping[str, Any]) -> v1.Message:
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


def trajectory(
    recorder: TrajectoryRecorder,
    tokens: tuple[list[int], list[int], list[float]] = ([], [], []),
    chains: Sequence[TokenChain] = (),
    program_messages: Sequence[ChatMessage] = (),
) -> v1.Trajectory:
    """The trajectory; `tokens` is (token_ids, loss_mask, logprobs) when the backend gave ids.
    An agent program's calls come as `chains`; the top-level token fields then hold the last, and
    the messages are its last call's (`program_messages`) when the recorder kept none."""
    token_ids, loss_mask, logprobs = tokens
    spans = [turn_span(span) for span in recorder.turn_spans]
    if chains:
        last = chains[-1]
        token_ids, loss_mask, logprobs = last.token_ids, last.loss_mask, last.logprobs
        spans = chain_spans(last, recorder.turn_spans)
    return v1.Trajectory(
        messages=[message(m) for m in (recorder.messages or program_messages)],
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        turn_policy_versions=recorder.policy_versions,
        turns_by_policy_version=Counter(recorder.policy_versions),
        turn_spans=spans,
        format_errors=recorder.format_errors,
        num_turns=recorder.num_turns,
        chains=[token_chain(chain, recorder.turn_spans) for chain in chains],
        routed_experts=routed_experts(recorder.routed_experts),
    )


def routed_experts(routed: RoutedExperts | None) -> v1.RoutedExperts | None:
    if routed is None:
        return None
    return v1.RoutedExperts(
        num_tokens=routed.num_tokens, num_layers=routed.num_layers, top_k=routed.top_k, expert_ids=routed.expert_ids
    )


def chain_spans(chain: TokenChain, recorded: Sequence[TurnSpan]) -> list[v1.TurnSpan]:
    """Where each call merged into the chain sampled, with its policy version and logprobs mode."""
    by_call = {span.turn: span for span in recorded}
    spans = []
    for call, (start, end) in zip(chain.calls, chain.turn_spans, strict=False):
        known = by_call.get(call)
        version = known.policy_version if known else (chain.policy_versions[end - 1] if end else 0)
        mode, resampled = (known.logprobs_mode, known.resampled) if known else ("", False)
        spans.append(turn_span(TurnSpan(call, start, end, version, mode, resampled)))
    return spans


def token_chain(chain: TokenChain, recorded: Sequence[TurnSpan]) -> v1.TokenChain:
    return v1.TokenChain(
        token_ids=chain.token_ids,
        loss_mask=chain.loss_mask,
        logprobs=chain.logprobs,
        policy_versions=chain.policy_versions,
        calls=chain.calls,
        turn_spans=chain_spans(chain, recorded),
    )


def job(record: JobView) -> v1.Job:
    return v1.Job(
        job_id=record.job_id,
        status=record.status,
        phase=record.phase,
        handler=record.request.handler,
        group_id=record.request.group_id,
        labels=dict(record.request.labels),
        create_time=timestamp(record.create_time),
        start_time=timestamp(record.start_time),
        end_time=timestamp(record.end_time),
        last_seq=record.last_seq,
        result=record.result,
    )
