"""The terminal family end to end through the job pipeline without Podman: the shipped Harbor
tasks (sandbox_images/terminal/tasks), imported by `prorl import-harbor`, done by a scripted policy
that runs the task's oracle solution (reward 1), a wrong one (0), or one of the reward hacks a
policy would try (0), judged by the real harness in fake sandboxes (the in-sandbox runtime as a
local process, the pytest of the Python running these tests).

The fake sandboxes are folders on this host, so the task's absolute paths (/app, /tests,
/logs/verifier) are rewritten to folders of the provider's one fixed workdir, in the tests and
solutions alike; tests/integration/test_terminal.py runs the same tasks unchanged in Podman."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prorl_client.harbor_import import import_folders

from prorl_server.agents import terminal
from prorl_server.agents.command import CommandHandler
from prorl_server.errors import InvalidArgument
from prorl_server.sandbox.runtime import prorl_judge
from tests.conftest import instance_id
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import tool_call_text
from tests.unit.test_families_fast import Rollout, leftovers, rollout, succeeded

TASKS_DIR = Path(__file__).resolve().parents[2] / "sandbox_images" / "terminal" / "tasks"
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
def state_file() -> Iterator[None]:
    """The handler archives the working directory at /tmp/prorl-state.tar, a host path here."""
    path = terminal.STATE_PATH
    existed = os.path.lexists(path)
    if existed and not os.access(path, os.W_OK):
        pytest.skip(f"{path} belongs to someone else on this host")
    yield
    if not existed and os.path.lexists(path):
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


async def run_commands(provider: FakeSandboxProvider, task_id: str, *commands: str) -> Rollout:
    """The policy: each command in the working directory (paths made host paths), then finish."""
    app = paths(provider)["/app"]
    calls = [tool_call_text("bash", {"command": f"cd {app} && {on_host(c, provider)}"}) for c in commands]
    return await rollout(
        provider, "terminal", instance_on_host(task_id, provider), [*calls, tool_call_text("finish", {})]
    )


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
    written, skipped = prorl_judge.unpack_state(str(tmp_path / "state.tar"), str(app))
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
