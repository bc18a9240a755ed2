"""SkyRL: a generator (`GeneratorInterface.generate`) whose trajectories are prorl rollouts.

Written against SkyRL commit a9564572 (2026-08-21), skyrl/train/generators/base.py:
`async generate(input_batch: GeneratorInput) -> GeneratorOutput`, both TypedDicts.
The input's `prompts` are already repeated `n_samples_per_prompt` times
(skyrl/train/generators/utils.py, `prepare_generator_input`), with `env_classes`,
`env_extras` and `trajectory_ids` (`instance_id`, `repetition_id`) per sample;
the output must keep that order. `loss_masks` and `rollout_logprobs` cover
`response_ids` only (1 on generated tokens, 0 on observations).

SkyRL has no unscorable sample: an infrastructure failure gets loss mask zeros
and its group's mean reward (`neutral_rewards`), so it moves neither the
baseline nor the policy; `rollout_metrics` counts them.

Nothing here imports SkyRL; subclass both to satisfy an isinstance check:
`class Generator(ProrlGenerator, GeneratorInterface): pass`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prorl_client import v1
from prorl_client._client import Client
from prorl_client.bridges._core import Rollout, Sample, Task, neutral_rewards, run_batch, sampling_params

TaskOf = Callable[[Any, str, Mapping[str, Any]], Task]
"""The prorl task of one sample, from its prompt (chat messages), env class and env extras."""


def task_from_extras(prompt: Any, env_class: str, env_extras: Mapping[str, Any]) -> Task:
    """The default: the env class names the prorl handler and `env_extras["instance"]`
    is the task instance (a dataset row's extra columns become SkyRL's env_extras)."""
    return Task(handler=env_class, instance=dict(env_extras["instance"]))


class ProrlGenerator:
    """A SkyRL generator over a prorl client.

    client: an open client (SkyRL calls `generate` on its own event loop; open the
        client there, e.g. in the trainer's set-up).
    template: settings of every request (limits, sandbox, min_policy_version, ...).
    pad_token_id: the token given to samples with nothing sampled, masked.
    """

    def __init__(
        self,
        client: Client,
        task_of: TaskOf = task_from_extras,
        *,
        template: v1.RolloutRequest | None = None,
        pad_token_id: int = 0,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.task_of = task_of
        self.template = template
        self.pad_token_id = pad_token_id
        self.labels = {"bridge": "skyrl", **(labels or {})}

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        prompts = list(input_batch["prompts"])
        env_classes = list(input_batch["env_classes"])
        extras = input_batch.get("env_extras") or [{} for _ in prompts]
        ids = input_batch.get("trajectory_ids")
        samples = [
            Sample(self.task_of(prompt, env_class, extra), group_id=_group_of(ids, i))
            for i, (prompt, env_class, extra) in enumerate(zip(prompts, env_classes, extras, strict=True))
        ]
        rollouts = await run_batch(
            self.client,
            samples,
            template=self.template,
            sampling=sampling_params(input_batch.get("sampling_params")),
            labels=self.labels,
            pad_token_id=self.pad_token_id,
        )
        return generator_output(rollouts, trajectory_ids=ids)


def _group_of(trajectory_ids: Sequence[Any] | None, index: int) -> str:
    if trajectory_ids is None:
        return f"skyrl-{index}"
    return f"skyrl-{trajectory_ids[index].instance_id}"


def generator_output(rollouts: Sequence[Rollout], *, trajectory_ids: Sequence[Any] | None = None) -> dict[str, Any]:
    """A GeneratorOutput, from rollouts in the input's order."""
    masked = sum(r.masked for r in rollouts)
    scored = [r.reward for r in rollouts if not r.masked]
    return {
        "prompt_token_ids": [r.prompt_ids for r in rollouts],
        "response_ids": [r.response_ids for r in rollouts],
        "rewards": neutral_rewards(rollouts),
        "loss_masks": [r.response_mask for r in rollouts],
        "stop_reasons": [r.stop_reason or r.status for r in rollouts],
        "rollout_metrics": {
            "prorl/infrastructure_failures": masked,
            "prorl/mean_reward": sum(scored) / len(scored) if scored else 0.0,
        },
        "rollout_logprobs": [r.response_logprobs for r in rollouts],
        "trajectory_ids": list(trajectory_ids) if trajectory_ids is not None else None,
        "trajectory_generation_times": [_seconds(r) for r in rollouts],
        "trajectory_time_splits": None,
        # [batch][tokens][layers][top_k] where every sample has its routing (an MoE model on vLLM), else None.
        "rollout_expert_indices": (
            [r.routed_experts for r in rollouts] if rollouts and all(r.routed_experts for r in rollouts) else None
        ),
        "is_last_step": None,
        "env_metrics": [{"prorl_job_id": r.job_id, "prorl_status": r.status} for r in rollouts],
        "pixel_values": None,
        "image_grid_thw": None,
    }


def _seconds(rollout: Rollout) -> float:
    if rollout.result is None:
        return 0.0
    return rollout.result.timing.total.ToTimedelta().total_seconds()
