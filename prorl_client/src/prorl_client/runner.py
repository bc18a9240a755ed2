"""`prorl run TASKS.jsonl --out RESULTS.jsonl`: stream a dataset through a server.

Each task line is a JSON object: {"id": ..., "handler": "math", "instance":
{...}} plus optional "sampling", "limits", "sandbox" objects (the fields of
RolloutRequest). A line without "instance" is taken as the instance itself
(its "id" and "handler" aside), so {"id": "q1", "question": ..., "answer": ...}
works with --handler math.

Every task runs --samples times (a GRPO group, group_id = the task id). One
JSON line per rollout is appended to the output as soon as it finishes, with
the trajectory in the form trainers consume (token_ids, loss_mask, logprobs).
Rerunning with the same output file skips the rollouts already in it; job
ids are derived from the output file, so a rollout the server still holds
(finished, or running when the previous run was interrupted) is reattached
rather than run twice.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict

from prorl_client import v1
from prorl_client._client import Client


def rollout_key(task_id: str, sample: int) -> str:
    return f"{task_id}#{sample}"


def load_tasks(path: Path, default_handler: str) -> list[dict[str, Any]]:
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        task = json.loads(line)
        if not isinstance(task, dict):
            raise SystemExit(f"{path}:{number}: a task must be a JSON object")
        task.setdefault("id", f"line-{number}")
        task.setdefault("handler", default_handler)
        if "instance" not in task:
            task = {
                "id": task.pop("id"),
                "handler": task.pop("handler"),
                "instance": {k: v for k, v in task.items() if k not in ("sampling", "limits", "sandbox")},
                **{k: task[k] for k in ("sampling", "limits", "sandbox") if k in task},
            }
        tasks.append(task)
    return tasks


def done_keys(path: Path) -> set[str]:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            keys.add(rollout_key(str(record["task_id"]), int(record["sample"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by an interrupted run: that rollout runs again
    return keys


def build_request(task: dict[str, Any], sample: int, run_id: str) -> v1.RolloutRequest:
    body: dict[str, Any] = {
        "job_id": f"{run_id}-{task['id']}-{sample}"[:128],
        "handler": task["handler"],
        "instance": task["instance"],
        "group_id": str(task["id"]),
    }
    for field in ("sampling", "limits", "sandbox", "labels", "priority"):
        if field in task:
            body[field] = task[field]
    request = v1.RolloutRequest()
    ParseDict(body, request)
    return request


def result_record(task_id: str, sample: int, result: v1.RolloutResult) -> dict[str, Any]:
    trajectory = result.trajectory
    return {
        "task_id": task_id,
        "sample": sample,
        "job_id": result.job_id,
        "status": v1.JobStatus.Name(result.status),
        "reward": result.reward,
        "failure": MessageToDict(result.failure) if result.HasField("failure") else None,
        "messages": [MessageToDict(m) for m in trajectory.messages],
        "token_ids": list(trajectory.token_ids),
        "loss_mask": list(trajectory.loss_mask),
        "logprobs": [float(x) for x in trajectory.logprobs],
        "turn_policy_versions": list(trajectory.turn_policy_versions),
        "num_turns": trajectory.num_turns,
        "timing": MessageToDict(result.timing),
        "details": MessageToDict(result.details),
    }


class Progress:
    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.done = self.failed = 0
        self.reward_sum = 0.0
        self.started = time.monotonic()
        self._stream = stream

    def update(self, result: v1.RolloutResult | None) -> None:
        self.done += 1
        if result is None or result.status != v1.JOB_STATUS_SUCCEEDED:
            self.failed += 1
        if result is not None:
            self.reward_sum += result.reward
        self.render()

    def render(self) -> None:
        minutes = max(time.monotonic() - self.started, 1e-6) / 60
        mean = self.reward_sum / self.done if self.done else 0.0
        self._stream.write(
            f"\rrollouts {self.done}/{self.total} | failed {self.failed} | mean reward {mean:.3f} "
            f"| {self.done / minutes:.1f} rollouts/min"
        )
        self._stream.flush()


def pending(tasks: list[dict[str, Any]], samples: int, skip: set[str]) -> Iterator[tuple[dict[str, Any], int]]:
    for task in tasks:
        for sample in range(samples):
            if rollout_key(str(task["id"]), sample) not in skip:
                yield task, sample


def plan(
    tasks: list[dict[str, Any]], out: Path, *, samples: int = 1, run_id: str | None = None
) -> tuple[list[v1.RolloutRequest], dict[str, tuple[str, int]]]:
    """The requests of every (task, sample) not yet in `out`, and each job's (task id, sample)."""
    todo = list(pending(tasks, samples, done_keys(out)))
    # Job ids follow from the output file: a rerun resubmits the same ids, so a
    # job the server already ran (or is still running) is reattached, not redone.
    run_id = run_id or "run-" + hashlib.sha1(str(out.absolute()).encode()).hexdigest()[:10]
    by_job: dict[str, tuple[str, int]] = {}
    requests = []
    for task, sample in todo:
        request = build_request(task, sample, run_id)
        by_job[request.job_id] = (str(task["id"]), sample)
        requests.append(request)
    return requests, by_job


async def run(
    client: Client,
    tasks: list[dict[str, Any]],
    out: Path,
    *,
    samples: int = 1,
    run_id: str | None = None,
    progress_stream: TextIO = sys.stderr,
) -> Progress:
    """Run every (task, sample) not yet in `out`; append one line per finished rollout."""
    requests, by_job = await asyncio.to_thread(plan, tasks, out, samples=samples, run_id=run_id)
    progress = Progress(len(requests), progress_stream)
    if not requests:
        return progress
    progress.render()
    with out.open("a") as sink:
        async for item in client.rollout_many(requests):
            if isinstance(item, v1.RolloutRejected):
                progress_stream.write(f"\nrejected {item.job_id}: {item.message}\n")
                progress.update(None)
            elif item.HasField("finished"):
                task_id, sample = by_job[item.job_id]
                sink.write(json.dumps(result_record(task_id, sample, item.finished.result)) + "\n")
                sink.flush()
                progress.update(item.finished.result)
    progress_stream.write("\n")
    return progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prorl", description="Stream a dataset of tasks through a prorl server.")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run TASKS.jsonl, append results to --out (resumable)")
    run_parser.add_argument("tasks", type=Path)
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--server", default="localhost:50051", help="host:port of the prorl server")
    run_parser.add_argument("--samples", type=int, default=1, help="rollouts per task (a GRPO group)")
    run_parser.add_argument("--handler", default="math", help="handler of lines that name none")
    run_parser.add_argument("--token", default=os.environ.get("PRORL_TOKEN"), help="bearer token (or PRORL_TOKEN)")
    run_parser.add_argument("--tls-ca", type=Path, help="PEM CA certificate: connect with TLS, trusting it")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    tasks = load_tasks(args.tasks, args.handler)

    async def go() -> Progress:
        credentials = grpc.ssl_channel_credentials(args.tls_ca.read_bytes()) if args.tls_ca else None
        async with Client.connect(args.server, credentials=credentials, token=args.token) as client:
            return await run(client, tasks, args.out, samples=args.samples)

    progress = asyncio.run(go())
    print(f"{progress.done} rollouts written to {args.out} ({progress.failed} failed)", file=sys.stderr)
    return 0 if progress.done == progress.total else 1


if __name__ == "__main__":
    sys.exit(main())
