"""The demo: a batch of math rollouts on the embedded model, live progress, JSONL out.

Starts a real server (Podman sandboxes, the embedded llama.cpp model) on a
free port, sends the tasks over one RolloutStream with the real client, and
writes one line per rollout in the form trainers consume.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import Settings


def load_tasks(path: Path, limit: int = 0) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return tasks[:limit] if limit else tasks


def result_line(task: dict[str, Any], sample: int, result: v1.RolloutResult) -> dict[str, Any]:
    trajectory = result.trajectory
    return {
        "task_id": task.get("id", ""),
        "sample": sample,
        "job_id": result.job_id,
        "status": v1.JobStatus.Name(result.status),
        "reward": result.reward,
        "failure": MessageToDict(result.failure) if result.HasField("failure") else None,
        "messages": [MessageToDict(m) for m in trajectory.messages],
        "token_ids": list(trajectory.token_ids),
        "loss_mask": list(trajectory.loss_mask),
        "logprobs": list(trajectory.logprobs),
        "num_turns": trajectory.num_turns,
        "timing": MessageToDict(result.timing),
        "details": MessageToDict(result.details),
    }


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.reward_sum = 0.0
        self.turns = 0
        self.started = time.monotonic()

    def update(self, result: v1.RolloutResult) -> None:
        self.done += 1
        self.failed += result.status != v1.JOB_STATUS_SUCCEEDED
        self.reward_sum += result.reward

    def render(self) -> str:
        minutes = max(time.monotonic() - self.started, 1e-6) / 60
        mean = self.reward_sum / self.done if self.done else 0.0
        return (
            f"\rrollouts {self.done}/{self.total} | failed {self.failed} | mean reward {mean:.2f} "
            f"| model turns {self.turns} | {self.done / minutes:.1f} rollouts/min"
        )


async def run_demo(settings: Settings, args: argparse.Namespace) -> int:
    tasks = load_tasks(args.tasks, args.limit)
    server = ProrlServer(settings)
    print("starting the server (sandboxes + embedded model)...", file=sys.stderr, flush=True)
    await server.start()
    requests: dict[str, tuple[dict[str, Any], int]] = {}
    batch = []
    for index, task in enumerate(tasks):
        for sample in range(args.samples):
            request = v1.RolloutRequest(
                job_id=f"demo-{int(time.time())}-{index}-{sample}",
                handler="math",
                group_id=str(task.get("id", index)),
                limits=v1.AgentLimits(max_turns=args.max_turns),
                sampling=v1.SamplingParams(max_tokens=256, temperature=0.7),
            )
            request.instance.update({"question": task["question"], "answer": task["answer"]})
            requests[request.job_id] = (task, sample)
            batch.append(request)
    progress = Progress(len(batch))
    try:
        async with Client.connect(server.address) as client:
            with args.out.open("w") as out:
                async for item in client.rollout_many(batch):
                    if isinstance(item, v1.RolloutRejected):
                        print(f"\nrejected {item.job_id}: {item.message}", file=sys.stderr)
                        progress.total -= 1
                        continue
                    kind = item.WhichOneof("kind")
                    if kind == "model_turn":
                        progress.turns += 1
                    elif kind == "finished":
                        task, sample = requests[item.job_id]
                        progress.update(item.finished.result)
                        out.write(json.dumps(result_line(task, sample, item.finished.result)) + "\n")
                        out.flush()
                    print(progress.render(), end="", file=sys.stderr, flush=True)
    finally:
        await server.stop()
    print(f"\nwrote {progress.done} trajectories to {args.out}", file=sys.stderr)
    return 0 if progress.done == len(batch) else 1
