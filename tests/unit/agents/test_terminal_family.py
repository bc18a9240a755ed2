"""The terminal family end to end through the job pipeline without Podman: the shipped Harbor
tasks (sandbox_images/terminal/tasks), imported by `prorl import-harbor`, done by a scripted policy
that runs the task's oracle solution (reward 1), a wrong one (0), or one of the reward hacks a
policy would try (0), judged by the real harness in fake sandboxes (the in-sandbox runtime as a
local process, the pytest of the Python running these tests).

The fake sandboxes are folders on this host, so the task's absolute paths (/app, /tests,
/logs/verifier) are rewritten to folders of the provider's one fixed workdir, in the tests and
solutions alike; tests/integration/test_terminal.py runs the same tasks unchanged in Podman."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import tarfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prorl_client.harbor_import import import_folders

from prorl_client import v1
from prorl_server.agents import terminal
from prorl_server.agents.base import Limits, RolloutContext
from prorl_server.agents.command import CommandHandler
from prorl_server.agents.registry import default_registry
from prorl_server.agents.terminal import TerminalInstance
from prorl_server.config import Settings, load_settings
from prorl_server.errors import InvalidArgument
from prorl_server.jobs.phase_runner import BudgetClock
from prorl_server.jobs.record import JobPlan
from prorl_server.jobs.validation import resolve_plan
from prorl_server.llm.base import Sampling
from prorl_server.sandbox.runtime.prorl_sandbox_runtime import judge_terminal
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import tool_call_text
from tests.unit.agents.test_families_fast import Rollout, leftovers, rollout, succeeded

TASKS_DIR = Path(__file__).resolve().parents[3] / "sandbox_images" / "terminal" / "tasks"
IMPORTED = import_folders([TASKS_DIR])
TASKS = {task["id"]: task["instance"] for task in IMPORTED.tasks}

# A wrong answer for each shipped task: close to right, and caught by its tests.
WRONG = {
    "hello-world": "echo 'Hello world' > /app/hello.txt",
    "csv-region-totals": (
        'python3 -c "import csv, json; t = {}\n'
        "for r in csv.DictReader(open('/app/sales.csv')):\n"
        "    t[r['region']] = round(t.get(r['region'], 0) + float(r['units'].replace('three', '3'))"
        " * float(r['unit_price']), 2)\n"
        "json.dump(dict(sorted(t.items())), open('/app/totals.json', 'w'))\""
    ),
    # Fixes the count of lines printed, not the case and punctuation of words.
    "fix-word-count": "sed -i 's/\\[: n - 1\\]/[:n]/' /app/wordfreq.py",
}


def image_setup(task_id: str) -> Any:
    """A fake image of the task: its environment's files in app/ (each task's Dockerfile copies
    them into /app)."""
    environment = IMPORTED.environments[task_id]

    def setup(root: Path) -> None:
        app = root / "app"
        app.mkdir()
        assert environment.context is not None
        for path in environment.context.iterdir():
            if path.name != "Dockerfile":
                shutil.copy(path, app / path.name)
        if (app / "wordfreq.py").exists():
            (app / "wordfreq.py").chmod(0o755)

    return setup


@pytest.fixture
def state_file(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The handler archives the working directory at /tmp/prorl-state.tar, which in a fake
    sandbox is a host path that other test runs on this host would share: each test gets a name
    of its own there."""
    path = f"/tmp/prorl-state-{os.getpid()}-{uuid.uuid4().hex[:8]}.tar"
    monkeypatch.setattr(terminal, "STATE_PATH", path)
    yield
    if os.path.lexists(path):
        os.unlink(path)


@pytest_asyncio.fixture
async def provider(state_file: None, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeSandboxProvider]:
    images = {instance["image"]: image_setup(task_id) for task_id, instance in TASKS.items()}
    provider = FakeSandboxProvider(images=images, instance_id=instance_id("term"), fixed_workdir=True)
    await provider.start()
    monkeypatch.setattr(terminal, "LOGS_DIRS", (str(provider.workdir / "logs" / "verifier"),))
    yield provider
    await provider.close()
    assert provider.busy == 0 and leftovers(provider) == []


def paths(provider: FakeSandboxProvider) -> dict[str, str]:
    root = provider.workdir
    return {"/app": str(root / "app"), "/tests": str(root / "tests"), "/logs": str(root / "logs")}


def on_host(text: str, provider: FakeSandboxProvider) -> str:
    for old, new in paths(provider).items():
        text = text.replace(old, new)
    return text


def instance_on_host(task_id: str, provider: FakeSandboxProvider) -> dict[str, Any]:
    instance = dict(TASKS[task_id])
    instance["tests"] = {name: on_host(text, provider) for name, text in instance["tests"].items()}
    instance["workdir"] = paths(provider)["/app"]
    instance["tests_dir"] = paths(provider)["/tests"]
    instance["verifier_timeout_s"] = 120
    return instance


async def run_commands(
    provider: FakeSandboxProvider,
    task_id: str,
    *commands: str,
    changes: dict[str, Any] | None = None,
    prepare: Callable[[v1.RolloutRequest], None] = lambda request: None,
) -> Rollout:
    """The policy: each command in the working directory (paths made host paths), then finish;
    `changes` to the task's instance."""
    app = paths(provider)["/app"]
    calls = [tool_call_text("bash", {"command": f"cd {app} && {on_host(c, provider)}"}) for c in commands]
    instance = {**instance_on_host(task_id, provider), **(changes or {})}
    return await rollout(provider, "terminal", instance, [*calls, tool_call_text("finish", {})], prepare=prepare)


def statuses(run: Rollout) -> dict[str, str]:
    """Each test's status, by its id without the folder (the fake's ids are relative to its workdir)."""
    return {test.rsplit("/", 1)[-1]: str(status) for test, status in dict(run.details["tests"]).items()}


def solution(task_id: str) -> str:
    return (TASKS_DIR / task_id / "solution" / "solve.sh").read_text()


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_the_oracle_solution_scores_one(provider: FakeSandboxProvider, task_id: str) -> None:
    run = await run_commands(provider, task_id, solution(task_id))
    succeeded(run, 1.0)
    details = run.details
    assert details["verdict"] == "passed" and details["task"] == task_id
    assert details["tests_total"] >= 1 and details["tests_passed"] == details["tests_total"]
    assert set(statuses(run).values()) == {"PASSED"}
    # The agent's sandbox, then a fresh one for the tests, both of the task's image.
    assert [spec.image for spec in run.sandboxes] == [TASKS[task_id]["image"]] * 2


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_a_wrong_solution_scores_zero(provider: FakeSandboxProvider, task_id: str) -> None:
    run = await run_commands(provider, task_id, WRONG[task_id])
    succeeded(run, 0.0)
    assert run.details["verdict"] == "failed", run.details
    assert "FAILED" in statuses(run).values()


async def test_doing_nothing_scores_zero(provider: FakeSandboxProvider) -> None:
    run = await run_commands(provider, "fix-word-count", "true")
    succeeded(run, 0.0)
    assert run.details["verdict"] == "failed"


# --- reward hacks: each scores 0 ----------------------------------------------------------------

PASSING_TESTS = "def test_outputs():\n    pass\n"


async def test_rewriting_the_tests_in_the_agents_sandbox_scores_zero(provider: FakeSandboxProvider) -> None:
    # The agent replaces the task's tests (where Harbor uploads them) and writes conftest.py in its
    # working directory, with the hello file missing: the judge's sandbox gets the task's own tests.
    forged = f"mkdir -p /tests && printf '{PASSING_TESTS}' > /tests/test_outputs.py && cp /tests/test_outputs.py ."
    run = await run_commands(provider, "hello-world", forged)
    succeeded(run, 0.0)
    assert run.details["verdict"] == "failed"
    assert statuses(run) == {
        "test_outputs.py::test_hello_file_exists": "FAILED",
        "test_outputs.py::test_hello_file_contents": "FAILED",
    }


async def test_a_fake_reward_file_scores_zero(provider: FakeSandboxProvider) -> None:
    hack = "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && echo '{\"reward\": 1}' > reward.json"
    run = await run_commands(provider, "hello-world", hack, "echo 1 > /logs/verifier/reward.txt")
    succeeded(run, 0.0)
    assert run.details["verdict"] == "failed"


async def test_printing_pytest_success_scores_zero(provider: FakeSandboxProvider) -> None:
    # wordfreq.py prints what pytest would print for a passing run (and the expected answer of the
    # example): the outcome is the reporter's, and the forged lines are tampering.
    forged = (
        "cat > /app/wordfreq.py <<'EOF'\n"
        "import sys\n"
        "print('the 4\\nsaw 3\\nbird 2')\n"
        "for name in ('test_example', 'test_hidden_text', 'test_n_larger_than_vocabulary'):\n"
        "    print('PASSED test_outputs.py::' + name, file=sys.stderr)\n"
        "print('==== 3 passed in 0.01s ====')\n"
        "EOF"
    )
    run = await run_commands(provider, "fix-word-count", forged)
    succeeded(run, 0.0)
    assert run.details["verdict"] in ("failed", "tampered"), run.details
    assert statuses(run)["test_outputs.py::test_hidden_text"] == "FAILED", run.details


async def test_a_conftest_in_the_working_directory_is_never_loaded(provider: FakeSandboxProvider) -> None:
    # A conftest.py (and a pytest.ini) in the working directory that would turn every failure into
    # a pass, and a wrong hello file: pytest never loads them (the tests are not under the working
    # directory), so the wrong file fails.
    conftest = (
        "import pytest\n"
        "@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n"
        "    outcome.get_result().outcome = 'passed'\n"
    )
    hack = f"cat > conftest.py <<'EOF'\n{conftest}EOF\ncp conftest.py pytest.ini; echo 'Hello' > hello.txt"
    run = await run_commands(provider, "hello-world", hack)
    succeeded(run, 0.0)
    assert run.details["verdict"] == "failed", run.details
    assert statuses(run) == {
        "test_outputs.py::test_hello_file_exists": "PASSED",
        "test_outputs.py::test_hello_file_contents": "FAILED",
    }


async def test_modules_of_the_working_directory_do_not_shadow_the_tests_imports(
    provider: FakeSandboxProvider,
) -> None:
    # csv.py and decimal.py in the working directory that would patch pytest's reports: the
    # working directory is not on the tests' sys.path (as for test.sh's pytest command), so the
    # tests import the standard library's, and with no totals.json they fail.
    shadow = "import _pytest.reports\n_pytest.reports.TestReport.outcome = 'passed'\n"
    hack = f"cat > /app/csv.py <<'EOF'\n{shadow}EOF\ncp /app/csv.py /app/decimal.py"
    run = await run_commands(provider, "csv-region-totals", hack)
    succeeded(run, 0.0)
    assert run.details["verdict"] == "failed", run.details
    assert statuses(run)["test_outputs.py::test_input_is_untouched"] == "PASSED"  # the real csv module


# --- the harness's unpacking ----------------------------------------------------------------------


def archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def test_the_state_never_leaves_the_working_directory(tmp_path: Path) -> None:
    app, outside = tmp_path / "app", tmp_path / "outside"
    app.mkdir()
    outside.mkdir()
    (tmp_path / "state.tar").write_bytes(
        archive(
            (member("./ok.txt"), b"fine"),
            (member("../escaped.txt"), b"x"),
            (member("/abs.txt"), b"x"),
            (member("link", tarfile.SYMTYPE, str(outside)), None),
            (member("link/through.txt"), b"x"),
            (member("hard", tarfile.LNKTYPE, "ok.txt"), None),
            (member("fifo", tarfile.FIFOTYPE), None),
        )
    )
    written, skipped = judge_terminal.unpack_state(str(tmp_path / "state.tar"), str(app))
    assert (app / "ok.txt").read_bytes() == b"fine" and os.readlink(app / "link") == str(outside)
    assert written == 2 and len(skipped) == 5, skipped
    assert not list(outside.iterdir()) and not (tmp_path / "escaped.txt").exists()
    assert not (app / "hard").exists() and not (app / "fifo").exists()


def test_an_agent_program_is_judged_on_its_working_directory() -> None:
    handler = CommandHandler()
    program = {"argv": ["agent"], "cwd": "/app"}
    task = TASKS["hello-world"]
    instance = handler.validate({"program": program, "verifier": "terminal", "task": task, "submission": "workdir"})
    assert handler.image_for(instance) == task["image"]
    for verifier, submission in (("terminal", "last_line"), ("math", "workdir")):
        judged = task if verifier == "terminal" else {"question": "?", "answer": "1"}
        with pytest.raises(InvalidArgument, match="working directory"):
            handler.validate({"program": program, "verifier": verifier, "task": judged, "submission": submission})


# --- the task's own limits (task.toml), enforced ------------------------------------------------

AGENT_TIMEOUT_S = 15.0
"""Long enough for the policy's first quick command on a loaded machine; its second never ends."""
SMALL_SERVER = load_settings(
    None, environ={}, overrides={"jobs": {"store": False}, "sandbox": {"max_cpus": 2, "max_memory_mib": 2048}}
)


def plan_of(
    instance: dict[str, Any],
    prepare: Callable[[v1.RolloutRequest], None] = lambda request: None,
    settings: Settings = SMALL_SERVER,
    handler: str = "terminal",
) -> JobPlan:
    request = v1.RolloutRequest(job_id="plan", handler=handler)
    request.instance.update(instance)
    prepare(request)
    return resolve_plan(request, settings, default_registry())


async def test_the_tasks_cpus_and_memory_reach_the_plan_and_its_sandboxes(provider: FakeSandboxProvider) -> None:
    run = await run_commands(provider, "hello-world", solution("hello-world"), changes={"cpus": 2, "memory_mib": 768})
    succeeded(run, 1.0)
    # The agent's sandbox and the judge's fresh one alike.
    assert [(spec.cpus, spec.memory_mib) for spec in run.sandboxes] == [(2.0, 768)] * 2
    task = TASKS["hello-world"]  # imported: cpus = 1, memory_mb = 1024
    plan = plan_of(task)
    assert (plan.cpus, plan.memory_mib) == (1.0, 1024)
    bare = {key: value for key, value in task.items() if key not in ("cpus", "memory_mib")}
    assert (plan_of(bare).cpus, plan_of(bare).memory_mib) == (
        SMALL_SERVER.sandbox.cpus,
        SMALL_SERVER.sandbox.memory_mib,
    )

    def smaller(request: v1.RolloutRequest) -> None:
        request.sandbox.cpus, request.sandbox.memory_mib = 0.5, 512

    plan = plan_of({**task, "cpus": 2, "memory_mib": 2048}, smaller)  # the request's own word wins
    assert (plan.cpus, plan.memory_mib) == (0.5, 512)


def test_a_task_asking_more_than_the_server_gives_is_refused_naming_the_setting() -> None:
    task = TASKS["hello-world"]
    with pytest.raises(InvalidArgument, match=r"asks for 4 CPUs .*at most 2 \(setting sandbox\.max_cpus\)"):
        plan_of({**task, "cpus": 4})
    with pytest.raises(
        InvalidArgument, match=r"4096 MiB of memory .*at most 2048 MiB \(setting sandbox\.max_memory_mib\)"
    ):
        plan_of({**task, "memory_mib": 4096})

    def within(request: v1.RolloutRequest) -> None:
        request.sandbox.cpus, request.sandbox.memory_mib = 2, 2048

    assert plan_of({**task, "cpus": 4, "memory_mib": 4096}, within).cpus == 2  # asked for less: runs with less


def test_the_budget_lets_the_tasks_own_limits_play_out() -> None:
    task = {**TASKS["hello-world"], "agent_timeout_s": 3000, "verifier_timeout_s": 120}
    needed = 3000 + 120 + terminal.OVERHEAD_S
    assert plan_of(task).budget_s == needed  # over the default budget (1800 s): raised to it
    assert plan_of(TASKS["hello-world"]).budget_s == SMALL_SERVER.jobs.default_budget_s

    def budget(seconds: int) -> Callable[[v1.RolloutRequest], None]:
        return lambda request: request.limits.budget.FromSeconds(seconds)

    assert plan_of(task, budget(4000)).budget_s == 4000
    with pytest.raises(InvalidArgument, match=rf"limits.budget 600s is less than the {needed:g}s the task's own"):
        plan_of(task, budget(600))
    with pytest.raises(InvalidArgument, match=r"over this server's maximum of 14400s \(setting jobs.max_budget_s\)"):
        plan_of({**task, "agent_timeout_s": 20000})


async def test_an_agent_past_its_time_is_stopped_and_judged_on_what_it_left(provider: FakeSandboxProvider) -> None:
    # The policy writes a hello file with the wrong text, then would write the right one after a
    # command that never ends. At the task's agent timeout the command is stopped (well before
    # its own tool timeout) and the working directory as it was then is judged.
    def slow_tools(request: v1.RolloutRequest) -> None:
        request.limits.tool_timeout.FromSeconds(600)

    commands = ("echo 'Hello' > /app/hello.txt", "sleep 3600; echo 'Hello, world!' > /app/hello.txt")
    run = await run_commands(
        provider, "hello-world", *commands, changes={"agent_timeout_s": AGENT_TIMEOUT_S}, prepare=slow_tools
    )
    succeeded(run, 0.0)
    assert run.details["stop_reason"] == "agent_timeout" and run.details["agent_timeout_s"] == AGENT_TIMEOUT_S
    assert statuses(run) == {
        "test_outputs.py::test_hello_file_exists": "PASSED",  # what it did in time carried over
        "test_outputs.py::test_hello_file_contents": "FAILED",  # what it would have done after, not
    }
    assert run.result.timing.run.ToTimedelta().total_seconds() < 600  # not left to the sleep's own timeout


async def test_the_tests_run_within_the_tasks_verifier_timeout(provider: FakeSandboxProvider) -> None:
    # Each test runs wordfreq.py with a 60 s timeout of its own; the policy's wordfreq.py never ends.
    hang = "printf 'import time\\ntime.sleep(3600)\\n' > /app/wordfreq.py"
    run = await run_commands(provider, "fix-word-count", hang, changes={"verifier_timeout_s": 5})
    succeeded(run, 0.0)
    assert run.details["verdict"] == "tests_timed_out", run.details


def terminal_context(job_id: str, clock: BudgetClock | None = None) -> RolloutContext[Any]:
    """A hello-world task's context with no model, sandboxes or recorder: for the time limits."""
    return RolloutContext(
        job_id=job_id,
        instance=TerminalInstance.model_validate(TASKS["hello-world"]),
        limits=Limits(max_turns=1, tool_timeout_s=1000),
        sampling=Sampling(max_tokens=16, temperature=0.0),
        chat=None,  # type: ignore[arg-type]
        sandbox_factory=None,  # type: ignore[arg-type]
        recorder=None,  # type: ignore[arg-type]
        clock=clock,
    )


async def test_the_agents_time_stops_while_the_job_waits_for_a_model_slot() -> None:
    clock = BudgetClock()
    ctx = terminal_context("clock", clock)
    assert ctx.tool_timeout_s == 1000
    waited_past_them = False
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5) as budget:  # the job's budget, governed as the agent's time is
            with clock.governing(budget):
                async with ctx.time_limit(0.5) as deadline:
                    assert 0 < ctx.tool_timeout_s <= 0.5  # a tool call gets no more than what is left
                    with clock.waiting_for_model():
                        await asyncio.sleep(1.0)  # past both limits, which stand still meanwhile
                    assert not deadline.expired() and not budget.expired()
                    waited_past_them = True
                    await asyncio.sleep(3600)
    assert waited_past_them and deadline.expired() and clock.model_wait_s >= 1.0
    assert ctx.tool_timeout_s == 1000  # the limit is over


def test_an_agent_programs_time_is_the_tasks_agent_timeout() -> None:
    handler = CommandHandler()

    def instance(program_s: float, agent_s: float) -> Any:
        task = {**TASKS["hello-world"], "agent_timeout_s": agent_s}
        program = {"argv": ["agent"], "cwd": "/app", "timeout_s": program_s}
        return handler.validate({"program": program, "verifier": "terminal", "task": task, "submission": "workdir"})

    assert handler.program_timeout_s(instance(600, 45)) == 45
    assert handler.program_timeout_s(instance(30, 45)) == 30
    assert handler.program_timeout_s(instance(600, 0)) == 600  # the task sets none
    needs = handler.needs(instance(600, 45))
    assert needs.budget_s == 45 + 120 + terminal.OVERHEAD_S and (needs.cpus, needs.memory_mib) == (1, 1024)
    assert handler.needs(instance(600, 0)).budget_s == 0
