"""slime: a rollout function (`--rollout-function-path`) whose samples are prorl rollouts.

Written against slime commit 624b824a (2026-08-21): the function is called as
`generate_rollout(args, rollout_id, data_source, evaluation=False)`
(slime/rollout/base_types.py, `call_rollout_fn`, which also accepts the plain
`list[list[Sample]]` returned here). `data_source.get_samples(n)` gives the
groups: `n` prompts, each `n_samples_per_prompt` copies of its `Sample`
(slime/rollout/data_source.py). The bridge fills each `Sample`
(slime/utils/types.py) in place: `tokens` (prompt and response), `response_length`,
`loss_mask` and `rollout_log_probs` (response part only: slime asserts
`len(loss_mask) == response_length`), `reward`, `status`, `weight_versions` (one
per model turn) and `remove_sample`.

An infrastructure failure gets `remove_sample=True` (slime zeroes its loss mask)
and, since slime's group normalisation still averages over it, its group's mean
reward (`neutral_rewards`).

Nothing here imports slime: the samples are the caller's, their `Status` enum is
read from their class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prorl_client import v1
from prorl_client.bridges._core import Rollout, Sample, Task, neutral_rewards, run_batch_at, run_sync, sampling_params

TaskOf = Callable[[Any], Task]
"""The prorl task of one slime `Sample` (its prompt, label and metadata)."""


def task_from_metadata(sample: Any) -> Task:
    """The default: `sample.metadata` holds `handler` and `instance` (slime reads a
    dataset row's metadata column into it, `--metadata-key`)."""
    return Task(handler=str(sample.metadata["handler"]), instance=dict(sample.metadata["instance"]))


class RolloutFunction:
    """A slime rollout function; bind an instance at module level of your own and pass
    its path: `--rollout-function-path my_rollout.generate_rollout` with
    `generate_rollout = RolloutFunction("prorl.example:50051")`.

    eval_samples: for `evaluation=True`, the evaluation sets by name (slime calls the
        function with `evaluation=True` for `--eval-interval`); None: evaluation is
        not supported and raises.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        task_of: TaskOf = task_from_metadata,
        *,
        template: v1.RolloutRequest | None = None,
        pad_token_id: int = 0,
        eval_samples: Callable[[Any], Mapping[str, list[Any]]] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.target = target
        self.task_of = task_of
        self.template = template
        self.pad_token_id = pad_token_id
        self.eval_samples = eval_samples
        self.labels = {"bridge": "slime", **(labels or {})}

    def __call__(self, args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
        if evaluation:
            if self.eval_samples is None:
                raise NotImplementedError("pass eval_samples to RolloutFunction to evaluate through prorl")
            data: dict[str, dict[str, list[Any]]] = {}
            for name, samples in self.eval_samples(args).items():
                self.fill(args, rollout_id, [[s] for s in samples])
                data[name] = {
                    "rewards": [s.reward for s in samples],
                    "truncated": [s.status == type(s).Status.TRUNCATED for s in samples],
                    "samples": samples,
                }
            return data
        groups = data_source.get_samples(args.rollout_batch_size)
        self.fill(args, rollout_id, groups)
        return groups

    def fill(self, args: Any, rollout_id: int, groups: list[list[Any]]) -> list[list[Any]]:
        """Run every sample of `groups` and fill it in place."""
        flat = [sample for group in groups for sample in group]
        jobs = [
            Sample(self.task_of(sample), group_id=f"slime-{rollout_id}-{g}")
            for g, group in enumerate(groups)
            for sample in group
        ]
        options: dict[str, Any] = {
            "template": self.template,
            "sampling": _sampling(args),
            "labels": self.labels,
            "pad_token_id": self.pad_token_id,
        }
        rollouts = run_sync(lambda: run_batch_at(self.target, jobs, **options))
        for sample, rollout, reward in zip(flat, rollouts, neutral_rewards(rollouts), strict=True):
            fill_sample(sample, rollout, reward=reward)
        return groups


def _sampling(args: Any) -> v1.SamplingParams:
    return sampling_params(
        {
            "temperature": getattr(args, "rollout_temperature", None),
            "top_p": getattr(args, "rollout_top_p", None),
            "max_new_tokens": getattr(args, "rollout_max_response_len", None),
            "stop": getattr(args, "rollout_stop", None),
            "seed": getattr(args, "rollout_seed", None),
        }
    )


def fill_sample(sample: Any, rollout: Rollout, *, reward: float) -> None:
    """Write one rollout into a slime `Sample`."""
    status = type(sample).Status
    sample.tokens = [*rollout.prompt_ids, *rollout.response_ids]
    sample.response_length = len(rollout.response_ids)
    sample.loss_mask = list(rollout.response_mask)
    sample.rollout_log_probs = list(rollout.response_logprobs)
    sample.reward = reward
    sample.weight_versions = [str(v) for v in rollout.turn_policy_versions]
    if rollout.routed_experts is not None:  # MoE routing replay: [tokens][layers][top_k] over sample.tokens
        sample.rollout_routed_experts = rollout.routed_experts
    sample.remove_sample = rollout.masked
    sample.response = _response_text(rollout)
    if rollout.masked:
        sample.status = status.ABORTED
    elif rollout.status == "timed_out" or rollout.stop_reason in ("max_turns", "context_length"):
        sample.status = status.TRUNCATED
    elif rollout.status == "succeeded":
        sample.status = status.COMPLETED
    else:
        sample.status = status.FAILED
    sample.metadata = {
        **(sample.metadata or {}),
        "prorl_job_id": rollout.job_id,
        "prorl_status": rollout.status,
        "prorl_reason": rollout.reason,
    }


def _response_text(rollout: Rollout) -> str:
    """The model's messages after the prompt, as text (what slime logs and shows)."""
    if rollout.result is None:
        return ""
    return "\n".join(m.content for m in rollout.result.trajectory.messages if m.role == "assistant")
