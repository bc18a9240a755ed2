"""What every trainer bridge shares: a batch of tasks in, one `Rollout` per sample out.

A batch runs over one `RolloutStream` (`Client.rollout_many`), so a whole GRPO
batch is one call and the jobs finish in any order; `run_batch` puts the results
back in the order of the tasks. Each trajectory is then cut where the trainers
cut it: the *prompt* is `token_ids` up to the first sampled token, the
*response* is the rest, model and tool tokens interleaved, with the loss mask,
log-probs and policy versions aligned to it.

Infrastructure failures (the sandbox or a backend failed, the server refused the
job for load, the job was cancelled) say nothing about the policy: such a sample
is `masked` (no loss on any of its tokens) and must not be scored as reward 0,
or it drags its group's baseline down and pushes the other samples up. Each
bridge excludes it from the group the way its trainer allows (an unscorable
reward, a removed sample, or the group's mean as a neutral reward, see
`neutral_rewards`). Policy failures (budget spent, a sandbox broken by the model)
keep their reward and their tokens.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from prorl_client import v1
from prorl_client._client import Client

T = TypeVar("T")

# Refusals that say the service is busy or going away, not that the request is wrong.
_TRANSIENT_REJECTIONS = frozenset(
    code.value[0]
    for code in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
    )
)


class RequestRejected(ValueError):
    """The server refused a request of the batch as invalid (a bad task, an unknown handler):
    a bug in the data, raised rather than trained on as a failure."""


@dataclass(frozen=True)
class Task:
    """One prompt of the trainer's batch, as prorl runs it."""

    handler: str
    """The task family (`math`, `stem`, `code`, `swe`, `command`)."""
    instance: Mapping[str, Any]
    """The task instance, the family's JSON object (docs/handlers.md)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels of this task's jobs, over the bridge's own."""
    request: v1.RolloutRequest | None = None
    """Settings of this task's jobs over the bridge's template (its set fields win), e.g.
    the sandbox image of a SWE task or its own limits."""


@dataclass(frozen=True)
class Rollout:
    """One sample: a prorl result cut into the prompt/response shape trainers use."""

    job_id: str
    group_id: str
    result: v1.RolloutResult | None
    """None when the server refused the request (then `masked`)."""
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 on tokens the policy sampled, 0 on tool output (and on everything when masked)."""
    response_logprobs: list[float]
    response_policy_versions: list[int]
    """Per response token: the version that sampled it; a tool token has the version of the turn before it."""
    reward: float
    masked: bool
    """An infrastructure failure: train on none of its tokens and leave it out of its group's statistics."""
    reason: str
    """The failure's stable reason ("" when it succeeded), or `rejected:<code>`."""
    routed_experts: list[list[list[int]]] | None = None
    """MoE routing replay: per token of prompt_ids + response_ids from the first, per layer, the
    experts chosen ([tokens][layers][top_k]; vLLM reports all but the last sampled token). None
    where the backend reported none (a dense model, a chat backend): never made up."""

    @property
    def turn_policy_versions(self) -> list[int]:
        return list(self.result.trajectory.turn_policy_versions) if self.result is not None else []

    @property
    def status(self) -> str:
        """The job's status without its prefix: `succeeded`, `failed`, `cancelled`, `timed_out`, `rejected`."""
        if self.result is None:
            return "rejected"
        return v1.JobStatus.Name(self.result.status).removeprefix("JOB_STATUS_").lower()

    @property
    def stop_reason(self) -> str:
        """How the agent loop ended (`finish`, `max_turns`, `context_length`, ...), "" when it did not say."""
        if self.result is None or "stop_reason" not in self.result.details:
            return ""
        return str(self.result.details["stop_reason"])


def is_infrastructure_failure(result: v1.RolloutResult) -> bool:
    """Whether the result says nothing about the policy: an infrastructure failure, or a
    job cancelled from outside (by the trainer or an operator), whatever its failure kind."""
    if result.status == v1.JOB_STATUS_CANCELLED:
        return True
    return result.status != v1.JOB_STATUS_SUCCEEDED and result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE


def sampling_params(params: Mapping[str, Any] | None) -> v1.SamplingParams:
    """The trainer's sampling parameters under the names trainers use (`temperature`,
    `top_p`, `max_tokens` / `max_new_tokens` / `max_generate_length`, `stop`, `seed`);
    others (top_k, logprobs, ...) have no counterpart here and are left out."""
    sampling = v1.SamplingParams()
    if not params:
        return sampling
    if params.get("temperature") is not None:
        sampling.temperature = float(params["temperature"])
    if params.get("top_p") is not None:
        sampling.top_p = float(params["top_p"])
    for name in ("max_tokens", "max_new_tokens", "max_generate_length"):
        if params.get(name) is not None:
            sampling.max_tokens = int(params[name])
            break
    stop = params.get("stop")
    if stop:
        sampling.stop.extend([stop] if isinstance(stop, str) else list(stop))
    if params.get("seed") is not None:
        sampling.seed = int(params["seed"])
    return sampling


def build_request(
    task: Task,
    *,
    job_id: str,
    group_id: str,
    template: v1.RolloutRequest | None = None,
    sampling: v1.SamplingParams | None = None,
    labels: Mapping[str, str] | None = None,
) -> v1.RolloutRequest:
    """The request of one sample: the template's settings (limits, sandbox, retry,
    min_policy_version, ...), the trainer's sampling over the template's, the task."""
    request = v1.RolloutRequest()
    if template is not None:
        request.CopyFrom(template)
    if task.request is not None:
        request.MergeFrom(task.request)
    request.job_id = job_id
    request.group_id = group_id
    request.handler = task.handler
    request.instance.Clear()
    request.instance.update(dict(task.instance))
    if sampling is not None:
        request.sampling.MergeFrom(sampling)
    request.labels.update({**(labels or {}), **task.labels})
    return request


def split(job_id: str, group_id: str, result: v1.RolloutResult, *, pad_token_id: int = 0) -> Rollout:
    """Cut a result's trajectory into prompt and response (see the module's docstring).

    A trajectory with nothing sampled (a job that failed before its first turn, a
    non-token backend) has no response; trainers need one token, so it gets one
    `pad_token_id` with mask 0 (and a one-token prompt if it had none either).
    """
    trajectory = result.trajectory
    ids = list(trajectory.token_ids)
    mask = list(trajectory.loss_mask)
    logprobs = list(trajectory.logprobs)
    start = mask.index(1) if 1 in mask else len(ids)
    masked = is_infrastructure_failure(result)
    versions = _token_versions(trajectory, len(ids))
    prompt, response = ids[:start], ids[start:]
    response_mask = [0] * len(response) if masked else mask[start:]
    response_logprobs = logprobs[start:] if len(logprobs) == len(ids) else [0.0] * len(response)
    response_versions = versions[start:]
    if not response:
        response, response_mask, response_logprobs = [pad_token_id], [0], [0.0]
        response_versions = [versions[-1] if versions else 0]
    return Rollout(
        job_id=job_id,
        group_id=group_id,
        result=result,
        prompt_ids=prompt or [pad_token_id],
        response_ids=response,
        response_mask=response_mask,
        response_logprobs=response_logprobs,
        response_policy_versions=response_versions,
        reward=result.reward,
        masked=masked,
        reason=result.failure.reason if result.status != v1.JOB_STATUS_SUCCEEDED else "",
        routed_experts=routed_experts(trajectory),
    )


def routed_experts(trajectory: v1.Trajectory) -> list[list[list[int]]] | None:
    """The trajectory's routed experts as [tokens][layers][top_k], or None where it has none."""
    if not trajectory.HasField("routed_experts"):
        return None
    routed = trajectory.routed_experts
    ids, layers, top_k = list(routed.expert_ids), routed.num_layers, routed.top_k
    if len(ids) != routed.num_tokens * layers * top_k:
        raise ValueError(f"routed_experts has {len(ids)} ids, not {routed.num_tokens} x {layers} x {top_k}")
    per_layer = [ids[i : i + top_k] for i in range(0, len(ids), top_k)]
    return [per_layer[t * layers : (t + 1) * layers] for t in range(routed.num_tokens)]


def _token_versions(trajectory: v1.Trajectory, length: int) -> list[int]:
    """Per token, the policy version of the turn that sampled it or, for a token in
    between, of the turn before it (the prompt: the first turn's)."""
    spans = sorted(trajectory.turn_spans, key=lambda span: span.start)
    if not spans:
        first = trajectory.turn_policy_versions[0] if trajectory.turn_policy_versions else 0
        return [first] * length
    versions = [spans[0].policy_version] * length
    for span, following in zip(spans, [*spans[1:], None], strict=True):
        end = following.start if following is not None else length
        versions[span.start : end] = [span.policy_version] * (end - span.start)
    return versions


def rejected(job_id: str, group_id: str, rejection: v1.RolloutRejected, *, pad_token_id: int = 0) -> Rollout:
    """A refused request: raised when the request itself is wrong, else a masked sample."""
    if rejection.code not in _TRANSIENT_REJECTIONS:
        name = grpc.StatusCode.INVALID_ARGUMENT.name
        for code in grpc.StatusCode:
            if code.value[0] == rejection.code:
                name = code.name
        raise RequestRejected(f"the server refused job {job_id!r} ({name}): {rejection.message}")
    return Rollout(
        job_id=job_id,
        group_id=group_id,
        result=None,
        prompt_ids=[pad_token_id],
        response_ids=[pad_token_id],
        response_mask=[0],
        response_logprobs=[0.0],
        response_policy_versions=[0],
        reward=0.0,
        masked=True,
        reason=f"rejected:{rejection.code}",
    )


@dataclass(frozen=True)
class Sample:
    """One job of a batch: its task and the group (GRPO group) it belongs to."""

    task: Task
    group_id: str


async def run_batch(
    client: Client,
    samples: Sequence[Sample],
    *,
    template: v1.RolloutRequest | None = None,
    sampling: v1.SamplingParams | None = None,
    labels: Mapping[str, str] | None = None,
    job_prefix: str = "",
    pad_token_id: int = 0,
) -> list[Rollout]:
    """Run every sample over one stream; the rollouts come back in the samples' order.

    Job ids are `<job_prefix or a fresh id>-<index>`: unique per batch, so the
    results are matched to their samples whatever order they finish in.
    """
    prefix = job_prefix or f"b{uuid.uuid4().hex[:12]}"
    job_ids = [f"{prefix}-{index}" for index in range(len(samples))]
    requests = [
        build_request(s.task, job_id=job_id, group_id=s.group_id, template=template, sampling=sampling, labels=labels)
        for s, job_id in zip(samples, job_ids, strict=True)
    ]
    index = {job_id: i for i, job_id in enumerate(job_ids)}
    rollouts: list[Rollout | None] = [None] * len(samples)
    async for item in client.rollout_many(requests):
        if isinstance(item, v1.RolloutRejected):
            i = index[item.job_id]
            rollouts[i] = rejected(item.job_id, samples[i].group_id, item, pad_token_id=pad_token_id)
        elif item.HasField("finished") and item.job_id in index:
            i = index[item.job_id]
            rollouts[i] = split(item.job_id, samples[i].group_id, item.finished.result, pad_token_id=pad_token_id)
    missing = [job_ids[i] for i, rollout in enumerate(rollouts) if rollout is None]
    if missing:
        raise RuntimeError(f"the rollout stream ended without results for {missing}")
    return [rollout for rollout in rollouts if rollout is not None]


def neutral_rewards(rollouts: Sequence[Rollout]) -> list[float]:
    """Each rollout's reward, a masked one's replaced by the mean reward of its group's
    unmasked rollouts (0 when there are none).

    For trainers that compute group baselines over every sample and have no notion
    of an unscorable one: at the group's mean, a masked sample leaves the mean
    unchanged and gets advantage 0 (it shrinks the group's standard deviation a
    little, as one more sample at the mean would).
    """
    by_group: dict[str, list[float]] = {}
    for rollout in rollouts:
        if not rollout.masked:
            by_group.setdefault(rollout.group_id, []).append(rollout.reward)
    means = {group: math.fsum(values) / len(values) for group, values in by_group.items()}
    return [means.get(r.group_id, 0.0) if r.masked else r.reward for r in rollouts]


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine from a trainer's synchronous hook (TRL's rollout_func, slime's
    rollout function), on an event loop of its own for the call."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # none running: the usual case, run it below (not here, where its errors would chain to this one)
    else:
        raise RuntimeError(
            "a synchronous bridge was called inside a running event loop; await the async API (run_batch) instead"
        )
    return asyncio.run(factory())


async def run_batch_at(target: str | Sequence[str], samples: Sequence[Sample], **options: Any) -> list[Rollout]:
    """`run_batch` on a channel of its own, opened and closed around the batch: what a
    synchronous hook uses, since a gRPC asyncio channel belongs to one event loop."""
    async with Client.connect(target) as client:
        return await run_batch(client, samples, **options)
