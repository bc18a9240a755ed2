"""The demo: rollouts of every task family on the embedded model, live progress, JSONL out.

Math, STEM and code tasks from data/demo_tasks.jsonl, then the first shipped
SWE task(s) (a real repository in its own image).

Starts a real server (Podman sandboxes, the embedded llama.cpp model) on a
free port and streams the tasks through it with the client's dataset runner
(the same code as `prorl run`), writing one line per rollout in the form
trainers consume.
"""

from __future__ import annotations

import argparse
import sys

from prorl_client.runner import load_tasks, run

from prorl_client import Client
from prorl_server.app import ProrlServer
from prorl_server.config import Settings
from prorl_server.datasets.swe import load_task, task_dirs, to_task


async def run_demo(settings: Settings, args: argparse.Namespace) -> int:
    tasks = load_tasks(args.tasks, "math")
    tasks += [to_task(load_task(task_dir)) for task_dir in task_dirs()[: args.swe_tasks]]
    if args.limit:
        tasks = tasks[: args.limit]
    for task in tasks:
        task.setdefault("limits", {"max_turns": args.max_turns})
        task.setdefault("sampling", {"max_tokens": 256, "temperature": 0.7})
    args.out.write_text("")  # a demo starts afresh; `prorl run` resumes instead
    server = ProrlServer(settings)
    print("starting the server (sandboxes + embedded model)...", file=sys.stderr, flush=True)
    await server.start()
    try:
        async with Client.connect(server.address) as client:
            progress = await run(client, tasks, args.out, samples=args.samples, run_id="demo")
    finally:
        await server.stop()
    print(f"wrote {progress.done} trajectories to {args.out}", file=sys.stderr)
    return 0 if progress.done == progress.total else 1
