from __future__ import annotations

import pytest

from prorl_server.agents.math import MathHandler
from prorl_server.errors import InvalidArgument
from prorl_server.verifiers.math import verify_math_answer


@pytest.mark.parametrize(
    ("gold", "answer", "correct"),
    [
        ("42", "42", True),
        ("42", "41", False),
        ("1/2", "0.5", True),
        ("3/4", "\\frac{3}{4}", True),
        ("12", "twelve", False),
    ],
)
async def test_math_verify_checks_equivalence(gold: str, answer: str, correct: bool) -> None:
    assert (await verify_math_answer(gold, answer))[0] is correct


@pytest.mark.parametrize(
    ("instance", "message"),
    [
        ({"answer": "1"}, "'question'"),
        ({"question": "  ", "answer": "1"}, "'question'"),
        ({"question": "q"}, "'answer'"),
        ({"question": "q", "answer": True}, "'answer'"),
    ],
)
def test_math_instances_are_validated(instance: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        MathHandler().validate(instance)


def test_numeric_answers_are_accepted() -> None:
    MathHandler().validate({"question": "q", "answer": 42})
