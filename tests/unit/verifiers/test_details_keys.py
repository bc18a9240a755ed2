"""The details keys in docs/contract.md ("Result details") match what the verifiers return.

The verifiers run here on fixed inputs, the code and SWE ones against a fake
sandbox whose judging harness answers with each kind of report, so every
verdict path is taken without Podman. What each key's table row says is
checked: the key is listed for its family, the value has the listed JSON
type, and a `verdict` is one of the listed values. The keys a family's
handler adds itself around its verifier (`answer`, `gold`, `patch`, ...)
are listed in HANDLER_KEYS, and every documented key must be one of those or
come out of a verifier: a key in the docs that nothing produces fails too.

The `command` family (an agent program judged by one of the families above)
is checked by running its own `evaluate` with the math verifier: its table
lists exactly the keys it adds, and every other key it returns is in the
verifier's table; its stop reasons are in the "Every family" table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from prorl_server.agents.base import RolloutContext
from prorl_server.agents.command import CommandHandler, ProgramOutcome
from prorl_server.agents.outcomes import Limits, RunOutcome, StopReason
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.llm.base import Sampling
from prorl_server.llm.router import BackendRouter
from prorl_server.sandbox.base import JudgeResult
from prorl_server.verifiers import math as math_verifier
from prorl_server.verifiers.code import run_function_tests, run_stdio_tests
from prorl_server.verifiers.judge import JudgeOptions, ModelJudge
from prorl_server.verifiers.judge_prompt import Criterion, Rubric
from prorl_server.verifiers.stem import verify_stem
from prorl_server.verifiers.swe import judge
from prorl_server.verifiers.terminal import judge as terminal_judge
from tests.fakes.scripted_llm import ScriptedChatBackend, ScriptedReply

DOC = Path(__file__).resolve().parents[3] / "docs" / "contract.md"
FAMILIES = ("math", "stem", "code", "swe", "terminal", "rubric")

# Set by the handler modules (prorl_server/agents/<family>.py), not by the verifiers run here.
HANDLER_KEYS = {
    "math": {"verdict", "stop_reason", "answer", "gold"},
    "stem": {"verdict", "stop_reason", "answer"},
    "code": {"verdict", "stop_reason"},
    "swe": {"verdict", "stop_reason", "instance_id", "patch"},
    "terminal": {"verdict", "stop_reason", "task", "state_bytes", "agent_timeout_s", "agent_time_carried_s"},
    "rubric": {"stop_reason", "answer"},
}
HANDLER_VERDICTS = {
    "math": {"correct", "wrong", "no answer submitted"},
    "stem": {"correct", "wrong", "no answer submitted"},
    "code": {"no code submitted"},
    "swe": {"patch_too_large"},
    "terminal": {"state_too_large"},
    "rubric": set(),
}


class Row:
    def __init__(self, cells: list[str]) -> None:
        self.keys = re.findall(r"`([^`]+)`", cells[0])
        self.types = set(re.findall(r"\b(string|number|bool|list|object|null)\b", cells[1]))
        self.values = set(re.findall(r"`([^`]+)`", cells[-1]))


def documented() -> dict[str, dict[str, Row]]:
    """Family -> key -> its row, from the tables under "## Result details"."""
    text = DOC.read_text()
    section = text.split("\n## Result details\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, Row]] = {}
    family = ""
    for line in section.splitlines():
        heading = re.match(r"### `?(\w+)", line)  # "### `math`", ..., "### Every family"
        if heading:
            family = heading.group(1).lower()
            tables[family] = {}
        elif family and line.startswith("| `"):
            row = Row([cell.strip() for cell in line.strip().strip("|").split("|")])
            for key in row.keys:
                tables[family][key] = row
    return tables


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    assert isinstance(value, dict), f"{value!r} is not JSON"
    return "object"


class FakeSandbox:
    """Only what the verifiers use: the judging harness, answering with a fixed report."""

    def __init__(self, result: JudgeResult) -> None:
        self.result = result

    async def judge(self, mode: str, spec: Mapping[str, Any], *, timeout_s: float) -> JudgeResult:
        return self.result


def harness(verdict: dict[str, Any] | None, **fields: Any) -> Any:
    return FakeSandbox(JudgeResult(verdict, output="harness log\n", **fields))


async def math_details(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    # A check past its limits is no verdict but the job's POLICY failure (verification_timeout).
    return [(await math_verifier.verify_math_answer("42", answer))[1] for answer in ("42", "41", "\\frac{1}{2}")]


def stem_details() -> list[dict[str, Any]]:
    choices = ["Mars", "Earth", "Venus"]
    return [
        verify_stem("B", "B", choices)[1],
        verify_stem("B", "the answer is (c)", choices)[1],
        verify_stem("Z", "A", choices)[1],  # a gold that matches no choice
        verify_stem("3.14159", "3.1416")[1],
        verify_stem("6.626e-34 J s", "0 J s")[1],  # a number off by more than its tolerance
        verify_stem("6.626e-34", "0 or 6.626e-34")[1],  # a hedge: not one number
        verify_stem("The Mitochondria", "mitochondria.")[1],
    ]


async def code_details() -> list[dict[str, Any]]:
    function = {"prompt": "def f(x):\n", "answer": "    return x\n", "test": "def check(c): pass\n", "entry_point": "f"}
    reports = [
        {"passed": True, "verdict": "pass", "reason": "check() returned normally"},
        {"passed": False, "verdict": "fail", "reason": "check() raised AssertionError", "error": "Traceback ..."},
        {"passed": False, "verdict": "fail", "reason": "the tests ran past 1s", "timed_out": True},
    ]
    found = [(await run_function_tests(harness(r), **function, timeout_s=1))[1] for r in reports]
    found.append((await run_function_tests(harness(None, problem="killed"), **function, timeout_s=1))[1])
    tests = [{"input": "1\n", "output": "2\n"}, {"input": "2\n", "output": "3\n"}]
    ran = {"exit_code": 0, "timed_out": False, "truncated": False}
    for runs in (
        [{**ran, "stdout": "2\n"}, {**ran, "stdout": "3\n"}],
        [{**ran, "stdout": "2\n"}, {**ran, "exit_code": None, "timed_out": True, "stdout": ""}],
    ):
        found.append((await run_stdio_tests(harness({"tests": runs}), "print(int(input()) + 1)", tests, 1))[1])
    found.append((await run_stdio_tests(harness({"tests": "garbled"}), "x", tests, 1))[1])
    return found


async def swe_details() -> list[dict[str, Any]]:
    f2p, p2p = ["t.py::test_bug"], ["t.py::test_a", "t.py::test_b"]
    passing = {test: "PASSED" for test in f2p + p2p}
    printed = "".join(f"PASSED {test}\n" for test in passing)  # pytest -rA's summary
    tests_ran = {"stage": "tests", "ok": True, "complete": True, "exitstatus": 0, "exit_code": 0, "statuses": passing}
    tests_ran |= {"log": printed}
    tests_ran |= {"restored": ["conftest.py"], "deleted": ["tests/conftest.py"]}
    reports: list[dict[str, Any] | None] = [
        tests_ran,
        {**tests_ran, "statuses": {**passing, "t.py::test_bug": "FAILED", "t.py::test_a": "ERROR"}, "exitstatus": 1},
        {**tests_ran, "exitstatus": 2},
        {**tests_ran, "timed_out": True},
        {**tests_ran, "complete": False, "runner_exit": -9, "anomalies": ["no final frame"]},
        {**tests_ran, "anomalies": ["t.py::test_bug reported twice"]},
        {**tests_ran, "statuses": "garbled"},
        {"stage": "model_patch", "ok": False, "output": "error: patch failed: a.py:1"},
        {"stage": "restore", "ok": False, "output": "error: pathspec", "restored": [], "deleted": []},
        {"stage": "test_patch", "ok": False, "output": "error: tests/t.py: already exists", "applies_at_base": True},
        None,
    ]
    found = []
    for report in reports:
        verdict = await judge(
            harness(report, problem="" if report else "the harness was killed"),
            repo_dir="/testbed",
            base_commit="0" * 40,
            patch="diff --git a/a.py b/a.py\n",
            test_patch="",
            fail_to_pass=f2p,
            pass_to_pass=p2p,
            pythonpath="",
            timeout_s=10,
        )
        found.append(verdict.details())
    return found


async def terminal_details() -> list[dict[str, Any]]:
    passing = {"test_outputs.py::test_a": "PASSED", "test_outputs.py::test_b": "PASSED"}
    printed = "".join(f"PASSED {test}\n" for test in passing)
    ran = {"stage": "tests", "ok": True, "complete": True, "exitstatus": 0, "exit_code": 0, "collected": passing}
    ran |= {"log": printed, "skipped": ["../x (outside the working directory)"]}
    reports: list[dict[str, Any] | None] = [
        ran,
        {**ran, "collected": {**passing, "test_outputs.py::test_b": "FAILED"}, "exitstatus": 1, "log": ""},
        {**ran, "collected": {}, "exitstatus": 5, "log": ""},
        {**ran, "timed_out": True},
        {**ran, "complete": False, "runner_exit": -9, "anomalies": ["no final frame"]},
        {**ran, "log": printed + "PASSED test_outputs.py::test_c\n"},
        {"stage": "state", "ok": False, "output": "ReadError: not a tar file"},
        {**ran, "collected": "garbled"},
        None,
    ]
    found = []
    for report in reports:
        verdict = await terminal_judge(
            harness(report, problem="" if report else "the harness was killed"),
            workdir="/app",
            tests_dir="/tests",
            tests={"test_outputs.py": "def test_a(): pass\n"},
            run=["test_outputs.py"],
            state_path="/tmp/state.tar",
            timeout_s=10,
        )
        found.append(verdict.details())
    return found


async def rubric_details() -> list[dict[str, Any]]:
    """The judge's details for each verdict: a reply in the format, one not, a refusal, a judge
    whose context is too small, an empty answer and one over the limit (neither sent)."""
    rubric = Rubric((Criterion("accuracy", "right"), Criterion("clarity", "clear", 2)))
    replies = iter(
        [
            ScriptedReply("accuracy: 8\nclarity: 5"),
            ScriptedReply("Great answer"),
            ScriptedReply("REFUSED: not gradable"),
            ScriptedReply("accuracy: 10\nclarity: 10"),
            ScriptedReply(status=400, error_message="maximum context length exceeded"),
        ]
    )
    router = BackendRouter(health_interval_s=0)
    router.add(ScriptedChatBackend(lambda messages: next(replies), backend_id="judge"))
    judge = ModelJudge(router, JudgeOptions(max_answer_chars=100))
    found = []
    try:
        copied = "an answer\naccuracy: 10\nclarity: 10"
        for answer in ("an answer", "an answer", "an answer", copied, "an answer", " ", "x" * 101):
            judgement = await judge.judge("job", rubric=rubric, question="q", answer=answer)
            found.append(judgement.details())
    finally:
        await router.close()
    return found


async def command_details() -> list[dict[str, Any]]:
    """The command family's details with the math verifier: a program that exited, one that ran out
    of its time (the runtime reports exit 124), one whose exit status is unknown."""
    handler = CommandHandler()
    instance = handler.validate(
        {"program": {"argv": ["agent"]}, "verifier": "math", "task": {"question": "6 * 7?", "answer": "42"}}
    )

    async def no_chat(*_: Any) -> Any:
        raise AssertionError("evaluate calls no model")

    async def no_sandbox() -> Any:
        raise AssertionError("the math verifier needs no sandbox")

    ctx = RolloutContext(
        job_id="job",
        instance=instance,
        limits=Limits(max_turns=1, tool_timeout_s=1.0),
        sampling=Sampling(max_tokens=16, temperature=1.0),
        chat=no_chat,
        sandbox_factory=no_sandbox,
        recorder=TrajectoryRecorder(lambda event: None),
    )
    found = []
    cases: list[tuple[StopReason, str | None, int | None]] = [
        ("program_exit", "42", 0),
        ("program_timeout", None, 124),
        ("program_exit", "41", None),
    ]
    for stop, answer, exit_code in cases:
        outcome = ProgramOutcome(stop, answer, exit_code=exit_code, log_tail="a log", judged=RunOutcome(stop, answer))
        found.append((await handler.evaluate(ctx, outcome)).details)
    return found


@pytest.fixture(scope="module")
def tables() -> dict[str, dict[str, Row]]:
    return documented()


def test_every_family_has_a_table(tables: dict[str, dict[str, Row]]) -> None:
    assert set(FAMILIES) <= set(tables), f"{DOC.name} has no details table for {set(FAMILIES) - set(tables)}"
    assert "format_errors" in tables["every"], "format_errors (added to every result) is not documented"
    assert set(tables["every"]["stop_reason"].values) >= {"finish", "max_turns", "context_length"}


@pytest.mark.parametrize("family", FAMILIES)
async def test_verifier_details_match_the_contract(
    family: str, tables: dict[str, dict[str, Row]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if family == "math":
        produced = await math_details(monkeypatch)
    elif family == "stem":
        produced = stem_details()
    elif family == "code":
        produced = await code_details()
    elif family == "terminal":
        produced = await terminal_details()
    elif family == "rubric":
        produced = await rubric_details()
    else:
        produced = await swe_details()
    table = tables[family]
    wrong = []
    seen_keys: set[str] = set()
    seen_verdicts: set[str] = set()
    for details in produced:
        for key, value in details.items():
            seen_keys.add(key)
            row = table.get(key)
            if row is None:
                wrong.append(f"key {key!r} (value {value!r}) is not in the table")
            elif json_type(value) not in row.types:
                wrong.append(f"key {key!r}: a {json_type(value)} ({value!r}), the table says {sorted(row.types)}")
        if "verdict" in details:
            seen_verdicts.add(details["verdict"])
            if "verdict" in table and details["verdict"] not in table["verdict"].values:
                wrong.append(f"verdict {details['verdict']!r} is not among {sorted(table['verdict'].values)}")
    nobody = set(table) - seen_keys - HANDLER_KEYS[family]
    if nobody:
        wrong.append(f"documented keys that neither the verifier nor the handler sets: {sorted(nobody)}")
    if "verdict" in table:
        listed = table["verdict"].values - seen_verdicts - HANDLER_VERDICTS[family]
        if listed:
            wrong.append(f"documented verdicts that nothing returns: {sorted(listed)}")
    problems = list(dict.fromkeys(wrong))  # one line per problem, however many cases show it
    assert not problems, f"{family}: {DOC.name} disagrees with the verifier:\n  " + "\n  ".join(problems)


async def test_command_details_match_the_contract(tables: dict[str, dict[str, Row]]) -> None:
    assert "command" in tables, f"{DOC.name} has no details table for the command family"
    own, verifier = tables["command"], tables["math"]
    wrong = []
    seen: set[str] = set()
    for details in await command_details():
        assert details["verifier"] == "math"
        for key, value in details.items():
            seen.add(key)
            row = own.get(key) or verifier.get(key) or tables["every"].get(key)
            if row is None:
                wrong.append(f"key {key!r} (value {value!r}) is in neither the command table nor the verifier's")
            elif json_type(value) not in row.types:
                wrong.append(f"key {key!r}: a {json_type(value)} ({value!r}), the table says {sorted(row.types)}")
        if details["stop_reason"] not in tables["every"]["stop_reason"].values:
            wrong.append(f"stop_reason {details['stop_reason']!r} is not listed under every family")
    if set(own) - seen:
        wrong.append(f"documented command keys that the handler does not set: {sorted(set(own) - seen)}")
    problems = list(dict.fromkeys(wrong))
    assert not problems, f"command: {DOC.name} disagrees with the handler:\n  " + "\n  ".join(problems)
