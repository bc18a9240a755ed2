"""Code answers, judged in a fresh sandbox by the judging harness
(sandbox/runtime/prorl_judge.py): HumanEval-style functions (the task's check()
on the entry point) or programs against stdin/stdout pairs.

Function tests: the candidate runs in a process of its own; check() runs in
the harness against a proxy that passes plain data only. Pass means check()
returned normally in the harness: a submission that exits early, kills
processes, registers atexit hooks, returns objects whose __eq__ always says
True, or patches builtins or check() in its own process gets a fail (or no
verdict, which also scores 0). The program's exit code means nothing.

Programs: the harness runs the program once per input and sends back its own
stdout (a pipe of its own, nothing else written there), its exit status and
whether it ran out of time; the expected outputs never enter the sandbox and
are compared here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prorl_server.sandbox.base import Sandbox
from prorl_server.verifiers.harness import HARNESS_GRACE_S, LOG_TAIL_CHARS, no_verdict_details, run_harness

# A program may print this much beyond twice its expected output before it counts as wrong.
STDOUT_SLACK_BYTES = 4096


async def run_function_tests(
    sandbox: Sandbox, *, prompt: str, answer: str, test: str, entry_point: str, timeout_s: float
) -> tuple[bool, dict[str, Any]]:
    """Judge `answer` (a whole function, or a body completing `prompt`) with the task's check()."""
    spec = {"prompt": prompt, "answer": answer, "test": test, "entry_point": entry_point, "timeout_s": timeout_s}
    result = await run_harness(sandbox, "function", spec, timeout_s + HARNESS_GRACE_S)
    if result.verdict is None:
        return False, no_verdict_details(result)
    verdict = result.verdict
    passed = verdict.get("passed") is True and verdict.get("verdict") == "pass"
    error = str(verdict.get("error") or "")
    return passed, {
        "verdict": "pass" if passed else "fail",
        "reason": str(verdict.get("reason", "")),
        "timed_out": verdict.get("timed_out") is True,
        "output": (error + ("\n" if error else "") + result.output)[-LOG_TAIL_CHARS:],
    }


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(expected)


async def run_stdio_tests(
    sandbox: Sandbox, program: str, tests: Sequence[dict[str, str]], timeout_s: float
) -> tuple[bool, dict[str, Any]]:
    """Judge `program` on each {input, output} pair; `timeout_s` is per input."""
    spec = {
        "program": program,
        "inputs": [str(case["input"]) for case in tests],
        "timeout_s": timeout_s,
        "max_stdout_bytes": [2 * len(str(case["output"]).encode()) + STDOUT_SLACK_BYTES for case in tests],
    }
    result = await run_harness(sandbox, "stdio", spec, timeout_s * len(tests) + HARNESS_GRACE_S)
    runs = result.verdict.get("tests") if result.verdict is not None else None
    if not isinstance(runs, list) or len(runs) != len(tests) or not all(isinstance(run, dict) for run in runs):
        return False, no_verdict_details(result)
    outcomes: list[dict[str, Any]] = []
    for case, run in zip(tests, runs, strict=True):
        stdout = str(run.get("stdout", ""))
        ok = (
            run.get("exit_code") == 0
            and run.get("timed_out") is False
            and run.get("truncated") is False
            and _same_output(stdout, str(case["output"]))
        )
        outcomes.append({"passed": ok, "exit_code": run.get("exit_code"), "timed_out": run.get("timed_out") is True})
        if not ok:
            outcomes[-1]["output"] = stdout[-500:]
    passed = all(outcome["passed"] for outcome in outcomes)
    failed = sum(not o["passed"] for o in outcomes)
    return passed, {
        "verdict": "pass" if passed else "fail",
        "reason": "every run exited 0 with the expected output"
        if passed
        else f"{failed} of {len(outcomes)} runs did not exit 0 with the expected output in time",
        "tests": outcomes,
        "passed": sum(o["passed"] for o in outcomes),
        "total": len(outcomes),
        "log": result.output[-LOG_TAIL_CHARS:],
    }
