from __future__ import annotations

import pytest

from prorl_server.agents.code import CodeHandler
from prorl_server.agents.stem import StemHandler
from prorl_server.errors import InvalidArgument
from prorl_server.verifiers.stem import choice_letter, verify_stem

CHOICES = ["Mercury", "Venus", "Earth", "Mars"]


@pytest.mark.parametrize("answer", ["C", "(c)", "C. Earth", "The answer is C", "earth", "Earth."])
def test_multiple_choice_answers_are_normalised(answer: str) -> None:
    assert verify_stem("C", answer, CHOICES)[0]
    assert verify_stem("Earth", answer, CHOICES)[0]


@pytest.mark.parametrize("answer", ["B", "Venus", "E", "", "I think so"])
def test_wrong_or_unreadable_choices_score_0(answer: str) -> None:
    assert not verify_stem("C", answer, CHOICES)[0]


def test_choice_letter_ignores_letters_beyond_the_choices() -> None:
    assert choice_letter("Z", CHOICES) is None


@pytest.mark.parametrize(
    ("gold", "answer", "correct"),
    [
        ("9.81", "9.810", True),
        ("6.02e23", "602000000000000000000000", True),
        ("1,000", "1000", True),
        ("photosynthesis", "Photosynthesis.", True),
        ("the mitochondria", "Mitochondria", True),
        ("3.0", "3.1", False),
        ("oxygen", "nitrogen", False),
        # Relative, never absolute: 0 is not Planck's constant (tests/adversarial has the rest).
        ("6.626e-34", "0", False),
        ("6.626e-34", "6.63e-34 J s", True),
        ("9.109e-31", "9.109e-28", False),
    ],
)
def test_short_answers(gold: str, answer: str, correct: bool) -> None:
    assert verify_stem(gold, answer)[0] is correct


@pytest.mark.parametrize(
    ("instance", "message"),
    [
        ({"prompt": "def f(): pass", "entry_point": "f"}, "'test'"),
        ({"prompt": "x", "entry_point": "not an id", "test": "t"}, "identifier"),
        ({"problem": "sum two numbers"}, "'tests'"),
        ({"problem": "p", "tests": [{"input": "1"}]}, "'tests'"),
        ({"problem": "p", "tests": [{"input": "1", "output": "1"}], "eval_timeout_s": 0}, "eval_timeout_s"),
        ({}, "problem"),
    ],
)
def test_code_instances_are_validated(instance: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        CodeHandler().validate(instance)


def test_stem_instances_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="choices"):
        StemHandler().validate({"question": "q", "answer": "A", "choices": ["only one"]})
    StemHandler().validate({"question": "q", "answer": "A", "choices": CHOICES})
