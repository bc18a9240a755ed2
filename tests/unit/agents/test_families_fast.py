"""Every task family end to end through the job pipeline, without Podman or a model: a scripted
policy that is right and one that is wrong, tools and judging in fake sandboxes (the real
in-sandbox runtime and judging harness as local processes).

SWE uses a tiny git repository laid out by the fake image's setup, at the same absolute path in
every sandbox (FakeSandboxProvider(fixed_workdir=True)), judged by the real harness with the
pytest of the Python running these tests."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import v1
from prorl_server.agents.registry import default_registry
from prorl_server.config import load_settings
from prorl_server.jobs.event_log import EventLog
from prorl_server.jobs.phases import phase_gates
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.record import JobRecord
from prorl_server.jobs.validation import resolve_plan
from prorl_server.llm.router import BackendRouter
from prorl_server.sandbox.allocator import SandboxAllocator
from prorl_server.sandbox.base import SandboxSpec
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import Replies, ScriptedChatBackend, tool_call_text
from tests.helpers import kinds

SETTINGS = load_settings(None, environ={}, overrides={"jobs": {"store": False}})


class Rollout:
    def __init__(self, job: JobRecord, provider: FakeSandboxProvider) -> None:
        assert job.result is not None
        self.result = job.result
        self.events = job.events.events()
        self.details: dict[str, Any] = dict(self.result.details)
        self.sandboxes = list(provider.created)

    def tool_results(self) -> list[v1.ToolResult]:
        return [event.tool_result for event in self.events if event.HasField("tool_result")]


async def rollout(
    provider: FakeSandboxProvider,
    handler: str,
    instance: dict[str, Any],
    replies: Replies,
    *,
    max_turns: int = 5,
    prepare: Callable[[v1.RolloutRequest], None] = lambda request: None,
) -> Rollout:
    """One job of `handler` through a pipeline over `provider` and a backend playing `replies`
    (`prepare` sets more of the request)."""
    request = v1.RolloutRequest(job_id=f"{handler}-job", handler=handler)
    request.instance.update(instance)
    request.limits.max_turns = max_turns
    prepare(request)
    job = JobRecord(
        job_id=request.job_id,
        number=1,
        request=request,
        fingerprint=b"",
        plan=resolve_plan(request, SETTINGS, default_registry()),
        create_time=time.time(),
        events=EventLog(request.job_id),
    )
    job.events.append(queued=v1.JobQueued())
    router = BackendRouter(health_interval_s=0)
    router.add(ScriptedChatBackend(replies))
    allocator = SandboxAllocator(provider, [])
    provider.created.clear()
    try:
        job.started = True
        await Pipeline(gates=phase_gates(init=1, run=1, eval=1), sandboxes=allocator, router=router).execute(job)
    finally:
        await allocator.close()
        await router.close()
    assert provider.busy == 0, "the job left sandboxes behind"
    return Rollout(job, provider)


def finish(answer: str) -> list[str]:
    return [tool_call_text("finish", {"answer": answer})]


def succeeded(run: Rollout, reward: float) -> None:
    assert run.result.status == v1.JOB_STATUS_SUCCEEDED, run.result.failure
    assert run.result.reward == reward, run.details
    assert kinds(run.events)[-2:] == ["evaluation", "finished"]


# --- math ---------------------------------------------------------------------

MATH = {"question": "What is 6 * 7?", "answer": 42}


@pytest.mark.parametrize(("answer", "reward", "verdict"), [("42", 1.0, "correct"), ("41", 0.0, "wrong")])
async def test_math_right_and_wrong(
    fake_provider: FakeSandboxProvider, answer: str, reward: float, verdict: str
) -> None:
    replies = [tool_call_text("python", {"code": "print(6 * 7)"}), *finish(answer)]
    run = await rollout(fake_provider, "math", MATH, replies)

    succeeded(run, reward)
    assert run.details["verdict"] == verdict and run.details["answer"] == answer and run.details["gold"] == "42"
    assert run.details["stop_reason"] == "finish" and run.details["format_errors"] == 0
    assert run.tool_results()[0].output == "42\n"


async def test_math_without_an_answer_scores_zero(fake_provider: FakeSandboxProvider) -> None:
    run = await rollout(fake_provider, "math", MATH, [tool_call_text("python", {"code": "print(6 * 7)"})], max_turns=1)

    succeeded(run, 0.0)
    assert run.details["verdict"] == "no answer submitted" and run.details["answer"] is None
    assert run.details["stop_reason"] == "max_turns"


# --- stem ---------------------------------------------------------------------

PLANETS = {"question": "Which planet do we live on?", "choices": ["Mars", "Earth", "Venus"], "answer": "B"}


@pytest.mark.parametrize(
    ("answer", "reward", "picked"),
    [("B", 1.0, "B"), ("Earth", 1.0, "B"), ("A", 0.0, "A")],
    ids=["letter", "text", "wrong"],
)
async def test_stem_multiple_choice(
    fake_provider: FakeSandboxProvider, answer: str, reward: float, picked: str
) -> None:
    run = await rollout(fake_provider, "stem", PLANETS, finish(answer))

    succeeded(run, reward)
    assert (run.details["picked"], run.details["expected"]) == (picked, "B")
    assert run.details["verdict"] == ("correct" if reward else "wrong")
    user = run.result.trajectory.messages[1].content
    assert user.endswith("A. Mars\nB. Earth\nC. Venus")  # the choices are shown lettered


# --- code ---------------------------------------------------------------------

ADD = {
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "eval_timeout_s": 10,
}
SUM_PROGRAM = {
    "problem": "Read two integers on one line and print their sum.",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}],
    "eval_timeout_s": 10,
}


async def test_code_function_passing_solution(fake_provider: FakeSandboxProvider) -> None:
    solution = "def add(a, b):\n    return a + b\n"
    replies = [tool_call_text("python", {"code": solution + "print(add(2, 3))"}), *finish(solution)]
    run = await rollout(fake_provider, "code", ADD, replies)

    succeeded(run, 1.0)
    assert run.details["verdict"] == "pass" and run.details["timed_out"] is False
    assert run.tool_results()[0].output == "5\n"
    # Judged in a sandbox of its own, not the one the agent used.
    assert len(run.sandboxes) == 2 and run.sandboxes[0].image == run.sandboxes[1].image


async def test_code_function_failing_solution(fake_provider: FakeSandboxProvider) -> None:
    run = await rollout(fake_provider, "code", ADD, finish("def add(a, b):\n    return a - b\n"))

    succeeded(run, 0.0)
    assert run.details["verdict"] == "fail" and "AssertionError" in run.details["output"]


HACKS = {
    # Its own check() in the module: the task's check() is what runs, in the harness.
    "own-check": (
        "def add(a, b):\n    return 0\n\n\ndef check(candidate):\n    pass\n",
        "check() raised AssertionError",
    ),
    # Exits 0 before the tests can run.
    "exit-early": ("import sys\nsys.exit(0)\n\n\ndef add(a, b):\n    return 0\n", "the submission failed to load"),
    # Ends its process, with status 0, when called.
    "exit-in-call": ("import os\n\n\ndef add(a, b):\n    os._exit(0)\n", "the candidate's process ended"),
    # Returns an object equal to anything.
    "always-equal": (
        "class Same:\n    def __eq__(self, other):\n        return True\n\n\ndef add(a, b):\n    return Same()\n",
        "not plain data",
    ),
}


@pytest.mark.parametrize("hack", list(HACKS))
async def test_code_reward_hacks_score_zero(fake_provider: FakeSandboxProvider, hack: str) -> None:
    solution, reason = HACKS[hack]
    run = await rollout(fake_provider, "code", ADD, finish(solution))

    succeeded(run, 0.0)
    assert run.details["verdict"] == "fail" and reason in run.details["reason"], run.details


@pytest.mark.parametrize(
    ("program", "reward", "passed"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)\n", 1.0, 2),
        ("a, b = map(int, input().split())\nprint(a * b)\n", 0.0, 0),
    ],
    ids=["right", "wrong"],
)
async def test_code_program_against_stdin_stdout(
    fake_provider: FakeSandboxProvider, program: str, reward: float, passed: int
) -> None:
    run = await rollout(fake_provider, "code", SUM_PROGRAM, finish(program))

    succeeded(run, reward)
    assert (run.details["passed"], run.details["total"]) == (passed, 2)
    assert [test["passed"] for test in run.details["tests"]] == [bool(reward)] * 2


# --- swe ----------------------------------------------------------------------

SWE_IMAGE = "localhost/prorl-swe-fake__calc-1.0:latest"
GIT = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}
CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
TESTS = "from calc import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
# Unified diffs; " " is a blank context line.
TEST_PATCH = "\n".join(
    [
        "diff --git a/tests/test_calc.py b/tests/test_calc.py",
        "--- a/tests/test_calc.py",
        "+++ b/tests/test_calc.py",
        "@@ -1,5 +1,9 @@",
        "-from calc import sub",
        "+from calc import add, sub",
        " ",
        " ",
        " def test_sub():",
        "     assert sub(5, 3) == 2",
        "+",
        "+",
        "+def test_add():",
        "+    assert add(2, 3) == 5",
        "",
    ]
)
GOLD_PATCH = "\n".join(
    [
        "diff --git a/calc.py b/calc.py",
        "index 3b2d8f1..ffd5e0e 100644",
        "--- a/calc.py",
        "+++ b/calc.py",
        "@@ -1,5 +1,5 @@",
        " def add(a, b):",
        "-    return a - b",
        "+    return a + b",
        " ",
        " ",
        " def sub(a, b):",
        "",
    ]
)
CHEAT = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
)
SUBMISSION = "/tmp/prorl-submission.patch"  # where the SWE handler writes the diff: a host path with the fake


def calc_repository(workdir: Path) -> None:
    """The fake SWE image: `repo`, a git repository whose add() subtracts."""
    repo = workdir / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    for command in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "base"]):
        subprocess.run(command, cwd=repo, check=True, env={**os.environ, **GIT})


@pytest.fixture
def submission_file() -> Iterator[None]:
    """The SWE handler writes the agent's diff to /tmp/prorl-submission.patch, a host path here:
    removed after the test unless it was there before (another run's)."""
    existed = os.path.lexists(SUBMISSION)
    if existed and not os.access(SUBMISSION, os.W_OK):
        pytest.skip(f"{SUBMISSION} belongs to someone else on this host")
    yield
    if not existed and os.path.lexists(SUBMISSION):
        os.unlink(SUBMISSION)


@pytest_asyncio.fixture
async def swe_provider(submission_file: None) -> AsyncIterator[FakeSandboxProvider]:
    # Under the system's temp dir, not tmp_path: a deeper folder could outgrow a unix socket's path.
    provider = FakeSandboxProvider(
        images={SWE_IMAGE: calc_repository}, instance_id=instance_id("swe"), fixed_workdir=True
    )
    await provider.start()
    yield provider
    await provider.close()
    assert provider.busy == 0 and leftovers(provider) == []


def leftovers(provider: FakeSandboxProvider) -> list[Path]:
    """The provider's folders still on disk."""
    return list(Path(tempfile.gettempdir()).glob(f"prorl-{provider.instance_id}-*"))


def swe_instance(provider: FakeSandboxProvider) -> dict[str, Any]:
    files = provider.image_files(SWE_IMAGE) / "repo"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=files, check=True, capture_output=True, text=True)
    return {
        "instance_id": "fake__calc-1.0",
        "repo": "fake/calc",
        "base_commit": head.stdout.strip(),
        "problem_statement": "add(2, 3) returns -1 instead of 5.",
        "image": SWE_IMAGE,
        "repo_dir": str(provider.workdir / "repo"),
        "pythonpath": ".",
        "patch": GOLD_PATCH,
        "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_sub"],
        "eval_timeout_s": 60,
    }


def edit(repo_dir: str, old: str, new: str) -> str:
    arguments = {"command": "str_replace", "path": f"{repo_dir}/calc.py", "old_str": old, "new_str": new}
    return tool_call_text("str_replace_editor", arguments)


async def test_swe_a_fix_resolves_the_issue(swe_provider: FakeSandboxProvider) -> None:
    instance = swe_instance(swe_provider)
    repo_dir = instance["repo_dir"]
    fix = edit(repo_dir, "def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b")
    run = await rollout(swe_provider, "swe", instance, [fix, tool_call_text("finish", {"summary": "fixed add"})])

    succeeded(run, 1.0)
    details = run.details
    assert details["verdict"] == "resolved" and details["resolved"] is True and details["stop_reason"] == "finish"
    assert details["fail_to_pass"] == {"tests/test_calc.py::test_add": "PASSED"}
    assert (details["pass_to_pass_passed"], details["pass_to_pass_failing"]) == (1, [])
    assert details["reverted"] == {"restored": [], "deleted": []} and details["instance_id"] == "fake__calc-1.0"
    # The submission is the repository's diff: the upstream fix, line for line.
    assert details["patch"].split("\n")[4:] == GOLD_PATCH.split("\n")[4:]
    assert run.tool_results()[0].output.startswith(f"Edited {repo_dir}/calc.py")
    # The agent's sandbox, then a fresh one for the judge, both of the task's image.
    assert [spec.image for spec in run.sandboxes] == [SWE_IMAGE, SWE_IMAGE]


async def test_swe_no_change_is_unresolved(swe_provider: FakeSandboxProvider) -> None:
    run = await rollout(swe_provider, "swe", swe_instance(swe_provider), [tool_call_text("finish", {})])

    succeeded(run, 0.0)
    details = run.details
    assert details["verdict"] == "unresolved" and details["patch"] == ""
    assert details["fail_to_pass"] == {"tests/test_calc.py::test_add": "FAILED"}  # the test really catches the bug
    assert details["pass_to_pass_failing"] == []


async def test_swe_a_conftest_that_passes_every_test_is_removed_before_judging(
    swe_provider: FakeSandboxProvider,
) -> None:
    instance = swe_instance(swe_provider)
    create = {"command": "create", "path": f"{instance['repo_dir']}/conftest.py", "file_text": CHEAT}
    replies = [tool_call_text("str_replace_editor", create), tool_call_text("finish", {})]
    run = await rollout(swe_provider, "swe", instance, replies)

    succeeded(run, 0.0)
    details = run.details
    assert "b/conftest.py" in details["patch"]  # submitted ...
    assert details["reverted"] == {"restored": [], "deleted": ["conftest.py"]}  # ... and undone by the judge
    assert details["verdict"] == "unresolved" and details["fail_to_pass"]["tests/test_calc.py::test_add"] == "FAILED"


async def test_swe_an_image_without_the_base_commit_is_an_infrastructure_failure(
    swe_provider: FakeSandboxProvider,
) -> None:
    instance = {**swe_instance(swe_provider), "base_commit": "deadbeef"}
    run = await rollout(swe_provider, "swe", instance, [tool_call_text("finish", {})])

    assert run.result.status == v1.JOB_STATUS_FAILED
    failure = run.result.failure
    assert (failure.kind, failure.phase, failure.reason) == (
        v1.FAILURE_KIND_INFRASTRUCTURE,
        v1.PHASE_INIT,
        "swe_image_mismatch",
    )
    assert "deadbeef" in failure.message


async def test_the_fake_gives_each_sandbox_a_fresh_copy_at_the_same_path(swe_provider: FakeSandboxProvider) -> None:
    spec = SandboxSpec(image=SWE_IMAGE, cpus=1.0, memory_mib=256, pids_limit=64)
    first = await swe_provider.create(spec)
    await first.bash("echo changed > repo/calc.py", timeout_s=10)
    second = await swe_provider.create(spec)
    seen = await second.bash("pwd && cat repo/calc.py", timeout_s=10)
    assert seen.output == f"{swe_provider.workdir}\n{CALC}"  # same path, the image's files afresh

    await first.close()
    assert (swe_provider.workdir / "repo" / "calc.py").read_text() == CALC  # the second one's still
    await second.close()
    assert not swe_provider.workdir.exists()
