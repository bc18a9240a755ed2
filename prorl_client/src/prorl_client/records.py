"""The record of one finished job in a RESULTS.jsonl file, as `prorl run` and `prorl tail` write it.

A module of its own so that both commands write the same fields, and the `prorl` command
(runner.py) can import `tail` at the top without the two importing each other.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict

from prorl_client import v1


def result_record(
    task_id: str,
    sample: int,
    result: v1.RolloutResult,
    *,
    handler: str = "",
    timeline: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    trajectory = result.trajectory
    return {
        "task_id": task_id,
        "sample": sample,
        "job_id": result.job_id,
        "handler": handler,
        "status": v1.JobStatus.Name(result.status),
        "reward": result.reward,
        "failure": MessageToDict(result.failure) if result.HasField("failure") else None,
        "messages": [MessageToDict(m) for m in trajectory.messages],
        "token_ids": list(trajectory.token_ids),
        "loss_mask": list(trajectory.loss_mask),
        "logprobs": [float(x) for x in trajectory.logprobs],
        "turn_policy_versions": list(trajectory.turn_policy_versions),
        # Where each turn's sampled ids are in token_ids (token backends), with its policy version.
        "turn_spans": [
            MessageToDict(span, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
            for span in trajectory.turn_spans
        ],
        "num_turns": trajectory.num_turns,
        "timing": MessageToDict(result.timing),
        "details": MessageToDict(result.details),
        "timeline": timeline or [],
    }
