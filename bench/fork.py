"""What forking costs and saves: a branch at turn k against a fresh rollout replaying k turns.

One ProrlServer in this process on real rootless Podman (a private Podman service), a
scripted policy over HTTP whose every model turn takes --model-s seconds (0: instant; a
real model's turn costs seconds, and a replay under sampling would not even take the same
turns). Per task (the math sandbox, and the Django SWE task in its SWE-bench testbed image):

1. the same parent twice, side by side: with `forkable` and without. Its run up to model
   turn k+1 (k tool turns done), and the snapshot bytes kept per turn (on disk): what
   keeping the state costs;
2. ForkJob into --n branches after turn k, against --n fresh rollouts of the same task
   submitted at the same moment that replay turns 0..k: time from the call to each job's
   model turn k+1 (p50 and max), and the wall time until all --n got there.

Jobs are cancelled once they reach turn k+1 (what follows is the same either way).

With --whole-too, the SWE task runs a second time in the same run with its repository kept
whole at every boundary (the roots of the revisions before changed-files snapshots: the same
server and scripts, the repository root not `pristine`), for before and after side by side.

Usage: python bench/fork.py [--k K] [--n N] [--model-s S] [--state-dir DIR] [--only math|swe]
       [--whole-too] (make bench-fork)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

from prorl_client import Client, v1
from prorl_server.agents.swe import SWEHandler, SWEInstance
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.datasets.swe import TASKS_DIR, load_task
from prorl_server.sandbox.podman.service import PodmanService
from prorl_server.sandbox.snapshot import Root, capture, record_base
from prorl_server.testing.scripted_llm import (
    ScriptedLLMServer,
    ScriptedReply,
    tool_call_text,
    turn_index,
    user_prompt,
)

MATH_TURNS: list[tuple[str, dict[str, Any]]] = [
    ("bash", {"command": "mkdir -p work && head -c 200000 /dev/urandom | base64 > work/data.txt && wc -c work/*"}),
    (
        "python",
        {"code": "rows = [i * i for i in range(20000)]\nopen('work/rows.json', 'w').write(str(rows))"},
    ),
    ("bash", {"command": "cd work && python3 -c 'import json; print(len(open(\"rows.json\").read()))' > sum.txt"}),
    ("bash", {"command": "cd work && sha256sum * > SUMS && cat SUMS"}),
]
SWE_TURNS: list[tuple[str, dict[str, Any]]] = [
    ("bash", {"command": "cd /testbed && git status --short | head && grep -n 'def urlize' django/utils/html.py"}),
    (
        "bash",
        {"command": "cd /testbed && sed -i 's/^# Configuration for/# For/' django/utils/html.py && git diff"},
    ),
    ("bash", {"command": "cd /testbed && python -c 'import django; print(django.__version__)'"}),
    ("str_replace_editor", {"command": "view", "path": "/testbed/django/utils/html.py", "view_range": [1, 20]}),
]


class Policy:
    def __init__(self, model_s: float) -> None:
        self.model_s = model_s

    def __call__(self, messages: list[dict[str, Any]]) -> ScriptedReply:
        turns = SWE_TURNS if "SWE" in user_prompt(messages) or "Repository:" in user_prompt(messages) else MATH_TURNS
        turn = turn_index(messages)
        if turn < len(turns):
            name, arguments = turns[turn]
            return ScriptedReply(tool_call_text(name, arguments), delay_s=self.model_s)
        # Past the scripted turns (k + 1 on): a turn the benchmark waits for, then cancels.
        return ScriptedReply(tool_call_text("bash", {"command": "true"}), delay_s=self.model_s)


def math_request(job_id: str, *, forkable: bool) -> v1.RolloutRequest:
    request = v1.RolloutRequest(job_id=job_id, handler="math", forkable=forkable)
    request.instance.update({"question": "Compute in the sandbox.", "answer": "42"})
    request.limits.max_turns = 20
    return request


def swe_request(job_id: str, *, forkable: bool) -> v1.RolloutRequest:
    instance = load_task(TASKS_DIR / "django__django-5.0.14")
    request = v1.RolloutRequest(job_id=job_id, handler="swe", forkable=forkable)
    request.instance.update({key: value for key, value in instance.items() if key != "patch"})
    request.limits.max_turns = 20
    request.sandbox.memory_mib = 1024
    return request


async def reach(client: Client, job_id: str, turn: int) -> float:
    """The time of the job's model turn `turn` (server clock), then cancel the job."""
    async for event in client.watch(job_id):
        if event.HasField("model_turn") and event.model_turn.turn == turn:
            when = event.time.ToNanoseconds() / 1e9
            await client.cancel(job_id, reason="benchmark: reached the turn")
            return when
        if event.HasField("finished"):
            raise RuntimeError(f"{job_id} ended before turn {turn}: {event.finished.result.failure}")
    raise RuntimeError(f"{job_id}: no events")


async def run_start(client: Client, job_id: str) -> float:
    async for event in client.watch(job_id):
        if event.HasField("phase_started") and event.phase_started.phase == v1.PHASE_RUN:
            return event.time.ToNanoseconds() / 1e9
    raise RuntimeError(job_id)


def folder_bytes(folder: Path) -> list[int]:
    return sorted(path.stat().st_size for path in folder.rglob("*.tar")) if folder.exists() else []


async def parent_runs(client: Client, build: Any, k: int, tag: str, forks_dir: Path) -> dict[str, Any]:
    """The forkable parent and the same job without forkable, side by side, each cancelled at
    model turn k+1 (a cancelled job can still be forked after the turns it finished)."""
    plain_id, forkable_id = f"{tag}-plain", f"{tag}-parent"
    await client.submit(build(plain_id, forkable=False))
    await client.submit(build(forkable_id, forkable=True))
    plain_start, parent_start = await run_start(client, plain_id), await run_start(client, forkable_id)
    plain_end = await reach(client, plain_id, k + 1)
    parent_end = 0.0
    async for event in client.watch(forkable_id):
        if event.HasField("model_turn") and event.model_turn.turn == k + 1:
            parent_end = event.time.ToNanoseconds() / 1e9
            break
    await client.cancel(forkable_id, reason="benchmark: reached the turn")  # its boundaries stay forkable
    sizes = folder_bytes(forks_dir)
    return {
        "parent": forkable_id,
        "plain_s": plain_end - plain_start,
        "forkable_s": parent_end - parent_start,
        "snapshot_bytes": sizes,
    }


async def branches_vs_fresh(client: Client, build: Any, parent: str, k: int, n: int, tag: str) -> dict[str, Any]:
    started = time.time()
    fork_call = asyncio.ensure_future(
        client.fork_job(parent, k, [v1.ForkBranch(job_id=f"{tag}-b{i}") for i in range(n)])
    )
    fresh_ids = [f"{tag}-fresh{i}" for i in range(n)]
    await asyncio.gather(*(client.submit(build(job_id, forkable=False)) for job_id in fresh_ids))
    response = await fork_call
    forks_done = await asyncio.gather(*(reach(client, job.job_id, k + 1) for job in response.jobs))
    fresh_done = await asyncio.gather(*(reach(client, job_id, k + 1) for job_id in fresh_ids))
    return {
        "fork_s": [done - started for done in forks_done],
        "fresh_s": [done - started for done in fresh_done],
    }


@contextlib.contextmanager
def timed(seconds: dict[str, list[float]]) -> Iterator[None]:
    """Each snapshot's and each starting listing's time, as the fork registry calls them."""

    def wrap(name: str, call: Any) -> Any:
        async def timed_call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                seconds.setdefault(name, []).append(time.perf_counter() - started)

        return timed_call

    with (
        mock.patch("prorl_server.jobs.forks.capture", wrap("capture", capture)),
        mock.patch("prorl_server.jobs.forks.record_base", wrap("record_base", record_base)),
    ):
        yield


@contextlib.contextmanager
def whole_repository() -> Iterator[None]:
    """The SWE repository kept whole at each boundary, as before changed-files snapshots."""
    changes_only = SWEHandler.fork_roots

    def whole(self: SWEHandler, instance: SWEInstance) -> Sequence[Root]:
        return tuple(replace(root, pristine=False) for root in changes_only(self, instance))

    with mock.patch.object(SWEHandler, "fork_roots", whole):
        yield


def line(label: str, values: list[float]) -> str:
    return f"{label}: p50 {statistics.median(values):.2f} s, max {max(values):.2f} s (n={len(values)})"


@contextlib.asynccontextmanager
async def serving(args: argparse.Namespace) -> AsyncIterator[tuple[ProrlServer, Client, Path]]:
    instance = f"bench-fork-{uuid.uuid4().hex[:6]}"
    service = PodmanService(user="prorl", name=instance)
    await service.start()
    llm = ScriptedLLMServer(Policy(args.model_s))
    await llm.start()
    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": instance, "shutdown_grace_s": 0, "log_level": "warning"},
            "sandbox": {"podman_socket": service.url, "state_dir": args.state_dir, "tmp_mib": 256},
            "jobs": {"store": False, "fork_snapshot_max_bytes": args.cap},
            "llm": {"backends": [{"id": "scripted", "base_url": llm.base_url}], "embedded": {"enabled": "never"}},
            "phases": {"init": 2 * args.n + 2, "run": 2 * args.n + 2, "eval": 2 * args.n + 2},
        },
    )
    server = ProrlServer(settings)
    await server.start()
    client = Client.connect(server.address)
    try:
        yield server, client, Path(args.state_dir) / "forks" / instance
    finally:
        await client.close()
        await server.stop()
        await llm.stop()
        await service.stop()


async def main(args: argparse.Namespace) -> int:
    print(
        f"# fork bench, {os.cpu_count()} cores: branch after turn k={args.k}, n={args.n}, model turn {args.model_s} s"
    )
    tasks = [("math", "math", math_request, False), ("swe", "swe", swe_request, False)]
    if args.whole_too:
        tasks.append(("swe, repository kept whole (before)", "swe", swe_request, True))
    for title, name, build, whole in tasks:
        if args.only and name != args.only:
            continue
        seconds: dict[str, list[float]] = {}
        with whole_repository() if whole else contextlib.nullcontext(), timed(seconds):
            async with serving(args) as (_, client, forks_dir):
                parents = await parent_runs(client, build, args.k, name, forks_dir)
                kept = {key: list(values) for key, values in seconds.items()}  # the parent's alone
                race = await branches_vs_fresh(client, build, parents["parent"], args.k, args.n, name)
        sizes = parents["snapshot_bytes"]
        print(f"\n## {title}")
        print(
            f"run to model turn {args.k + 1}: forkable {parents['forkable_s']:.2f} s, plain {parents['plain_s']:.2f} s "
            f"(+{(parents['forkable_s'] - parents['plain_s']) / (args.k + 1):.3f} s per turn boundary)"
        )
        print(f"snapshot bytes per turn: {sizes} (median {statistics.median(sizes) if sizes else 0:.0f})")
        listing = ", ".join(f"{value:.2f}" for value in kept.get("record_base", [])) or "none"
        print(
            f"snapshot seconds per turn: {', '.join(f'{value:.2f}' for value in kept.get('capture', []))}; "
            f"the listing at the job's start: {listing}"
        )
        print(line(f"{args.n} branches after turn {args.k}, call to model turn {args.k + 1}", race["fork_s"]))
        print(
            line(
                f"{args.n} fresh rollouts replaying turns 0..{args.k}, submit to model turn {args.k + 1}",
                race["fresh_s"],
            )
        )
        print(f"ratio (max, all {args.n} there): {max(race['fresh_s']) / max(race['fork_s']):.2f}x")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=3, help="branch after this turn (turns 0..k are tool turns)")
    parser.add_argument("--n", type=int, default=4, help="branches, and fresh rollouts to compare with")
    parser.add_argument("--model-s", type=float, default=0.0, help="seconds per scripted model turn")
    parser.add_argument("--state-dir", default=os.environ.get("PRORL_TEST_STATE_DIR", "/var/lib/prorl"))
    parser.add_argument("--cap", type=int, default=512 * 1024 * 1024, help="jobs.fork_snapshot_max_bytes")
    parser.add_argument("--only", choices=["math", "swe"])
    parser.add_argument("--whole-too", action="store_true", help="the SWE task again, its repository kept whole")
    sys.exit(asyncio.run(main(parser.parse_args())))
