"""Tree-structured sampling with ForkJob: one tree per task, advantages per branch point.

For each task, `roots` rollouts are sampled (forkable); each is forked at its midpoint (after
turn (num_turns - 1) // 2, when that turn has a boundary) into `branches` more. Credit:

- a branch point's value V is the mean reward of every continuation from it (the root's own
  and its branches');
- the tokens each continuation sampled after the point get r - V (GRPO within the siblings);
- the root's tokens before the point (trained once: the branches' loss masks are 0 there) get
  V - mean(V of the task's roots): how good the prefix was, against the task's other prefixes.

The token-level advantages line up with each trajectory's token_ids and are 0 wherever
loss_mask is 0. Token backends only (the split needs `ForkOrigin.prefix_tokens`).

Usage: python -m examples.fork_tree.tree --target HOST:PORT [--roots 2] [--branches 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from prorl_client import Client, v1


@dataclass
class Tree:
    """One root rollout and the branches forked from it at one turn."""

    root: v1.RolloutResult
    branches: list[v1.RolloutResult] = field(default_factory=list)
    turn: int = -1
    """The root's turn the branches start after; -1: the root had no turn to branch after."""

    @property
    def value(self) -> float:
        """The branch point's value: the mean reward of every continuation from it."""
        return statistics.fmean([self.root.reward, *(b.reward for b in self.branches)])


async def result(client: Client, job_id: str) -> v1.RolloutResult:
    async for event in client.watch(job_id):
        if event.HasField("finished"):
            return event.finished.result
    raise RuntimeError(f"{job_id}: the stream ended without a result")


async def sample_tree(client: Client, request: v1.RolloutRequest, branches: int) -> Tree:
    """The root (submitted forkable), then `branches` forks at its midpoint, each its own seed."""
    request = v1.RolloutRequest.FromString(request.SerializeToString())
    request.forkable = True
    submitted = await client.submit(request)
    root = await result(client, submitted.job.job_id)
    turn = (root.trajectory.num_turns - 1) // 2
    if root.trajectory.num_turns < 2:  # the only turn ended the rollout: nothing to branch after
        return Tree(root)
    forks = [
        v1.ForkBranch(job_id=f"{root.job_id}-t{turn}-b{i}", sampling=_with_seed(request.sampling, i))
        for i in range(branches)
    ]
    response = await client.fork_job(root.job_id, turn, forks)
    done = await asyncio.gather(*(result(client, job.job_id) for job in response.jobs))
    return Tree(root, list(done), turn)


def _with_seed(sampling: v1.SamplingParams, seed: int) -> v1.SamplingParams:
    copy = v1.SamplingParams()
    copy.CopyFrom(sampling)
    copy.seed = seed
    return copy


def advantages(trees: Sequence[Tree]) -> list[tuple[v1.RolloutResult, list[float]]]:
    """Per-token advantages of every trajectory of one task's trees (see the module docstring)."""
    baseline = statistics.fmean(tree.value for tree in trees)
    out: list[tuple[v1.RolloutResult, list[float]]] = []
    for tree in trees:
        value = tree.value
        split = tree.branches[0].fork_origin.prefix_tokens if tree.branches else 0
        root = tree.root.trajectory
        out.append(
            (
                tree.root,
                [
                    0.0 if not mask else (value - baseline if i < split else tree.root.reward - value)
                    for i, mask in enumerate(root.loss_mask)
                ],
            )
        )
        for branch in tree.branches:
            out.append((branch, [(branch.reward - value) if mask else 0.0 for mask in branch.trajectory.loss_mask]))
    return out


async def main(args: argparse.Namespace) -> None:
    request = v1.RolloutRequest(handler="math")
    request.instance.update({"question": "What is 17 * 23? Check it with the python tool.", "answer": "391"})
    request.limits.max_turns = 6
    async with Client.connect(args.target) as client:
        trees = [await sample_tree(client, request, args.branches) for _ in range(args.roots)]
    for tree in trees:
        rewards = [b.reward for b in tree.branches]
        print(f"root {tree.root.job_id}: reward {tree.root.reward}, branched after turn {tree.turn}: {rewards}")
    for trajectory, values in advantages(trees):
        trained = [v for v, m in zip(values, trajectory.trajectory.loss_mask, strict=True) if m]
        print(f"{trajectory.job_id}: {len(trained)} trained tokens, mean {statistics.fmean(trained or [0]):+.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--roots", type=int, default=2)
    parser.add_argument("--branches", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
