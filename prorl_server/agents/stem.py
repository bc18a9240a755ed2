"""STEM: multiple-choice and short-answer questions, reward 1 or 0.

Instance fields: `question`; `answer` (the ground truth: a letter or the
choice's text for multiple choice); optional `choices` (a list of strings,
shown to the model lettered A, B, C, ...).
"""

from __future__ import annotations

from typing import Any

from prorl_server.agents.base import EvalOutcome, RolloutContext
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import FinishTool, PythonTool
from prorl_server.errors import InvalidArgument
from prorl_server.verifiers.stem import verify_stem

SYSTEM_PROMPT = """You answer science, technology, engineering and math questions.
You may run Python to calculate.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "python", "arguments": {{"code": "print(2 * 3.5)"}}}}</tool_call>
When you know the answer, call finish with it (for multiple choice, the letter):
<tool_call>{{"name": "finish", "arguments": {{"answer": "B"}}}}</tool_call>"""


class StemHandler(ToolLoopHandler):
    name = "stem"
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), FinishTool())

    def validate(self, instance: dict[str, Any]) -> None:
        if not isinstance(instance.get("question"), str) or not instance["question"].strip():
            raise InvalidArgument("stem instance needs a non-empty string field 'question'")
        answer = instance.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise InvalidArgument("stem instance needs a field 'answer' (the ground truth)")
        choices = instance.get("choices")
        if choices is not None and (
            not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices)
        ):
            raise InvalidArgument("stem instance field 'choices' must be a list of at least 2 strings")

    def user_prompt(self, instance: dict[str, Any]) -> str:
        choices = instance.get("choices")
        if not choices:
            return str(instance["question"])
        lettered = "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(choices))
        return f"{instance['question']}\n\n{lettered}"

    async def evaluate(self, ctx: RolloutContext) -> EvalOutcome:
        answer = ctx.state.get("answer")
        details: dict[str, Any] = {"answer": answer, "stop_reason": ctx.state.get("stop_reason")}
        if answer is None:
            return EvalOutcome(0.0, {**details, "verdict": "no answer submitted"})
        correct, parsed = verify_stem(str(ctx.instance["answer"]), str(answer), ctx.instance.get("choices"))
        return EvalOutcome(1.0 if correct else 0.0, {**details, **parsed, "verdict": "correct" if correct else "wrong"})
