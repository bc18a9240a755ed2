"""Trainer bridges: a trainer's batch of prompts in, prorl rollouts in its batch format out.

One module per trainer, each importable without its trainer installed (they
fill the trainer's types by field, never import them): `trl` (GRPOTrainer's
`rollout_func`), `verl` (an agent loop's `run`), `skyrl` (a `GeneratorInterface`)
and `slime` (a `--rollout-function-path` function). They share `_core`: requests
for a batch (n samples per prompt in one GRPO group), run over one stream, and
each trajectory cut into prompt and response with aligned loss mask, log-probs
and policy versions; infrastructure failures masked, never scored as 0
(docs/bridges.md).
"""

from prorl_client.bridges._core import (
    RequestRejected,
    Rollout,
    Sample,
    Task,
    is_infrastructure_failure,
    neutral_rewards,
    run_batch,
    sampling_params,
    split,
)

__all__ = [
    "RequestRejected",
    "Rollout",
    "Sample",
    "Task",
    "is_infrastructure_failure",
    "neutral_rewards",
    "run_batch",
    "sampling_params",
    "split",
]
