"""TRL: a `GRPOTrainer(rollout_func=...)` whose completions are prorl rollouts.

Written against trl 1.16.0 (trl/trainer/grpo_trainer.py): `RolloutFunc =
Callable[[list[str], GRPOTrainer], dict[str, Any]]`. The trainer hands over the
prompts of its process, each already repeated `num_generations` times in a row
(its RepeatSampler), and wants one completion per prompt back: `prompt_ids`,
`completion_ids` and `logprobs` (lists per sample). Every other key is an
"extra field": `env_mask` is taken as the tool mask (1 on model tokens, 0 on
environment tokens, multiplied into the completion mask), the rest is handed to
the reward functions as keyword arguments, one value per sample.

So prorl's reward travels as the extra field `prorl_reward` and `prorl_reward`
(the reward function below) returns it. For an infrastructure failure it is
None: TRL then counts the sample as unscorable, leaves it out of its group's
baseline and gives it advantage 0, and `env_mask` is all zeros besides.

Nothing here imports TRL; `rollout_func` is a plain callable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prorl_client import v1
from prorl_client.bridges._core import Rollout, Sample, Task, run_batch_at, run_sync

TaskOf = Callable[[Any], Task]
"""Turns one dataset prompt (a string or a list of chat messages) into a prorl task."""


class RolloutFunc:
    """A TRL `rollout_func` that runs each prompt as a prorl job.

    target: the prorl server (or servers), as for `Client.connect`.
    task_of: the prorl task of a prompt; the dataset's prompt must carry what the
        task needs (TRL passes nothing else to a rollout_func).
    template: settings of every request (limits, sandbox, min_policy_version, ...).
    pad_token_id: the token given to samples with nothing sampled (the trainer's
        tokenizer's pad token), masked.
    num_generations: the trainer's `num_generations`: consecutive runs of that many
        prompts form one GRPO group. None: the trainer's own, read at each call.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        task_of: TaskOf,
        *,
        template: v1.RolloutRequest | None = None,
        pad_token_id: int = 0,
        num_generations: int | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.target = target
        self.task_of = task_of
        self.template = template
        self.pad_token_id = pad_token_id
        self.num_generations = num_generations
        self.labels = {"bridge": "trl", **(labels or {})}
        self.calls = 0
        self.last: list[Rollout] = []
        """The rollouts of the last call, for inspection and logging."""

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, Any]:
        size = self.num_generations or _trainer_generations(trainer)
        step = getattr(getattr(trainer, "state", None), "global_step", self.calls)
        self.calls += 1
        samples = [
            Sample(self.task_of(prompt), group_id=f"trl-{step}-{self.calls}-{i // size}")
            for i, prompt in enumerate(prompts)
        ]
        options: dict[str, Any] = {"template": self.template, "pad_token_id": self.pad_token_id}
        rollouts = run_sync(lambda: run_batch_at(self.target, samples, labels=self.labels, **options))
        self.last = rollouts
        return batch_output(rollouts)


def _trainer_generations(trainer: Any) -> int:
    mode_eval = trainer is not None and not getattr(getattr(trainer, "model", None), "training", True)
    value = getattr(trainer, "num_generations_eval" if mode_eval else "num_generations", None)
    return int(value) if value else 1


def batch_output(rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """The dict a rollout_func returns, from rollouts in the prompts' order."""
    return {
        "prompt_ids": [r.prompt_ids for r in rollouts],
        "completion_ids": [r.response_ids for r in rollouts],
        "logprobs": [r.response_logprobs for r in rollouts],
        "env_mask": [r.response_mask for r in rollouts],
        "prorl_reward": [None if r.masked else r.reward for r in rollouts],
        "prorl_job_id": [r.job_id for r in rollouts],
        "prorl_status": [r.status for r in rollouts],
        "prorl_policy_versions": [r.turn_policy_versions for r in rollouts],
    }


def prorl_reward(completions: list[Any], prorl_reward: list[float | None], **kwargs: Any) -> list[float | None]:
    """A TRL reward function giving each completion its prorl reward (None: unscorable)."""
    return list(prorl_reward)
