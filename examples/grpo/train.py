"""GRPO on the CPU: train the embedded SmolLM2-135M on tasks served by prorl, push weights back.

    python -m examples.grpo.train --steps 12 --out docs/training

A synchronous (on-policy) loop against a real `prorl-server` child process
(embedded llama.cpp model, Podman sandboxes):

1. submit tasks x group-size jobs over one RolloutStream (group_id per task,
   min_policy_version = the version being trained, so no turn comes from older weights);
2. drop infrastructure failures, compute group-normalised advantages;
3. recompute the log-probs of the sampled tokens under the torch model at the
   sampling temperature, PPO-clipped loss against the service's log-probs, one
   optimizer step;
4. write the weights as a GGUF checkpoint, Pause, UpdateWeights(resume=True):
   the server serves the new policy version from its next model call.

Held-out tasks are evaluated greedily (temperature 0) every few steps. Each step
prints one line; at the end the figures go to OUT/metrics.json, OUT/metrics.csv
and OUT/reward_curve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from examples.grpo.checkpoint import Llama, load_gguf, save_gguf
from examples.grpo.grpo import advantages, grpo_update
from examples.grpo.rollouts import Batch, Sampling, Task, collect, requests
from examples.grpo.server import serve
from examples.grpo.tasks import splits
from prorl_client import Client
from prorl_server.llm.llama_cpp_backend import default_model_path


@dataclasses.dataclass
class StepRecord:
    step: int
    policy_version: int
    """The version every rollout of this step was sampled from."""
    rollout_versions: list[int]
    reward_mean: float
    rewarded_share: float
    samples: int
    infrastructure_failures: int
    trained_samples: int
    trained_tokens: int
    loss: float | None
    mismatch_mean_abs: float | None
    mismatch_max_abs: float | None
    clipped_share: float | None
    grad_norm: float | None
    eval_reward: float | None
    rollout_s: float
    train_s: float
    weights_s: float
    eval_s: float
    step_s: float
    elapsed_s: float


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.grpo.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--train-tasks", type=int, default=64)
    parser.add_argument("--eval-tasks", type=int, default=24)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/training"))
    parser.add_argument("--work-dir", type=Path, help="checkpoints and the server log (default: a temporary dir)")
    return parser.parse_args(argv)


def _say(text: str) -> None:
    print(text, flush=True)


async def _eval(
    client: Client, tasks: list[Task], max_tokens: int, step: int, examples: dict[int, list[dict[str, Any]]]
) -> tuple[float, float]:
    """Mean reward of one greedy rollout per held-out task, and its seconds; a few replies into `examples`."""
    batch = await collect(client, requests(tasks, 1, Sampling(0.0, max_tokens), run_id=f"eval{step}"))
    scored = [s.reward for s in batch.samples if not s.infrastructure_failure]
    questions = {t.id: t.instance["task"]["question"] for t in tasks}
    shown = sorted(batch.samples, key=lambda s: int(s.task_id.rsplit("-", 1)[1]))[:6]
    examples[step] = [{"question": questions[s.task_id], "reply": s.text, "reward": s.reward} for s in shown]
    return (sum(scored) / len(scored) if scored else float("nan")), batch.seconds


async def _push(client: Client, model: Llama, path: Path, template: Path) -> int:
    """Checkpoint, Pause, UpdateWeights(resume=True); the new policy version."""
    await asyncio.to_thread(save_gguf, model, path, template=template)
    await client.pause()
    response = await client.update_weights(str(path), resume=True)
    return response.policy_version


def _step_line(r: StepRecord) -> str:
    parts = [
        f"step {r.step:3d}",
        f"v{r.policy_version}",
        f"reward {r.reward_mean:.3f}",
        f"eval {r.eval_reward:.3f}" if r.eval_reward is not None else "eval   -  ",
        f"trained {r.trained_samples:2d}/{r.samples}",
        f"mismatch {r.mismatch_mean_abs:.4f}" if r.mismatch_mean_abs is not None else "mismatch   -   ",
        f"step {r.step_s:5.1f}s (rollouts {r.rollout_s / r.step_s:4.0%}, train {r.train_s / r.step_s:4.0%},"
        f" weights {r.weights_s / r.step_s:4.0%}, eval {r.eval_s / r.step_s:4.0%})",
        f"total {r.elapsed_s / 60:4.1f} min",
    ]
    return "  ".join(parts)


async def train(args: argparse.Namespace, work: Path, examples: dict[int, list[dict[str, Any]]]) -> list[StepRecord]:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    train_tasks, eval_tasks = splits(args.train_tasks, args.eval_tasks, seed=args.seed)
    source = default_model_path()
    model = load_gguf(source)
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    # The server starts from the trainer's own weights (the Q4_1 file dequantized, as F16),
    # so the service's log-probs and the trainer's agree from the first step.
    start = work / "policy-0.gguf"
    save_gguf(model, start, template=source)
    settings = [
        "jobs.store=false",
        f"server.instance_id=grpo-{os.getpid()}",
        f"llm.embedded.model_path={start}",
        "llm.embedded.context_length=1024",
    ]
    _say(f"server log: {work / 'server.log'}")
    records: list[StepRecord] = []
    began = time.perf_counter()
    async with serve(work / "server.log", settings) as address, Client.connect(address) as client:
        version = 0
        order: list[Task] = []
        sampling = Sampling(args.temperature, args.max_tokens)
        for step in range(args.steps + 1):
            step_began = time.perf_counter()
            eval_reward, eval_s = None, 0.0
            if step % args.eval_every == 0 or step == args.steps:
                eval_reward, eval_s = await _eval(client, eval_tasks, args.max_tokens, step, examples)
            if step == args.steps:  # the last line is the final evaluation only
                records.append(_final(step, version, eval_reward, eval_s, began))
                _say(f"final   v{version}  eval {eval_reward:.3f}  total {records[-1].elapsed_s / 60:.1f} min")
                break
            if len(order) < args.tasks_per_step:
                order = rng.sample(train_tasks, len(train_tasks))
            tasks, order = order[: args.tasks_per_step], order[args.tasks_per_step :]
            batch: Batch = await collect(
                client, requests(tasks, args.group_size, sampling, run_id=f"s{step}", min_policy_version=version)
            )
            scored_samples = [s for s in batch.samples if not s.infrastructure_failure]
            rewards = [s.reward for s in scored_samples]
            trained_began = time.perf_counter()
            scored = advantages(batch.samples)
            stats = await asyncio.to_thread(
                grpo_update, model, optimizer, scored, temperature=args.temperature, clip=args.clip
            )
            train_s = time.perf_counter() - trained_began
            weights_began = time.perf_counter()
            new_version = version
            if stats is not None:
                new_version = await _push(client, model, work / f"policy-{step + 1}.gguf", source)
                (work / f"policy-{step}.gguf").unlink(missing_ok=True)  # the server has loaded the next one
            weights_s = time.perf_counter() - weights_began
            record = StepRecord(
                step=step,
                policy_version=version,
                rollout_versions=sorted({v for s in batch.samples for v in s.policy_versions}),
                reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
                rewarded_share=sum(r > 0 for r in rewards) / len(rewards) if rewards else float("nan"),
                samples=len(batch.samples),
                infrastructure_failures=len(batch.samples) - len(scored_samples),
                trained_samples=len(scored),
                trained_tokens=stats.tokens if stats else 0,
                loss=stats.loss if stats else None,
                mismatch_mean_abs=stats.mismatch_mean_abs if stats else None,
                mismatch_max_abs=stats.mismatch_max_abs if stats else None,
                clipped_share=stats.clipped_share if stats else None,
                grad_norm=stats.grad_norm if stats else None,
                eval_reward=eval_reward,
                rollout_s=batch.seconds,
                train_s=train_s,
                weights_s=weights_s,
                eval_s=eval_s,
                step_s=time.perf_counter() - step_began,
                elapsed_s=time.perf_counter() - began,
            )
            records.append(record)
            _say(_step_line(record))
            version = new_version
    return records


def _final(step: int, version: int, eval_reward: float | None, eval_s: float, began: float) -> StepRecord:
    return StepRecord(
        step=step, policy_version=version, rollout_versions=[], reward_mean=float("nan"),
        rewarded_share=float("nan"), samples=0, infrastructure_failures=0, trained_samples=0,
        trained_tokens=0, loss=None, mismatch_mean_abs=None, mismatch_max_abs=None, clipped_share=None,
        grad_norm=None, eval_reward=eval_reward, rollout_s=0.0, train_s=0.0, weights_s=0.0, eval_s=eval_s,
        step_s=eval_s, elapsed_s=time.perf_counter() - began,
    )  # fmt: skip


def summary(records: list[StepRecord]) -> dict[str, Any]:
    steps = [r for r in records if r.samples]
    busy = {k: sum(getattr(r, f"{k}_s") for r in records) for k in ("rollout", "train", "weights", "eval")}
    total = sum(busy.values())
    evals = [(r.step, r.eval_reward) for r in records if r.eval_reward is not None]
    return {
        "steps": len(steps),
        "total_s": records[-1].elapsed_s if records else 0.0,
        "mean_step_s": sum(r.step_s for r in steps) / len(steps) if steps else 0.0,
        "time_share": {k: v / total for k, v in busy.items()} if total else {},
        "train_reward_first_3_steps": _mean([r.reward_mean for r in steps[:3]]),
        "train_reward_last_3_steps": _mean([r.reward_mean for r in steps[-3:]]),
        "eval_reward": dict(evals),
        "mismatch_mean_abs": _mean([r.mismatch_mean_abs for r in steps if r.mismatch_mean_abs is not None]),
        "infrastructure_failures": sum(r.infrastructure_failures for r in steps),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _no_nan(value: Any) -> Any:
    """NaN (no sample, no update) as null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def write_report(
    records: list[StepRecord], args: argparse.Namespace, out: Path, examples: dict[int, list[dict[str, Any]]]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    rows = [dataclasses.asdict(r) for r in records]
    first, last = min(examples, default=0), max(examples, default=0)
    replies = {"first_eval": examples.get(first, []), "last_eval": examples.get(last, [])}
    document = {"config": config, "summary": summary(records), "steps": rows, "held_out_replies": replies}
    (out / "metrics.json").write_text(json.dumps(_no_nan(document), indent=2) + "\n")
    with (out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ";".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()})
    plot(records, out / "reward_curve.png", temperature=args.temperature)


def plot(records: list[StepRecord], path: Path, *, temperature: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.samples]
    evals = [r for r in records if r.eval_reward is not None]
    figure, (rewards, times) = plt.subplots(1, 2, figsize=(11, 4))
    label = f"train (sampled, T={temperature:g})"
    rewards.plot([r.step for r in steps], [r.reward_mean for r in steps], "o-", label=label)
    rewards.plot([r.step for r in evals], [r.eval_reward for r in evals], "s--", label="held-out (greedy)")
    rewards.set(xlabel="step", ylabel="mean reward", ylim=(0, 1), title="GRPO on SmolLM2-135M")
    rewards.grid(alpha=0.3)
    rewards.legend()
    bottom = [0.0] * len(steps)
    for key, label in (("rollout", "rollouts"), ("train", "training"), ("weights", "checkpoint + update"),
                       ("eval", "held-out eval")):  # fmt: skip
        heights = [getattr(r, f"{key}_s") for r in steps]
        times.bar([r.step for r in steps], heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    times.set(xlabel="step", ylabel="seconds", title="where a step's time goes (2 CPU cores)")
    times.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="prorl-grpo-") as scratch:
        work = args.work_dir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        examples: dict[int, list[dict[str, Any]]] = {}
        records = asyncio.run(train(args, work.absolute(), examples))
    write_report(records, args, args.out, examples)
    result = summary(records)
    _say(json.dumps(_no_nan(result), indent=2))
    _say(f"wrote {args.out / 'metrics.json'}, {args.out / 'metrics.csv'}, {args.out / 'reward_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
