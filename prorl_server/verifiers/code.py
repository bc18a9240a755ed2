"""Code answers, judged by running tests in a sandbox: HumanEval-style functions
(the task's check() on the entry point) or programs against stdin/stdout pairs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prorl_server.sandbox.base import Sandbox

EVAL_DIR = "/tmp/prorl-eval"


def function_program(prompt: str, answer: str, test: str, entry_point: str) -> str:
    """The program HumanEval runs: the function (whole, or the prompt plus a body), its tests, check()."""
    code = answer if f"def {entry_point}" in answer else prompt + answer
    return f"{code}\n\n{test}\n\ncheck({entry_point})\n"


async def run_function_tests(sandbox: Sandbox, program: str, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    await sandbox.write_file(f"{EVAL_DIR}/program.py", program.encode())
    result = await sandbox.bash(f"cd {EVAL_DIR} && python3 program.py", timeout_s=timeout_s)
    passed = result.exit_code == 0 and not result.timed_out
    return passed, {"exit_code": result.exit_code, "timed_out": result.timed_out, "output": result.output[-2000:]}


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(expected)


async def run_stdio_tests(
    sandbox: Sandbox, program: str, tests: Sequence[dict[str, str]], timeout_s: float
) -> tuple[bool, dict[str, Any]]:
    await sandbox.write_file(f"{EVAL_DIR}/solution.py", program.encode())
    outcomes: list[dict[str, Any]] = []
    for index, case in enumerate(tests):
        await sandbox.write_file(f"{EVAL_DIR}/input-{index}.txt", str(case["input"]).encode())
        result = await sandbox.bash(f"cd {EVAL_DIR} && python3 solution.py < input-{index}.txt", timeout_s=timeout_s)
        ok = result.exit_code == 0 and not result.timed_out and _same_output(result.output, str(case["output"]))
        outcomes.append({"passed": ok, "exit_code": result.exit_code, "timed_out": result.timed_out})
        if not ok:
            outcomes[-1]["output"] = result.output[-500:]
    passed = all(outcome["passed"] for outcome in outcomes)
    return passed, {"tests": outcomes, "passed": sum(o["passed"] for o in outcomes), "total": len(outcomes)}
