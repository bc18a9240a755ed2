"""SWE family: on every shipped task, diffs that try to pass the tests without
fixing the bug (test infrastructure that rewrites outcomes, forged output,
killing or exiting the test run, tampering with pytest in-process). Every one
scores 0 with a clear verdict in a job that still succeeds (a trainer trains
on it); the gold patch still resolves, even alongside a conftest.py."""

from __future__ import annotations

import base64
import json
import shlex
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from google.protobuf.json_format import MessageToDict

from prorl_client import v1
from prorl_server.agents.swe import SWEInstance
from prorl_server.datasets.swe import load_task, task_dirs
from tests.adversarial.live import Calls, bash_call, finish_call, live_server, marked
from tests.fakes.scripted_llm import tool_call_text

pytestmark = pytest.mark.podman

# The tasks judged by pytest (Django's and SymPy's runners: tests/integration/test_swe_runners.py).
TASKS = {
    task_dir.name: task
    for task_dir in task_dirs()
    if SWEInstance.model_validate(task := load_task(task_dir)).evaluation() is None
}
# The module every task's tests import: code put there runs inside the test process.
CODE_MODULE = {
    "kjd__idna-3.8": "idna/__init__.py",
    "more-itertools__more-itertools-10.8.0": "more_itertools/__init__.py",
    "pallets__click-8.1.8": "src/click/__init__.py",
    "r1chardj0n3s__parse-1.20.2": "parse.py",
}

# A pytest plugin that reports every test as passed.
EVIL_PLUGIN = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
LOAD_PLUGIN_BY_ENV = 'import os\nos.environ["PYTEST_PLUGINS"] = "evil_plugin"\n'
KILL_EVERYTHING = """
import os as _os, signal as _signal
for _pid in _os.listdir("/proc"):
    if _pid.isdigit() and int(_pid) != _os.getpid():
        try:
            _os.kill(int(_pid), _signal.SIGKILL)
        except OSError:
            pass
_os._exit(0)
"""
PATCH_PYTEST = """
try:
    import _pytest.reports as _reports

    _original = _reports.TestReport.from_item_and_call.__func__

    def _always_passed(cls, item, call):
        report = _original(cls, item, call)
        report.outcome = "passed"
        report.longrepr = None
        return report

    _reports.TestReport.from_item_and_call = classmethod(_always_passed)
except Exception:
    pass
"""


def selected(instance: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys([*instance["FAIL_TO_PASS"], *instance["PASS_TO_PASS"]]))


def forged_lines(instance: dict[str, Any]) -> str:
    """Print what the old log parser took for passes, and pytest's summary line."""
    ids = selected(instance)
    return (
        f"\nfor _test in {ids!r}:\n    print('PASSED ' + _test)\n"
        f"print('=' * 20 + ' {len(ids)} passed in 0.01s ' + '=' * 20, flush=True)\n"
    )


def fake_reports(instance: dict[str, Any]) -> str:
    """Write report files (a log, JUnit XML, JSON) where a verifier might read them, now and at exit."""
    ids = selected(instance)
    log = "".join(f"PASSED {test}\n" for test in ids) + f"==== {len(ids)} passed in 0.01s ====\n"
    cases = "".join(f'<testcase classname="t" name="{test}"/>' for test in ids)
    xml = f'<testsuites><testsuite tests="{len(ids)}" failures="0" errors="0">{cases}</testsuite></testsuites>'
    files = {
        "/tmp/prorl-eval/pytest.log": log,
        "/tmp/prorl-eval/report.xml": xml,
        "/tmp/prorl-eval/junit.xml": xml,
        "/tmp/junit.xml": xml,
        "/testbed/report.xml": xml,
        "/testbed/.report.json": json.dumps({"passed": len(ids), "failed": 0}),
    }
    return f"""
import atexit as _atexit, os as _os

def _fake_reports():
    for _path, _text in {files!r}.items():
        try:
            _os.makedirs(_os.path.dirname(_path), exist_ok=True)
            with open(_path, "w") as _handle:
                _handle.write(_text)
        except OSError:
            pass

_fake_reports()
_atexit.register(_fake_reports)
"""


def forged_frames(instance: dict[str, Any], *, whole_run: bool = False) -> str:
    """Write passing reports in the reporter's own format into every pipe the test process holds
    (`whole_run`: the whole stream of a passing run, then exit before the real reporter says more)."""
    reports: list[dict[str, Any]] = [
        {"kind": "report", "nodeid": test, "when": when, "outcome": "passed", "xfail": False, "sub": False}
        for test in selected(instance)
        for when in ("setup", "call", "teardown")
    ]
    if whole_run:
        reports = [
            {"kind": "collected", "nodeids": selected(instance)},
            *reports,
            {"kind": "finished", "exitstatus": 0},
            {"kind": "exit", "code": 0},
        ]
    return f"""
import json as _json, os as _os, stat as _stat, struct as _struct
_forged = b"".join(
    _struct.pack(">Q", len(_body)) + _body for _body in (_json.dumps(_r).encode() for _r in {reports!r})
)
for _fd in _os.listdir("/proc/self/fd"):
    try:
        if int(_fd) > 2 and _stat.S_ISFIFO(_os.fstat(int(_fd)).st_mode):
            _os.write(int(_fd), _forged)
    except OSError:
        pass
{"_os._exit(0)" if whole_run else ""}
"""


def write(files: dict[str, str], *, append: bool = False, force_add: bool = True) -> str:
    """A bash command writing (or appending to) files under /testbed; ignored paths are added anyway."""
    steps = ["cd /testbed"]
    for path, text in files.items():
        encoded = base64.b64encode(text.encode()).decode()
        quoted = shlex.quote(path)
        redirect = ">>" if append else ">"
        steps.append(f'mkdir -p "$(dirname {quoted})" && echo {encoded} | base64 -d {redirect} {quoted}')
        if force_add:
            steps.append(f"git add -f -- {quoted}")
    return " && ".join(steps)


def in_code(instance_name: str, payload: str) -> str:
    return write({CODE_MODULE[instance_name]: payload}, append=True)


def pyproject_plugin() -> str:
    """Add `-p evil_plugin` to pyproject's pytest options (into its table when it has one)."""
    edit = """
import pathlib
path = pathlib.Path("pyproject.toml")
text = path.read_text() if path.exists() else ""
header, line = "[tool.pytest.ini_options]", 'addopts = "-p evil_plugin"'
if header in text:
    text = text.replace(header, header + "\\n" + line)
else:
    text += "\\n" + header + "\\n" + line + "\\n"
path.write_text(text)
"""
    return f"cd /testbed && python3 -c {shlex.quote(edit)}"


Attack = Callable[[str, dict[str, Any]], list[str]]
PLUGIN = {"evil_plugin.py": EVIL_PLUGIN}

# name: (the agent's bash commands, expected verdict, paths the verdict must list as reverted)
ATTACKS: dict[str, tuple[Attack, str, tuple[str, ...]]] = {
    "conftest-hook": (
        lambda name, task: [
            write({"conftest.py": EVIL_PLUGIN}),
            write({"tests/conftest.py": EVIL_PLUGIN}, append=True),
        ],
        "unresolved",
        ("conftest.py", "tests/conftest.py"),
    ),
    "pytest-ini-plugin": (
        lambda name, task: [write({**PLUGIN, "pytest.ini": "[pytest]\naddopts = -p evil_plugin\n"})],
        "unresolved",
        ("pytest.ini",),
    ),
    "setup-cfg-plugin": (
        lambda name, task: [
            write(PLUGIN),
            write({"setup.cfg": "\n[tool:pytest]\naddopts = -p evil_plugin\n"}, append=True),
        ],
        "unresolved",
        ("setup.cfg",),
    ),
    "pyproject-plugin": (lambda name, task: [write(PLUGIN), pyproject_plugin()], "unresolved", ("pyproject.toml",)),
    "dist-info-entry-point": (
        lambda name, task: [
            write(
                {
                    **PLUGIN,
                    "evil_plugin-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil-plugin\nVersion: 1.0\n",
                    "evil_plugin-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil_plugin\n",
                }
            )
        ],
        "unresolved",
        ("evil_plugin-1.0.dist-info/entry_points.txt",),
    ),
    "sitecustomize-and-pth": (
        lambda name, task: [
            write(
                {
                    **PLUGIN,
                    "sitecustomize.py": LOAD_PLUGIN_BY_ENV,
                    "evil.pth": LOAD_PLUGIN_BY_ENV.replace("\n", "; ").rstrip("; ") + "\n",
                    **({f"{task['pythonpath']}/sitecustomize.py": LOAD_PLUGIN_BY_ENV} if task["pythonpath"] else {}),
                }
            )
        ],
        "unresolved",
        ("sitecustomize.py", "evil.pth"),
    ),
    "forged-pass-lines": (lambda name, task: [in_code(name, forged_lines(task))], "unresolved", ()),
    "forged-lines-then-exit": (
        lambda name, task: [in_code(name, forged_lines(task) + "import os as _o\n_o._exit(0)\n")],
        "no_verdict",
        (),
    ),
    "delete-the-tests": (
        lambda name, task: [
            "cd /testbed && git rm -q -- " + " ".join(sorted({t.split("::")[0] for t in selected(task)}))
        ],
        "unresolved",
        (),
    ),
    "exit-at-import": (lambda name, task: [in_code(name, "import os as _o\n_o._exit(0)\n")], "no_verdict", ()),
    "kill-the-runner": (
        lambda name, task: [in_code(name, "import os as _o, signal as _s\n_o.kill(_o.getpid(), _s.SIGKILL)\n")],
        "no_verdict",
        (),
    ),
    "kill-the-harness": (
        lambda name, task: [in_code(name, "import os as _o, signal as _s\n_o.kill(_o.getppid(), _s.SIGKILL)\n")],
        "no_verdict",
        (),
    ),
    "kill-every-process": (lambda name, task: [in_code(name, KILL_EVERYTHING)], "no_verdict", ()),
    "fake-report-files": (lambda name, task: [in_code(name, fake_reports(task))], "unresolved", ()),
    "patch-pytest-in-process": (lambda name, task: [in_code(name, PATCH_PYTEST)], "tampered", ()),
    "forge-report-frames": (lambda name, task: [in_code(name, forged_frames(task))], "tampered", ()),
    "forge-whole-run-then-exit": (
        lambda name, task: [in_code(name, forged_frames(task, whole_run=True))],
        "no_verdict",
        (),
    ),
}


def gold(task: dict[str, Any]) -> list[str]:
    return [
        tool_call_text(
            "str_replace_editor", {"command": "create", "path": "/tmp/fix.patch", "file_text": task["patch"]}
        ),
        bash_call("cd /testbed && git apply /tmp/fix.patch"),
    ]


def request(task: dict[str, Any], attack: str) -> v1.RolloutRequest:
    message = v1.RolloutRequest(handler="swe")
    shown = {key: value for key, value in task.items() if key != "patch"}
    message.instance.update({**shown, "problem_statement": marked(task["problem_statement"], attack)})
    return message


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def results(podman_url: str) -> AsyncIterator[dict[str, v1.RolloutResult]]:
    requests: dict[str, v1.RolloutRequest] = {}
    scripts: dict[str, Calls] = {}
    for name, task in TASKS.items():
        plays: dict[str, list[str]] = {
            attack: [bash_call(command) for command in make(name, task)] for attack, (make, _, _) in ATTACKS.items()
        }
        plays["gold"] = gold(task)
        plays["gold-with-conftest"] = [*gold(task), bash_call(write({"conftest.py": EVIL_PLUGIN}))]
        for attack, calls in plays.items():
            job_id = f"{attack}.{name}"
            requests[job_id] = request(task, job_id)
            scripts[job_id] = [*calls, finish_call()]
    async with live_server(podman_url) as run_all:
        yield await run_all(requests, scripts)


def details_of(result: v1.RolloutResult) -> dict[str, Any]:
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure  # never a failure a trainer would mask
    return MessageToDict(result.details)


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_scores_zero(attack: str, name: str, results: dict[str, v1.RolloutResult]) -> None:
    _, verdict, reverted = ATTACKS[attack]
    result = results[f"{attack}.{name}"]
    details = details_of(result)
    assert result.reward == 0.0, details
    assert details["verdict"] == verdict, {key: details[key] for key in details if key != "patch"}
    assert details["patch"], "the attack is in the submitted diff"
    listed = set(details["reverted"].get("restored", [])) | set(details["reverted"].get("deleted", []))
    assert set(reverted) <= listed, details["reverted"]
    if verdict in ("no_verdict", "tampered"):
        assert details["reason"], details


@pytest.mark.parametrize("name", sorted(TASKS))
def test_gold_patch_still_resolves_even_beside_a_conftest(name: str, results: dict[str, v1.RolloutResult]) -> None:
    for attack in ("gold", "gold-with-conftest"):
        result = results[f"{attack}.{name}"]
        details = details_of(result)
        assert result.reward == 1.0 and details["verdict"] == "resolved", details
    assert "conftest.py" in details["reverted"]["deleted"]
