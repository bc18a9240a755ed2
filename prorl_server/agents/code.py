"""Code: write a function (HumanEval style) or a stdin/stdout program; tests decide.

Function instances use HumanEval's fields: `prompt` (signature and
docstring), `entry_point`, `test` (defines check(candidate)). Program
instances have `problem` and `tests`, a list of {"input", "output"} pairs.
Optional `eval_timeout_s` (default 30). The agent submits its code with
finish; the tests run in a fresh sandbox, never the one the agent used, and
the verdict comes from the judging harness (see verifiers/code.py): `pass`,
`fail`, or `no_verdict` when the submission stopped the judging (all but
`pass` score 0).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictStr, field_validator

from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.fields import Seconds, Text
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import BashTool, FinishTool, PythonTool
from prorl_server.verifiers.code import run_function_tests, run_stdio_tests

SYSTEM_PROMPT = """You write correct Python 3 code. You may run code in a sandbox to test it.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "python", "arguments": {{"code": "print(1 + 1)"}}}}</tool_call>
When your code is ready, submit all of it with finish:
<tool_call>{{"name": "finish", "arguments": {{"answer": "def f(x):\\n    return x"}}}}</tool_call>"""

FUNCTION_TASK = "Complete this Python function. Submit the whole function.\n\n{prompt}"
PROGRAM_TASK = "Write a Python 3 program that reads standard input and writes standard output.\n\n{problem}"
DEFAULT_EVAL_TIMEOUT_S = 30.0


MAX_EVAL_TIMEOUT_S = 600.0


class FunctionTask(TaskInstance):
    """HumanEval style: complete a function; check(candidate) decides."""

    prompt: Text
    entry_point: Text
    test: Text
    eval_timeout_s: Seconds = Field(DEFAULT_EVAL_TIMEOUT_S, gt=0, le=MAX_EVAL_TIMEOUT_S)

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError("must be a Python identifier")
        return value


class StdioCase(TaskInstance):
    input: StrictStr
    output: StrictStr


class ProgramTask(TaskInstance):
    """A stdin/stdout program, judged on each {input, output} pair."""

    problem: Text
    tests: list[StdioCase] = Field(min_length=1)
    eval_timeout_s: Seconds = Field(DEFAULT_EVAL_TIMEOUT_S, gt=0, le=MAX_EVAL_TIMEOUT_S)


CodeTask = FunctionTask | ProgramTask


class CodeHandler(ToolLoopHandler[CodeTask, RunOutcome]):
    name = "code"
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), BashTool(), FinishTool())

    def parse(self, instance: dict[str, Any]) -> CodeTask:
        """A function task when the instance names an `entry_point`, else a program."""
        model = FunctionTask if "entry_point" in instance else ProgramTask
        return model.model_validate(instance)

    def user_prompt(self, instance: CodeTask) -> str:
        if isinstance(instance, FunctionTask):
            return FUNCTION_TASK.format(prompt=instance.prompt)
        return PROGRAM_TASK.format(problem=instance.problem)

    async def evaluate(self, ctx: RolloutContext[CodeTask], outcome: RunOutcome) -> EvalOutcome:
        instance = ctx.instance
        details: dict[str, Any] = {"stop_reason": outcome.stop_reason}
        if not outcome.answer:
            return EvalOutcome(0.0, {**details, "verdict": "no code submitted"})
        sandbox = await ctx.open_sandbox()  # fresh: nothing the agent left behind can affect the tests
        timeout = float(instance.eval_timeout_s)
        if isinstance(instance, FunctionTask):
            passed, result = await run_function_tests(
                sandbox,
                prompt=instance.prompt,
                answer=outcome.answer,
                test=instance.test,
                entry_point=instance.entry_point,
                timeout_s=timeout,
            )
        else:
            cases = [case.model_dump() for case in instance.tests]
            passed, result = await run_stdio_tests(sandbox, outcome.answer, cases, timeout)
        return EvalOutcome(1.0 if passed else 0.0, {**details, **result})
