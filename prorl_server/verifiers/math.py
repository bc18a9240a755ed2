"""Math answers checked with math-verify (symbolic equivalence, not string match).

The check (`verify_math`) runs in a checker process (`checker_pool.py`): math-verify's sympy
can be made to compute for minutes (`\\boxed{9^{9^{8}}}`), and there a hang costs only its
own job. The server process never imports math-verify.

Two things math-verify gets wrong on its own are fixed around it:
- it reads `6.626e-34` as `6.626*E - 34` (E being Euler's number): scientific notation is
  rewritten as `6.626\\times 10^{-34}` first;
- its numeric fallback rounds to 6 decimal places, an absolute tolerance: `1.23e-7` equals
  `4.56e-7`, and `10^{-8}` equals 0. An equivalence it finds between two numbers is kept
  only when they are also relatively close (`NUMERIC_REL_TOL`; where the gold is exactly 0,
  within `ZERO_ABS_TOL`).
Two plain numbers of the same value are equal even where math-verify misses it (a float
against an integer: `6.02e23` and `602000000000000000000000`). Hedges need nothing more:
math-verify reads "2 or 3", "2, 3", `\\{2, 3\\}`, `[1, 3]` or `2 \\pm 1` as a set or an
interval, which equals no single gold value.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from prorl_server.verifiers.checker_pool import shared_pool
from prorl_server.verifiers.stem import parse_quantity

NUMERIC_REL_TOL = 1e-5
"""math-verify's own rounding allows at most about 5e-6 relatively for values from 0.1 up."""
ZERO_ABS_TOL = 1e-9
MAX_ANSWER_CHARS = 20_000
"""Longer answers are not parsed (wrong): no answer to a math problem is that long."""

_E_NOTATION = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d{1,4})(?![\w.])")


def _scientific_as_latex(text: str) -> str:
    return _E_NOTATION.sub(lambda m: f"{m.group(1)}\\times 10^{{{m.group(2)}}}", text)


def _wrap(text: str) -> str:
    """Give a bare answer the delimiters math-verify's LaTeX extractor anchors on."""
    stripped = _scientific_as_latex(text.strip())
    if "\\boxed" in stripped or stripped.startswith("$"):
        return stripped
    return f"${stripped}$"


def _as_float(value: Any) -> float | None:
    """A parsed value as a float when it is a plain number (sympy), else None."""
    if not getattr(value, "is_number", False) or getattr(value, "is_real", None) is not True:
        return None
    try:
        number = float(value.evalf(30))
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _relatively_close(gold: list[Any], answer: list[Any]) -> bool:
    """False when both are numbers that are not close relatively (math-verify's rounding bug)."""
    gold_number = _as_float(gold[0]) if gold else None
    answer_number = _as_float(answer[0]) if answer else None
    if gold_number is None or answer_number is None:
        return True
    if gold_number == 0:
        return abs(answer_number) <= ZERO_ABS_TOL
    return math.isclose(gold_number, answer_number, rel_tol=NUMERIC_REL_TOL, abs_tol=0.0)


def _same_plain_number(gold: str, answer: str) -> bool:
    """Both written as plain numbers (decimal or scientific) of the same value: math-verify
    misses some (6.02e23 against 602000000000000000000000, a float against an integer)."""
    gold_number, answer_number = parse_quantity(gold), parse_quantity(answer)
    if gold_number is None or answer_number is None or gold_number.unit or answer_number.unit:
        return False
    if gold_number.value == 0:
        return abs(answer_number.value) <= Decimal(ZERO_ABS_TOL)
    return abs(answer_number.value - gold_number.value) <= abs(gold_number.value) * Decimal("1e-12")


def verify_math(gold: str, answer: str) -> tuple[bool, dict[str, Any]]:
    """True when `answer` is mathematically equal to `gold`; details say what was parsed.
    Runs in a checker process (it imports math-verify)."""
    import math_verify

    if len(answer) > MAX_ANSWER_CHARS:
        return False, {"gold_parsed": [], "answer_parsed": [f"[not parsed: {len(answer)} characters]"]}
    # math-verify's own timeouts use SIGALRM; the checker process is killed from outside instead.
    gold_parsed = math_verify.parse(_wrap(gold), parsing_timeout=None)
    answer_parsed = math_verify.parse(_wrap(answer), parsing_timeout=None)
    correct = bool(
        gold_parsed
        and answer_parsed
        and math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None)
        and _relatively_close(gold_parsed, answer_parsed)
    )
    if not correct:
        correct = _same_plain_number(gold, answer)
    return correct, {
        "gold_parsed": [str(item)[:1000] for item in gold_parsed],
        "answer_parsed": [str(item)[:1000] for item in answer_parsed],
    }


async def verify_math_answer(gold: str, answer: str) -> tuple[bool, dict[str, Any]]:
    """`verify_math` in a checker process: never on the event loop, never past the pool's
    limits (then `VerificationFailed`, the job's own POLICY failure)."""
    correct, details = await shared_pool().check("math", {"gold": gold, "answer": answer}, what="the math answer")
    return bool(correct), dict(details)
