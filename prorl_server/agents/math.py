"""Math: solve a problem with a Python tool, answer checked by math-verify.

Instance fields: `question` (text), `answer` (the ground truth, text or number).
"""

from __future__ import annotations

from typing import Any

from prorl_server.agents.base import EvalOutcome, RolloutContext
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import BashTool, FinishTool, PythonTool
from prorl_server.errors import InvalidArgument
from prorl_server.verifiers.math import verify_math_answer

SYSTEM_PROMPT = """You solve math problems. You may run code to check your work.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "python", "arguments": {{"code": "print(6 * 7)"}}}}</tool_call>
When you know the answer, call finish:
<tool_call>{{"name": "finish", "arguments": {{"answer": "42"}}}}</tool_call>"""


class MathHandler(ToolLoopHandler):
    name = "math"
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), BashTool(), FinishTool())

    def validate(self, instance: dict[str, Any]) -> None:
        question = instance.get("question")
        if not isinstance(question, str) or not question.strip():
            raise InvalidArgument("math instance needs a non-empty string field 'question'")
        answer = instance.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise InvalidArgument("math instance needs a field 'answer' (the ground truth, text or number)")

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return str(instance["question"])

    async def evaluate(self, ctx: RolloutContext) -> EvalOutcome:
        gold = _as_text(ctx.instance["answer"])
        answer = ctx.state.get("answer")
        details: dict[str, Any] = {"gold": gold, "answer": answer, "stop_reason": ctx.state.get("stop_reason")}
        if answer is None:
            details["verdict"] = "no answer submitted"
            return EvalOutcome(0.0, details)
        correct, parsed = await verify_math_answer(gold, str(answer))
        details.update(parsed, verdict="correct" if correct else "wrong")
        return EvalOutcome(1.0 if correct else 0.0, details)


def _as_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
