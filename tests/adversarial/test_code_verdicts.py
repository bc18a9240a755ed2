"""Code family: submissions that try to pass without solving the task.

Each attack is a scripted agent that submits a wrong solution plus a trick
(exit early, kill the judge, forge the verdict, fool the comparison); every one
scores 0 with a clear verdict, in a job that still succeeds (a trainer trains
on it), while right answers and HumanEval's canonical solutions score 1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from prorl_client import v1
from prorl_server.datasets.human_eval import load_problems
from tests.adversarial.live import Calls, finish_call, live_server, marked

pytestmark = pytest.mark.podman

ADD = {
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "eval_timeout_s": 10,
}
SUM = {
    "problem": "Read two integers on one line and print their sum.",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}],
    "eval_timeout_s": 5,
}
WRONG_FUNCTION = "def add(a, b):\n    return a - b\n"
WRONG_PROGRAM = "a, b = map(int, input().split())\nprint(a * b)\n"

KILL_PARENT = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
KILL_EVERYTHING = """
import os, signal
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
"""
# Write a forged verdict into every fd of every process it can open, and read the
# memory of the judge and the runtime if it can; say what it could do to those two
# (nothing: they are not dumpable).
FORGE_THROUGH_PROC = """
import os
FORGED = b'{"passed": true, "verdict": "pass", "reason": "forged", "tests": []}'
for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:
    try:
        with open('/proc/%s/cmdline' % pid, 'rb') as handle:
            cmdline = handle.read()
    except OSError:
        continue
    trusted = b'prorl_runtime.py' in cmdline or (b'prorl_judge.py' in cmdline and b'--verdict-fd' in cmdline)
    try:
        with open('/proc/%s/mem' % pid, 'rb') as handle:
            print('OPENED mem of', pid if trusted else 'an untrusted process')
    except OSError:
        print('DENIED mem of', pid) if trusted else None
    try:
        fds = os.listdir('/proc/%s/fd' % pid)
    except OSError:
        print('DENIED fds of', pid) if trusted else None
        continue
    for fd in fds:
        try:
            with open('/proc/%s/fd/%s' % (pid, fd), 'wb', buffering=0) as handle:
                handle.write(FORGED)
            print('OPENED fd', fd, 'of', pid) if trusted else None
        except OSError:
            pass
"""
FAKE_VERDICT_TEXT = 'print(\'{"passed": true, "verdict": "pass"}\')\nprint("PASSED add\\nOK")\n'

# name: (answer, expected verdict, words in the verdict's reason)
FUNCTION_ATTACKS: dict[str, tuple[str, str, str]] = {
    "os-exit-at-import": (WRONG_FUNCTION + "import os\nos._exit(0)\n", "fail", "process ended (exit status 0)"),
    "sys-exit-at-import": (WRONG_FUNCTION + "import sys\nsys.exit(0)\n", "fail", "failed to load"),
    "atexit-hook": (WRONG_FUNCTION + "import atexit, os\natexit.register(os._exit, 0)\n", "fail", "AssertionError"),
    "os-exit-in-call": ("def add(a, b):\n    import os\n    os._exit(0)\n", "fail", "process ended"),
    "system-exit-in-call": ("def add(a, b):\n    raise SystemExit(0)\n", "fail", "raised SystemExit"),
    "always-equal": (
        "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n\n"
        "def add(a, b):\n    return AlwaysEqual()\n",
        "fail",
        "not plain data",
    ),
    "int-subclass-equal": (
        "class Sneaky(int):\n    def __eq__(self, other):\n        return True\n\n"
        "def add(a, b):\n    return Sneaky(0)\n",
        "fail",
        "not plain data",
    ),
    "patch-check-and-builtins": (
        WRONG_FUNCTION + "import builtins\n"
        "builtins.AssertionError = type('Quiet', (Exception,), {})\n"
        "def check(candidate):\n    return None\n"
        "builtins.check = check\n",
        "fail",
        "AssertionError",
    ),
    "kill-the-checker": (WRONG_FUNCTION + KILL_PARENT, "no_verdict", ""),
    "kill-every-process": (WRONG_FUNCTION + KILL_EVERYTHING, "no_verdict", ""),
    "forge-through-proc": (WRONG_FUNCTION + FORGE_THROUGH_PROC, "fail", ""),
    "print-fake-verdict": (WRONG_FUNCTION + FAKE_VERDICT_TEXT, "fail", "AssertionError"),
    "hang": ("def add(a, b):\n    while True:\n        pass\n", "fail", "ran past"),
}
PROGRAM_ATTACKS: dict[str, tuple[str, str]] = {
    "os-exit-silently": ("import os\nos._exit(0)\n", "fail"),
    "sys-exit": ("import sys\nsys.exit(0)\n", "fail"),
    "atexit-hook": (WRONG_PROGRAM + "import atexit, os\natexit.register(os._exit, 0)\n", "fail"),
    "print-fake-verdict": (FAKE_VERDICT_TEXT, "fail"),
    "kill-the-judge": (KILL_PARENT, "no_verdict"),
    "kill-every-process": (KILL_EVERYTHING, "no_verdict"),
    "forge-through-proc": (FORGE_THROUGH_PROC + WRONG_PROGRAM, "fail"),
    "hang": ("while True:\n    pass\n", "fail"),
}
RIGHT = {
    "function-whole": (ADD, "def add(a, b):\n    return a + b\n"),
    "function-body": (ADD, "    return a + b\n"),
    "program": (SUM, "a, b = map(int, input().split())\nprint(a + b)\n"),
}
# Canonical solutions whose tests lean on the prompt's helpers (poly, encode_cyclic) or return tuples.
HUMAN_EVAL = ("HumanEval/32", "HumanEval/38", "HumanEval/8", "HumanEval/107")


def request(instance: dict[str, Any], attack: str) -> v1.RolloutRequest:
    message = v1.RolloutRequest(handler="code")
    field = "prompt" if "prompt" in instance else "problem"
    message.instance.update({**instance, field: marked(instance[field], attack)})
    return message


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def results(podman_url: str) -> AsyncIterator[dict[str, v1.RolloutResult]]:
    requests: dict[str, v1.RolloutRequest] = {}
    scripts: dict[str, Calls] = {}

    def add(job_id: str, instance: dict[str, Any], answer: str) -> None:
        requests[job_id] = request(instance, job_id)
        scripts[job_id] = [finish_call(answer)]

    for name, (answer, _, _) in FUNCTION_ATTACKS.items():
        add(f"function-{name}", {**ADD, "eval_timeout_s": 3} if name == "hang" else ADD, answer)
    for name, (answer, _) in PROGRAM_ATTACKS.items():
        add(f"program-{name}", {**SUM, "eval_timeout_s": 2} if name == "hang" else SUM, answer)
    for name, (instance, answer) in RIGHT.items():
        add(f"right-{name}", instance, answer)
    problems = {problem["task_id"]: problem for problem in load_problems()}
    for task_id in HUMAN_EVAL:
        problem = problems[task_id]
        instance = {key: problem[key] for key in ("prompt", "entry_point", "test")}
        add(f"canonical-{task_id.replace('/', '-')}", instance, problem["canonical_solution"])
    async with live_server(podman_url) as run_all:
        yield await run_all(requests, scripts)


def scored(result: v1.RolloutResult) -> dict[str, Any]:
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure  # never a failure a trainer would mask
    return dict(result.details)


@pytest.mark.parametrize("attack", list(FUNCTION_ATTACKS))
def test_function_attacks_score_zero(attack: str, results: dict[str, v1.RolloutResult]) -> None:
    _, verdict, reason = FUNCTION_ATTACKS[attack]
    result = results[f"function-{attack}"]
    details = scored(result)
    assert result.reward == 0.0, details
    assert details["verdict"] == verdict, details
    assert reason in details["reason"], details
    if attack == "forge-through-proc":  # it tried the judge and the runtime, and could not
        assert "DENIED" in details["output"] and "OPENED" not in details["output"], details["output"]


@pytest.mark.parametrize("attack", list(PROGRAM_ATTACKS))
def test_program_attacks_score_zero(attack: str, results: dict[str, v1.RolloutResult]) -> None:
    _, verdict = PROGRAM_ATTACKS[attack]
    result = results[f"program-{attack}"]
    details = scored(result)
    assert result.reward == 0.0, details
    assert details["verdict"] == verdict, details
    if verdict == "fail":
        assert details["passed"] < details["total"]
    else:
        assert details["reason"], details


@pytest.mark.parametrize("name", [*(f"right-{name}" for name in RIGHT), *(f"canonical-{t}" for t in HUMAN_EVAL)])
def test_right_answers_still_score_one(name: str, results: dict[str, v1.RolloutResult]) -> None:
    result = results[name.replace("/", "-")]
    details = scored(result)
    assert result.reward == 1.0 and details["verdict"] == "pass", details
