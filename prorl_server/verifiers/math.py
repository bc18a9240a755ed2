"""Math answers checked with math-verify (symbolic equivalence, not string match)."""

from __future__ import annotations

import asyncio
from typing import Any

import math_verify

# math-verify's own timeouts use SIGALRM, which works only on the main thread;
# here it runs in a worker thread, bounded from outside instead.
VERIFY_TIMEOUT_S = 20.0


def _wrap(text: str) -> str:
    """Give a bare answer the delimiters math-verify's LaTeX extractor anchors on."""
    stripped = text.strip()
    if "\\boxed" in stripped or stripped.startswith("$"):
        return stripped
    return f"${stripped}$"


def _verify(gold: str, answer: str) -> tuple[bool, dict[str, Any]]:
    gold_parsed = math_verify.parse(_wrap(gold), parsing_timeout=None)
    answer_parsed = math_verify.parse(_wrap(answer), parsing_timeout=None)
    correct = bool(
        gold_parsed and answer_parsed and math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None)
    )
    return correct, {
        "gold_parsed": [str(item) for item in gold_parsed],
        "answer_parsed": [str(item) for item in answer_parsed],
    }


async def verify_math_answer(gold: str, answer: str) -> tuple[bool, dict[str, Any]]:
    """True when `answer` is mathematically equal to `gold`; details say what was parsed."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(_verify, gold, answer), VERIFY_TIMEOUT_S)
    except TimeoutError:
        return False, {"error": f"verification took longer than {VERIFY_TIMEOUT_S:g}s"}
