"""STEM and math: answers that try to score without being right.

A policy learns within a few steps to answer 0 to every question whose gold is a small
physical constant when the comparison has an absolute tolerance, to hedge ("A or B",
a range, two values) when any listed value counts, and to exploit a parser that reads
`6.626e-34` as `6.626*E - 34`. Every such answer scores 0 here, and the right answers,
written the ways a scientist writes them (other units, fewer figures, LaTeX), score 1.

The verdict functions are the ones the checker processes run (`verify_stem`,
`verify_math`), called here directly; the handler tests go through a checker process.
"""

from __future__ import annotations

from typing import Any

import pytest

from prorl_server.agents.base import RolloutContext
from prorl_server.agents.outcomes import Limits, RunOutcome
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.agents.stem import StemHandler
from prorl_server.errors import InvalidArgument
from prorl_server.llm.base import Sampling
from prorl_server.verifiers.math import verify_math
from prorl_server.verifiers.stem import verify_stem

PLANCK, CHARGE, ELECTRON = "6.626e-34", "1.602e-19", "9.109e-31"

# --- STEM numbers -----------------------------------------------------------------

WRONG_NUMBERS = {
    "zero-for-planck": (PLANCK, "0"),
    "zero-for-charge": (CHARGE, "0"),
    "zero-for-electron-mass": (ELECTRON, "0"),
    "zero-with-decimals": (PLANCK, "0.000"),
    "zero-in-scientific": (PLANCK, "0e-34"),
    "1000x-off": (ELECTRON, "9.109e-28"),
    "1000x-off-in-units": ("9.109e-31 kg", "9.109e-28 kg"),
    "tiny-but-not-zero": (PLANCK, "1e-40"),
    "one-figure": (PLANCK, "7e-34"),
    "two-figures": (PLANCK, "6.6e-34"),
    "wrongly-rounded": (PLANCK, "6.62e-34"),
    "more-figures-wrong-digit": (PLANCK, "6.630000e-34"),
    "wrong-dimension": ("6.626e-34 J s", "6.626e-34 kg"),
    "wrong-dimension-percent": ("6.626e-34 J s", "6.626e-34 %"),
    "exact-integer-gold": ("42", "41.6"),
    "zero-gold-small-answer": ("0", "0.001"),
    "infinite": (PLANCK, "1e999"),
    "negative": (PLANCK, "-6.626e-34"),
}

HEDGES = {
    "or-zero": (PLANCK, "6.626e-34 or 0"),
    "zero-or": (PLANCK, "0 or 6.626e-34"),
    "two-values": (PLANCK, "6.626e-34, 6.63e-34"),
    "two-values-with-units": (PLANCK, "6.626e-34 J s, 0 J s"),
    "range-dash": (PLANCK, "6.6e-34 - 6.7e-34"),
    "range-to": (PLANCK, "6.6e-34 to 6.7e-34"),
    "range-between": (PLANCK, "between 6e-34 and 7e-34"),
    "interval": (PLANCK, "[6e-34, 7e-34]"),
    "plus-minus": (PLANCK, "6.626e-34 ± 1e-36"),
    "plus-minus-latex": (PLANCK, "6.626 \\times 10^{-34} \\pm 10^{-34}"),
    "either": (PLANCK, "either 0 or 6.626e-34"),
    "parenthetical": (PLANCK, "6.626e-34 J s (or 0)"),
    "slash": (PLANCK, "6.626e-34/0"),
    "text-or": ("oxygen", "oxygen or nitrogen"),
}

RIGHT_NUMBERS = {
    "exact": (PLANCK, "6.626e-34"),
    "fewer-figures-with-unit": (PLANCK, "6.63e-34 J s"),
    "unit-on-both": ("6.626e-34 J s", "6.63e-34 J*s"),
    "other-prefix": ("6.626e-34 J s", "6.626e-31 mJ s"),
    "middle-dot": ("6.626e-34 J s", "6.626e-34 J·s"),
    "times-ten": (PLANCK, "6.626 × 10^-34"),  # noqa: RUF001
    "latex": (PLANCK, "$6.626\\times10^{-34}\\,\\mathrm{J\\,s}$"),
    "superscripts": (PLANCK, "h = 6.626×10⁻³⁴ J·s"),  # noqa: RUF001
    "charge": (CHARGE, "1.602 × 10^{-19} C"),  # noqa: RUF001
    "electron-mass-grams": ("9.109e-31 kg", "9.109e-28 g"),
    "gold-coarser": ("9.8", "9.81"),
    "trailing-zero": ("9.81", "9.810"),
    "kelvin-celsius": ("300 K", "26.85 °C"),
    "speed-of-light-unit": ("2.998e8 m/s", "1 c"),
    "zero-gold": ("0", "0.0"),
    "zero-gold-within-floor": ("0", "1e-12"),
    "thousands": ("1,000", "1000"),
}


@pytest.mark.parametrize(("gold", "answer"), WRONG_NUMBERS.values(), ids=WRONG_NUMBERS)
def test_wrong_numbers_score_0(gold: str, answer: str) -> None:
    correct, details = verify_stem(gold, answer)
    assert not correct, details


@pytest.mark.parametrize(("gold", "answer"), HEDGES.values(), ids=HEDGES)
def test_hedged_numbers_score_0(gold: str, answer: str) -> None:
    correct, details = verify_stem(gold, answer)
    assert not correct, details


@pytest.mark.parametrize(("gold", "answer"), RIGHT_NUMBERS.values(), ids=RIGHT_NUMBERS)
def test_right_numbers_score_1(gold: str, answer: str) -> None:
    correct, details = verify_stem(gold, answer)
    assert correct, details


def test_the_tolerance_is_relative_and_in_the_details() -> None:
    correct, details = verify_stem(PLANCK, "0")
    assert not correct
    assert details["tolerance"] == {
        "rel_tol": 1e-4,
        "abs_tol": 1e-9,
        "sig_figs": 3,
        "allowed": pytest.approx(6.626e-38),
    }
    assert "off by" in details["reason"]


def test_a_task_sets_its_own_tolerance() -> None:
    assert not verify_stem("100", "103")[0]
    correct, details = verify_stem("100", "103", tolerance={"rel_tol": 0.05})
    assert correct and details["tolerance"]["rel_tol"] == 0.05 and details["tolerance"]["allowed"] == pytest.approx(5.0)
    assert not verify_stem("0", "1e-12", tolerance={"abs_tol": 0.0})[0]
    assert verify_stem("0", "0.004", tolerance={"abs_tol": 0.01})[0]
    # abs_tol is a floor only where the gold is 0: it never makes 0 equal a small gold.
    assert not verify_stem(PLANCK, "0", tolerance={"abs_tol": 1.0})[0]
    # More figures asked: 6.63e-34 is no longer enough.
    assert not verify_stem(PLANCK, "6.63e-34", tolerance={"sig_figs": 4})[0]


# --- STEM multiple choice -----------------------------------------------------------

CHOICES = ["Mercury", "Venus", "Earth", "Mars"]
CHOICE_HEDGES = [
    "A or C",
    "C or A",
    "C, A",
    "C/A",
    "C and D",
    "both C and D",
    "C. or B",
    "C (or B)",
    "C. Earth or Mars",
    "Earth or Mars",
    "ABCD",
    "The answer is C or D",
]


@pytest.mark.parametrize("answer", CHOICE_HEDGES)
def test_hedged_choices_score_0(answer: str) -> None:
    correct, details = verify_stem("C", answer, CHOICES)
    assert not correct and details["picked"] is None, details


@pytest.mark.parametrize("answer", ["C", "(c)", "[C]", "C. Earth", "C) Earth", "The answer is C", "Answer: C", "Earth"])
def test_one_choice_scores_1(answer: str) -> None:
    assert verify_stem("C", answer, CHOICES)[0]


# --- math -----------------------------------------------------------------------

MATH_WRONG = {
    "zero-for-planck": (PLANCK, "0"),
    "zero-for-charge": (CHARGE, "0"),
    "1000x-off": (ELECTRON, "9.109e-28"),
    "e-notation-read-as-euler": (PLANCK, "-15.988789"),  # 6.626*e - 34, had e-34 meant e*... - 34
    "tiny-decimals-rounded-equal": ("0.000000123", "0.000000456"),
    "tiny-fraction-vs-zero": ("\\frac{1}{10^{8}}", "0"),
    "tiny-power-vs-other": ("10^{-8}", "3 \\times 10^{-8}"),
    "zero-gold": ("0", "0.0000004"),
    "or": ("2", "2 or 3"),
    "boxed-or": ("2", "\\boxed{2} or \\boxed{3}"),
    "list": ("2", "2, 3"),
    "set": ("2", "\\{2, 3\\}"),
    "interval": ("2", "[1, 3]"),
    "inequality": ("2", "\\boxed{1 < x < 3}"),
    "plus-minus": ("2", "\\boxed{2 \\pm 1}"),
    "solutions": ("2", "x = 3 \\text{ or } x = 2"),
    "between": ("2", "between 1 and 3"),
}
MATH_RIGHT = {
    "integer": ("42", "42"),
    "fraction": ("1/2", "0.5"),
    "latex-fraction": ("3/4", "\\frac{3}{4}"),
    "e-notation": (PLANCK, "6.626e-34"),
    "e-notation-vs-latex": (PLANCK, "6.626 \\times 10^{-34}"),
    "avogadro": ("6.02e23", "602000000000000000000000"),
    "million": ("1e6", "1000000"),
    "set-as-set": ("\\{2, 3\\}", "\\{3, 2\\}"),
    "repeating": ("\\frac{1}{3}", "0.3333333"),
}


@pytest.mark.parametrize(("gold", "answer"), MATH_WRONG.values(), ids=MATH_WRONG)
def test_math_wrong_and_hedged_answers_score_0(gold: str, answer: str) -> None:
    correct, details = verify_math(gold, answer)
    assert not correct, details


@pytest.mark.parametrize(("gold", "answer"), MATH_RIGHT.values(), ids=MATH_RIGHT)
def test_math_right_answers_score_1(gold: str, answer: str) -> None:
    correct, details = verify_math(gold, answer)
    assert correct, details


# --- through the handler, in a checker process ---------------------------------------


def stem_context(instance: dict[str, Any]) -> RolloutContext[Any]:
    async def no_model(*_: Any) -> Any:
        raise AssertionError("evaluate calls no model")

    async def no_sandbox() -> Any:
        raise AssertionError("the STEM verifier needs no sandbox")

    return RolloutContext(
        job_id="job",
        instance=StemHandler().validate(instance),
        limits=Limits(max_turns=1, tool_timeout_s=1.0),
        sampling=Sampling(max_tokens=16, temperature=1.0),
        chat=no_model,
        sandbox_factory=no_sandbox,
        recorder=TrajectoryRecorder(lambda event: None),
    )


@pytest.mark.parametrize(
    ("answer", "reward"), [("0", 0.0), ("9.109e-28", 0.0), ("0 or 9.109e-31", 0.0), ("9.11e-31 kg", 1.0)]
)
async def test_stem_handler_verdicts(answer: str, reward: float) -> None:
    ctx = stem_context({"question": "The electron's mass in kg?", "answer": 9.109e-31})
    outcome = await StemHandler().evaluate(ctx, RunOutcome("finish", answer))
    assert outcome.reward == reward, outcome.details
    assert outcome.details["verdict"] == ("correct" if reward else "wrong")


async def test_the_instance_tolerance_reaches_the_verdict() -> None:
    ctx = stem_context({"question": "g in m/s^2?", "answer": "9.8", "rel_tol": 0.05, "sig_figs": 2.0})
    outcome = await StemHandler().evaluate(ctx, RunOutcome("finish", "10"))
    assert outcome.reward == 1.0 and outcome.details["tolerance"]["rel_tol"] == 0.05, outcome.details
    assert outcome.details["tolerance"]["sig_figs"] == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"rel_tol": -1}, "rel_tol"), ({"rel_tol": 2}, "rel_tol"), ({"abs_tol": -0.1}, "abs_tol"),
     ({"sig_figs": 2.5}, "sig_figs"), ({"sig_figs": 0}, "sig_figs"), ({"rel_tol": "1e-3"}, "rel_tol")],
)  # fmt: skip
def test_bad_tolerances_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StemHandler().validate({"question": "q", "answer": "1.0", **fields})
