"""Verification under hostile answers: what 20 answers that make sympy compute for minutes
cost the server and the right answers beside them.

The server is this script run with --serve, a child process (so /proc/<pid> is the server's
own): a ProrlServer with no job store, the fake sandbox provider of tests/fakes (the real
in-sandbox runtime as local processes; no Podman) and a scripted policy in process that
finishes at once with the answer its question names. Two fresh servers, one after the other,
the same settings (`verifier.processes` = --processes, `verifier.time_limit_s` = --limit):

1. baseline: --right right answers (half math `42`, half STEM `6.63e-34 J s` for a gold of
   6.626e-34), submitted together;
2. hostile: the same right answers submitted together with --hostile math answers
   `\\boxed{9^{9^{8}}}`, the hostile ones first (the worst order for the right ones).

On each, after a warm-up job per family: GetStats called every 50 ms over its own channel
while the batch runs (latency p50 and max, over the whole batch and over the part once every
job has reached its eval phase, when only checks run: before it, the fake provider starts
every job's sandbox runtime as a local process from the server's event loop); the right answers' job time (submitted to
finished, p50 and max); the server's VmRSS from /proc every 0.1 s: start (after the warm-up),
peak, end (the batch done, --settle s later). Checks (exit status 1 when one fails): every
right answer scores 1; every hostile one ends FAILED, POLICY, `verification_timeout`; the
hostile run's end RSS is within 50 MiB of its start.

With --before REV, the same two runs are also made, in the same bench run and interleaved
with this tree's (REV alone, this tree alone, REV hostile, this tree hostile), on the code of
REV checked out into a temporary git worktree (removed at the end): a before/after measured
side by side. With --stalls, each server also samples its event loop (bench/stalls.py) and
the bench prints where the loop thread stood whenever the loop was more than 50 ms late.

Usage: python bench/verification.py [--right N] [--hostile N] [--processes P] [--limit S]
       [--settle S] [--before REV] [--stalls]   (make bench-verification)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_client import Client, v1

ROOT = Path(__file__).resolve().parent.parent

LISTENING = "prorl-server listening on "
ANSWER_PREFIX = "Answer exactly: "
HOSTILE = "\\boxed{9^{9^{8}}}"
RSS_SLACK_MIB = 50.0


# --- the server (this script with --serve, a child process) -------------------------------------


async def serve(processes: int, limit_s: float, stalls: str) -> None:
    """The server, from whatever tree PYTHONPATH names (this one, or --before's)."""
    from prorl_server.app import ProrlServer
    from prorl_server.config import load_settings
    from prorl_server.logging import configure_logging
    from tests.fakes.sandbox_provider import FakeSandboxProvider
    from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply, tool_call_text, user_prompt

    def answer_from_question(messages: list[dict[str, Any]]) -> ScriptedReply:
        return ScriptedReply(tool_call_text("finish", {"answer": user_prompt(messages).split(ANSWER_PREFIX, 1)[1]}))

    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": f"bench-verify-{os.getpid()}", "shutdown_grace_s": 0,
                       "log_level": "error"},
            "jobs": {"store": False},
            "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
            "phases": {"eval": 64},
            "verifier": {"processes": processes, "time_limit_s": limit_s},
        },
    )  # fmt: skip
    configure_logging(level=settings.server.log_level)
    provider = FakeSandboxProvider(instance_id=settings.server.instance_id)
    server = ProrlServer(settings, sandbox_provider=provider, backends=[ScriptedChatBackend(answer_from_question)])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    sampler = None
    if stalls:  # loaded by path: --before's tree has its own bench package
        spec = importlib.util.spec_from_file_location("bench_stalls", Path(__file__).with_name("stalls.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sampler = module.StallSampler(loop)
        sampler.start()
    print(f"{LISTENING}{server.address}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        if sampler is not None:
            sampler.stop()
            write_text(stalls, sampler.report())
        await server.stop()


# --- the bench ----------------------------------------------------------------------------------


def request(job_id: str, handler: str, gold: Any, answer: str) -> v1.RolloutRequest:
    job = v1.RolloutRequest(job_id=job_id, handler=handler)
    job.instance.update({"question": f"{ANSWER_PREFIX}{answer}", "answer": gold})
    return job


def right_answers(count: int) -> list[v1.RolloutRequest]:
    math = [request(f"right-math-{i}", "math", 42, "42") for i in range(0, count, 2)]
    stem = [request(f"right-stem-{i}", "stem", 6.626e-34, "6.63e-34 J s") for i in range(1, count, 2)]
    return math + stem


def write_text(path: str, text: str) -> None:
    Path(path).write_text(text)


def take_text(path: str) -> str:
    """The file's text; the file is removed."""
    text = Path(path).read_text()
    os.unlink(path)
    return text


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Run:
    label: str
    stats_s: list[float] = field(default_factory=list)
    stats_at: list[float] = field(default_factory=list)
    """When each GetStats call began (perf_counter)."""
    all_in_eval_at: float = float("inf")
    """When the last job of the batch reached its eval phase (from then on only checks run)."""
    right_s: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    tree: Path = ROOT
    start_mib: float = 0.0
    end_mib: float = 0.0
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    stalls: str = ""


async def start_server(
    tree: Path, processes: int, limit_s: float, stalls: str
) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "prorl_client" / "src")])}
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", "--processes", str(processes), "--limit", str(limit_s),
        "--stalls-file", stalls, stderr=asyncio.subprocess.PIPE, env=env, cwd=tree,
    )  # fmt: skip
    assert process.stderr is not None
    async with asyncio.timeout(120):
        while True:
            line = (await process.stderr.readline()).decode()
            if not line:
                raise RuntimeError("the server exited before listening")
            if line.startswith(LISTENING):
                return process, line.split()[-1]


async def run_batch(
    client: Client, requests: list[v1.RolloutRequest], run: Run | None = None
) -> dict[str, tuple[v1.RolloutResult, float]]:
    submitted = time.perf_counter()
    results: dict[str, tuple[v1.RolloutResult, float]] = {}
    in_eval: set[str] = set()
    async for event in client.rollout_many(requests):
        if isinstance(event, v1.RolloutRejected):
            raise RuntimeError(f"rejected: {event}")
        if event.HasField("phase_started") and event.phase_started.phase == v1.PHASE_EVAL:
            in_eval.add(event.job_id)
            if run is not None and len(in_eval) == len(requests):
                run.all_in_eval_at = time.perf_counter()
        if event.HasField("finished"):
            results[event.job_id] = (event.finished.result, time.perf_counter() - submitted)
    return results


async def measure(label: str, tree: Path, requests: list[v1.RolloutRequest], args: argparse.Namespace) -> Run:
    run = Run(label, tree=tree)
    stalls = tempfile.NamedTemporaryFile(prefix="prorl-stalls-", delete=False)  # noqa: SIM115 (read after the server)
    stalls.close()
    process, address = await start_server(tree, args.processes, args.limit, stalls.name if args.stalls else "")
    client, stats_client = Client.connect(address), Client.connect(address)
    try:
        await client.wait_ready()
        warm = await run_batch(
            client, [request("warm-math", "math", 42, "42"), request("warm-stem", "stem", "1.0", "1")]
        )
        if any(result.reward != 1.0 for result, _ in warm.values()):
            run.problems.append(f"{label}: the warm-up did not score 1")
        run.start_mib = rss_mib(process.pid)
        done = asyncio.Event()

        async def stats() -> None:
            while not done.is_set():
                began = time.perf_counter()
                await stats_client.get_stats()
                run.stats_s.append(time.perf_counter() - began)
                run.stats_at.append(began)
                await asyncio.sleep(0.05)

        async def memory() -> None:
            while not done.is_set():
                run.rss.append(rss_mib(process.pid))
                await asyncio.sleep(0.1)

        samplers = [asyncio.create_task(stats()), asyncio.create_task(memory())]
        began = time.perf_counter()
        try:
            results = await run_batch(client, requests, run)
        finally:
            run.wall_s = time.perf_counter() - began
            done.set()
            await asyncio.gather(*samplers)
        await asyncio.sleep(args.settle)
        run.end_mib = rss_mib(process.pid)
        for job in requests:
            result, took = results[job.job_id]
            if job.job_id.startswith("right"):
                run.right_s.append(took)
                if result.reward != 1.0:
                    run.problems.append(f"{label}: {job.job_id} scored {result.reward} ({result.failure.reason})")
            elif (result.failure.kind, result.failure.reason) != (v1.FAILURE_KIND_POLICY, "verification_timeout"):
                run.problems.append(f"{label}: {job.job_id} ended {result.failure.reason or 'without a failure'}")
    finally:
        await client.close()
        await stats_client.close()
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        run.stalls = take_text(stalls.name)
    return run


@contextlib.contextmanager
def worktree(rev: str) -> Any:
    """REV's tree in a temporary git worktree, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="prorl-before-") as parent:
        path = Path(parent) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=True)


async def main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.common import percentile

    def ms(samples: list[float], q: float) -> str:
        return f"{percentile(samples, q) * 1e3:.1f}" if samples else "-"

    print(
        f"# Verification bench, {os.cpu_count()} cores: {args.right} right answers, alone and beside "
        f"{args.hostile} hostile ones ({HOSTILE}); verifier.processes = {args.processes}, "
        f"verifier.time_limit_s = {args.limit:g}; load average {os.getloadavg()[0]:.1f} at the start"
    )
    hostile = [request(f"hostile-{i}", "math", 42, HOSTILE) for i in range(args.hostile)]
    with contextlib.ExitStack() as stack:
        trees = [(args.before, stack.enter_context(worktree(args.before)))] if args.before else []
        trees.append(("this tree" if args.before else "", ROOT))
        runs = [
            await measure(f"{name}: {label}" if name else label, tree, batch, args)
            for label, batch in (("alone", right_answers(args.right)), ("hostile", hostile + right_answers(args.right)))
            for name, tree in trees
        ]
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    print(
        "\n| run | batch wall | GetStats p50 / max | GetStats p50 / max once every job is in eval (only checks run) "
        "| right answers' job time p50 / max | server RSS start/peak/end |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for run in runs:
        checking = [took for took, at in zip(run.stats_s, run.stats_at, strict=True) if at >= run.all_in_eval_at]
        print(
            f"| {run.label} | {run.wall_s:.1f} s | {ms(run.stats_s, 50)} / {ms(run.stats_s, 100)} ms "
            f"(n={len(run.stats_s)}) | {ms(checking, 50)} / {ms(checking, 100)} ms (n={len(checking)}) | "
            f"{ms(run.right_s, 50)} / {ms(run.right_s, 100)} ms | "
            f"{run.start_mib:.0f} / {max(run.rss, default=0):.0f} / {run.end_mib:.0f} MiB |"
        )
    for run in runs:
        if run.stalls:
            print(f"\n{run.label}: {run.stalls}")
    problems = [problem for run in runs for problem in run.problems]
    for run in runs:
        if run.label.endswith("hostile") and run.end_mib > run.start_mib + RSS_SLACK_MIB:
            problems.append(f"{run.label}: server RSS {run.start_mib:.0f} -> {run.end_mib:.0f} MiB")
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--right", type=int, default=6)
    parser.add_argument("--hostile", type=int, default=20)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--limit", type=float, default=5.0)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--before", default="", help="also measure this git revision's code, side by side")
    parser.add_argument("--stalls", action="store_true", help="sample where each server's event loop stalls")
    parser.add_argument("--stalls-file", default="", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve:
        asyncio.run(serve(arguments.processes, arguments.limit, arguments.stalls_file))
    else:
        sys.exit(asyncio.run(main(arguments)))
