"""The GRPO update: group-normalised advantages and a PPO-clipped loss over sampled tokens.

- Advantages: within a group (one task's samples), (reward - mean) / (std + eps).
  Samples lost to infrastructure failures are dropped before the statistics
  (they say nothing about the policy); a group whose rewards are all equal
  teaches nothing and is skipped.
- Old log-probs are the service's (the trajectory's `logprobs`, under the
  sampling temperature, exactly what was sampled); new ones are recomputed by
  the trainer at the same temperature. Their difference before the update is
  the service/trainer mismatch, reported as a metric.
- Loss: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) on every token with
  loss_mask 1, averaged over all such tokens of the step (token-level mean).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from examples.grpo.checkpoint import Llama, token_logprobs
from examples.grpo.rollouts import Sample


def advantages(samples: Sequence[Sample], *, eps: float = 1e-6) -> list[tuple[Sample, float]]:
    """(sample, advantage) for every trainable sample of a group whose rewards differ."""
    groups: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        if sample.trainable:
            groups[sample.group_id].append(sample)
    scored: list[tuple[Sample, float]] = []
    for members in groups.values():
        rewards = [s.reward for s in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        if std < eps:
            continue
        scored.extend((s, (s.reward - mean) / (std + eps)) for s in members)
    return scored


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Right-padded token ids and the (row, position) of every loss-masked token."""

    ids: torch.Tensor
    targets: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    """Per target token: its sample's advantage."""


def pack(scored: Sequence[tuple[Sample, float]], pad_id: int = 0) -> PackedBatch:
    width = max(len(s.token_ids) for s, _ in scored)
    ids = torch.full((len(scored), width), pad_id, dtype=torch.long)
    targets: list[tuple[int, int]] = []
    old: list[float] = []
    advantage: list[float] = []
    for row, (sample, value) in enumerate(scored):
        ids[row, : len(sample.token_ids)] = torch.tensor(sample.token_ids)
        for position, (mask, logprob) in enumerate(zip(sample.loss_mask, sample.logprobs, strict=True)):
            if mask and position > 0:
                targets.append((row, position))
                old.append(logprob)
                advantage.append(value)
    return PackedBatch(
        ids=ids,
        targets=torch.tensor(targets, dtype=torch.long).reshape(-1, 2),
        old_logprobs=torch.tensor(old, dtype=torch.float32),
        advantages=torch.tensor(advantage, dtype=torch.float32),
    )


def clipped_loss(
    new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's clipped surrogate, per token (to be summed and normalised by the caller)."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages)


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    samples: int
    tokens: int
    loss: float
    mismatch_mean_abs: float
    """Mean |trainer log-prob - service log-prob| over the step's tokens, before the update."""
    mismatch_max_abs: float
    clipped_share: float
    grad_norm: float


def grpo_update(
    model: Llama,
    optimizer: torch.optim.Optimizer,
    scored: Sequence[tuple[Sample, float]],
    *,
    temperature: float,
    clip: float = 0.2,
    micro_batch: int = 8,
    max_grad_norm: float = 1.0,
) -> UpdateStats | None:
    """One optimizer step on the scored samples; None when there is nothing to learn from."""
    if not scored:
        return None
    total_tokens = sum(sum(s.loss_mask[1:]) for s, _ in scored)
    if total_tokens == 0:
        return None
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, abs_diffs, max_diff, clipped = 0.0, 0.0, 0.0, 0
    for start in range(0, len(scored), micro_batch):
        batch = pack(scored[start : start + micro_batch])
        new = token_logprobs(model, batch.ids, batch.targets, temperature)
        per_token = clipped_loss(new, batch.old_logprobs, batch.advantages, clip)
        (per_token.sum() / total_tokens).backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            diff = (new - batch.old_logprobs).abs()
            loss_sum += float(per_token.sum())
            abs_diffs += float(diff.sum())
            max_diff = max(max_diff, float(diff.max()))
            ratio = torch.exp(new - batch.old_logprobs)
            clipped += int(((ratio < 1 - clip) | (ratio > 1 + clip)).sum())
    parameters = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return UpdateStats(
        samples=len(scored),
        tokens=total_tokens,
        loss=loss_sum / total_tokens,
        mismatch_mean_abs=abs_diffs / total_tokens,
        mismatch_max_abs=max_diff,
        clipped_share=clipped / total_tokens,
        grad_norm=grad_norm,
    )
