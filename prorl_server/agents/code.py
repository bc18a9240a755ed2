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

from prorl_server.agents.base import EvalOutcome, RolloutContext
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import BashTool, FinishTool, PythonTool
from prorl_server.errors import InvalidArgument
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


class CodeHandler(ToolLoopHandler):
    name = "code"
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), BashTool(), FinishTool())

    @staticmethod
    def style(instance: dict[str, Any]) -> str:
        return "function" if "entry_point" in instance else "program"

    def validate(self, instance: dict[str, Any]) -> None:
        if self.style(instance) == "function":
            for field in ("prompt", "entry_point", "test"):
                if not isinstance(instance.get(field), str) or not instance[field].strip():
                    raise InvalidArgument(f"code instance (function style) needs a non-empty string field {field!r}")
            if not instance["entry_point"].isidentifier():
                raise InvalidArgument("code instance field 'entry_point' must be a Python identifier")
        else:
            if not isinstance(instance.get("problem"), str) or not instance["problem"].strip():
                raise InvalidArgument(
                    "code instance needs 'problem' and 'tests' (program style) or 'prompt', 'entry_point' and "
                    "'test' (function style)"
                )
            tests = instance.get("tests")
            if (
                not isinstance(tests, list)
                or not tests
                or not all(
                    isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)
                    for t in tests
                )
            ):
                raise InvalidArgument("code instance field 'tests' must be a non-empty list of {input, output} strings")
        timeout = instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
            raise InvalidArgument("code instance field 'eval_timeout_s' must be a number in (0, 600]")

    def user_prompt(self, instance: dict[str, Any]) -> str:
        if self.style(instance) == "function":
            return FUNCTION_TASK.format(prompt=instance["prompt"])
        return PROGRAM_TASK.format(problem=instance["problem"])

    async def evaluate(self, ctx: RolloutContext) -> EvalOutcome:
        instance = ctx.instance
        answer = ctx.state.get("answer")
        details: dict[str, Any] = {"stop_reason": ctx.state.get("stop_reason")}
        if not answer:
            return EvalOutcome(0.0, {**details, "verdict": "no code submitted"})
        sandbox = await ctx.open_sandbox()  # fresh: nothing the agent left behind can affect the tests
        timeout = float(instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S))
        if self.style(instance) == "function":
            passed, result = await run_function_tests(
                sandbox,
                prompt=instance["prompt"],
                answer=str(answer),
                test=instance["test"],
                entry_point=instance["entry_point"],
                timeout_s=timeout,
            )
        else:
            passed, result = await run_stdio_tests(sandbox, str(answer), instance["tests"], timeout)
        return EvalOutcome(1.0 if passed else 0.0, {**details, **result})
