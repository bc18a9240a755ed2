"""The checks a checker process runs, by name: only this module and what it imports run there.

Each check is a plain function of JSON-safe arguments returning a JSON-safe
`[correct, details]`. The server process never imports this module's heavy
dependencies (math-verify, sympy, pint): it sends the check's name and
arguments to a checker process (`checker_pool.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prorl_server.verifiers.math import verify_math
from prorl_server.verifiers.stem import verify_stem


def _math(gold: str, answer: str) -> list[Any]:
    return list(verify_math(gold, answer))


def _stem(
    gold: str, answer: str, choices: list[str] | None = None, tolerance: dict[str, Any] | None = None
) -> list[Any]:
    return list(verify_stem(gold, answer, choices, tolerance))


CHECKS: dict[str, Callable[..., Any]] = {"math": _math, "stem": _stem}


def warm_up() -> None:
    """Import and exercise every check once, so a job's time never pays for a cold start."""
    _math("\\frac{1}{2}", "0.5")
    _stem("6.626e-34 J s", "6.63e-34 J*s")
    _stem("B", "(b)", ["x", "y"])
