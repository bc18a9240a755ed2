"""Math: solve a problem with a Python tool, answer checked by math-verify.

Instance fields: `question` (text), `answer` (the ground truth, text or number).
"""

from __future__ import annotations

from typing import Any

from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.fields import GroundTruth, Text, as_text
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import BashTool, FinishTool, PythonTool
from prorl_server.verifiers.math import verify_math_answer

SYSTEM_PROMPT = """You solve math problems. You may run code to check your work.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "python", "arguments": {{"code": "print(6 * 7)"}}}}</tool_call>
When you know the answer, call finish:
<tool_call>{{"name": "finish", "arguments": {{"answer": "42"}}}}</tool_call>"""


class MathInstance(TaskInstance):
    question: Text
    answer: GroundTruth


class MathHandler(ToolLoopHandler[MathInstance, RunOutcome]):
    name = "math"
    instance_model = MathInstance
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), BashTool(), FinishTool())

    def user_prompt(self, instance: MathInstance) -> str:
        return instance.question

    async def evaluate(self, ctx: RolloutContext[MathInstance], outcome: RunOutcome) -> EvalOutcome:
        gold = as_text(ctx.instance.answer)
        answer = outcome.answer
        details: dict[str, Any] = {"gold": gold, "answer": answer, "stop_reason": outcome.stop_reason}
        if answer is None:
            details["verdict"] = "no answer submitted"
            return EvalOutcome(0.0, details)
        correct, parsed = await verify_math_answer(gold, answer)
        details.update(parsed, verdict="correct" if correct else "wrong")
        return EvalOutcome(1.0 if correct else 0.0, details)
