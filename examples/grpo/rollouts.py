"""GRPO groups as prorl jobs: one request per sample, `group_id` per task, results as samples.

A sample keeps exactly what the trainer needs from a finished job: the token
ids, the loss mask, the service's log-probs (the old policy's, under the
sampling temperature), the reward, and the policy versions that sampled it.
Infrastructure failures (a sandbox that would not start, an unreachable model)
are kept apart: they say nothing about the policy and are masked out of
training, never scored as 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from prorl_client import Client, v1

_jobs = itertools.count()


@dataclasses.dataclass(frozen=True)
class Task:
    """One task line: a family (handler) and its instance."""

    id: str
    handler: str
    instance: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Sample:
    job_id: str
    task_id: str
    group_id: str
    reward: float
    infrastructure_failure: bool
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    """The policy version of each model turn."""
    answer: str | None
    text: str
    """The model's replies, joined (for the log)."""

    @property
    def trainable(self) -> bool:
        return not self.infrastructure_failure and any(self.loss_mask)


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    max_tokens: int = 48
    max_turns: int = 1
    seed: int | None = None


def requests(
    tasks: Sequence[Task], group_size: int, sampling: Sampling, *, run_id: str, min_policy_version: int = 0
) -> list[v1.RolloutRequest]:
    """`group_size` jobs per task, one GRPO group each (group_id), with distinct seeds."""
    built = []
    for task in tasks:
        group_id = f"{run_id}-{task.id}-{next(_jobs)}"
        for index in range(group_size):
            request = v1.RolloutRequest(
                job_id=f"{group_id}-{index}",
                handler=task.handler,
                group_id=group_id,
                min_policy_version=min_policy_version,
            )
            request.instance.update(task.instance)
            request.labels["task_id"] = task.id
            request.sampling.temperature = sampling.temperature
            request.sampling.max_tokens = sampling.max_tokens
            if sampling.seed is not None:
                request.sampling.seed = sampling.seed + index
            request.limits.max_turns = sampling.max_turns
            built.append(request)
    return built


def to_sample(request: v1.RolloutRequest, result: v1.RolloutResult) -> Sample:
    trajectory = result.trajectory
    infrastructure = result.status != v1.JOB_STATUS_SUCCEEDED and result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE
    answer = dict(result.details.items()).get("answer")
    return Sample(
        job_id=request.job_id,
        task_id=request.labels["task_id"],
        group_id=request.group_id,
        reward=result.reward,
        infrastructure_failure=infrastructure,
        token_ids=tuple(trajectory.token_ids),
        loss_mask=tuple(trajectory.loss_mask),
        logprobs=tuple(trajectory.logprobs),
        policy_versions=tuple(trajectory.turn_policy_versions),
        answer=None if answer is None else str(answer),
        text="\n".join(m.content for m in trajectory.messages if m.role == "assistant"),
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    samples: list[Sample]
    seconds: float
    rejected: int


async def collect(client: Client, batch: Sequence[v1.RolloutRequest]) -> Batch:
    """Run every request over one RolloutStream; the finished jobs as samples."""
    started = time.perf_counter()
    by_id = {request.job_id: request for request in batch}
    samples: list[Sample] = []
    rejected = 0
    async for item in client.rollout_many(batch):
        if isinstance(item, v1.RolloutRejected):
            rejected += 1
        elif item.HasField("finished"):
            samples.append(to_sample(by_id[item.job_id], item.finished.result))
    return Batch(samples, time.perf_counter() - started, rejected)
