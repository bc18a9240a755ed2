"""STEM: multiple-choice and short-answer questions, reward 1 or 0.

Instance fields: `question`; `answer` (the ground truth: a letter or the
choice's text for multiple choice; a number, with or without a unit, for a
numeric answer); optional `choices` (a list of strings, shown to the model
lettered A, B, C, ...); optional `rel_tol`, `abs_tol` (used only where the
gold is 0) and `sig_figs`, the numeric tolerance (verifiers/stem.py), which
the result's details repeat.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictFloat, StrictInt, StrictStr

from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.fields import GroundTruth, Text, Whole, as_text
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import FinishTool, PythonTool
from prorl_server.verifiers.stem import verify_stem_answer

SYSTEM_PROMPT = """You answer science, technology, engineering and math questions.
You may run Python to calculate.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "python", "arguments": {{"code": "print(2 * 3.5)"}}}}</tool_call>
When you know the answer, call finish with it (for multiple choice, the letter):
<tool_call>{{"name": "finish", "arguments": {{"answer": "B"}}}}</tool_call>"""


class StemInstance(TaskInstance):
    question: Text
    answer: GroundTruth
    choices: list[StrictStr] | None = Field(None, min_length=2)
    """Multiple choice: shown lettered A, B, C, ... (at least 2)."""
    rel_tol: StrictInt | StrictFloat | None = Field(None, ge=0, le=1)
    """A numeric answer's relative tolerance; None: 1e-4."""
    abs_tol: StrictInt | StrictFloat | None = Field(None, ge=0)
    """The absolute tolerance where the gold is exactly 0 (and only there); None: 1e-9."""
    sig_figs: Whole | None = Field(None, ge=1, le=30)
    """The fewest significant figures an answer may round to; None: 3."""

    def tolerance(self) -> dict[str, Any]:
        return {"rel_tol": self.rel_tol, "abs_tol": self.abs_tol, "sig_figs": self.sig_figs}


class StemHandler(ToolLoopHandler[StemInstance, RunOutcome]):
    name = "stem"
    instance_model = StemInstance
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), FinishTool())

    def user_prompt(self, instance: StemInstance) -> str:
        if not instance.choices:
            return instance.question
        lettered = "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(instance.choices))
        return f"{instance.question}\n\n{lettered}"

    async def evaluate(self, ctx: RolloutContext[StemInstance], outcome: RunOutcome) -> EvalOutcome:
        answer = outcome.answer
        details: dict[str, Any] = {"answer": answer, "stop_reason": outcome.stop_reason}
        if answer is None:
            return EvalOutcome(0.0, {**details, "verdict": "no answer submitted"})
        instance = ctx.instance
        correct, parsed = await verify_stem_answer(
            as_text(instance.answer), answer, instance.choices, instance.tolerance()
        )
        return EvalOutcome(1.0 if correct else 0.0, {**details, **parsed, "verdict": "correct" if correct else "wrong"})
