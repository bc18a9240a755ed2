"""Rubric: open-ended answers (explanations, derivations, reports) graded by a model judge.

Instance fields: `question`; a rubric of weighted `criteria` (each a `name`, a
`description` and a `weight`, default 1), a `reference` answer, or both; an optional
`max_answer_chars` (at most the server's `judge.max_answer_chars`). The agent may run
Python and submits its answer with finish; the server's judge (settings `judge.*`,
verifiers/judge.py) grades that answer, and only that: the reward is the weighted
criterion scores in [0, 1]. An unparseable or refused judgement, an empty answer or
one over the length limit is a verdict of its own with reward 0.

Other families use the same judge through `ctx.judge.score(...)` (docs/handlers.md,
"Model-judged rewards").
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictFloat, StrictInt, StrictStr, model_validator

from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.fields import Text
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.tools import FinishTool, PythonTool
from prorl_server.verifiers.judge_prompt import CRITERION_NAME, Criterion, Rubric

SYSTEM_PROMPT = """You answer open-ended questions. You may run Python to check your work.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "python", "arguments": {{"code": "print(2 ** 10)"}}}}</tool_call>
When your answer is ready, call finish with the whole answer:
<tool_call>{{"name": "finish", "arguments": {{"answer": "..."}}}}</tool_call>"""

MAX_CRITERIA = 20


class CriterionField(TaskInstance):
    name: Annotated[StrictStr, Field(pattern=CRITERION_NAME.pattern)]
    """What the judge writes on its line: [a-z][a-z0-9_]*, at most 40 characters."""
    description: Text
    weight: StrictInt | StrictFloat = Field(1.0, gt=0, le=1000)


class RubricFields(TaskInstance):
    """A rubric as a task gives it: `criteria`, `reference`, or both."""

    criteria: list[CriterionField] = Field(default_factory=list, max_length=MAX_CRITERIA)
    reference: Text | None = None

    @model_validator(mode="after")
    def _usable(self) -> RubricFields:
        self.rubric().check()
        return self

    def rubric(self) -> Rubric:
        criteria = tuple(Criterion(c.name, c.description, float(c.weight)) for c in self.criteria)
        return Rubric(criteria, self.reference)


class RubricInstance(RubricFields):
    question: Text
    max_answer_chars: StrictInt | None = Field(None, ge=1, le=1_000_000)
    """This task's answer limit; the server's `judge.max_answer_chars` when lower or unset."""


class RubricHandler(ToolLoopHandler[RubricInstance, RunOutcome]):
    name = "rubric"
    instance_model = RubricInstance
    system_prompt = SYSTEM_PROMPT
    tools = (PythonTool(), FinishTool())

    def user_prompt(self, instance: RubricInstance) -> str:
        return instance.question

    async def evaluate(self, ctx: RolloutContext[RubricInstance], outcome: RunOutcome) -> EvalOutcome:
        instance = ctx.instance
        judgement = await ctx.judge.score(
            rubric=instance.rubric(),
            question=instance.question,
            answer=outcome.answer,
            max_answer_chars=instance.max_answer_chars,
        )
        details: dict[str, Any] = {"answer": outcome.answer, "stop_reason": outcome.stop_reason}
        return EvalOutcome(judgement.reward, {**details, **judgement.details()})
