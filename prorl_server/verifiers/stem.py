"""STEM answers: multiple choice by letter (or choice text), short answers normalised."""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from typing import Any

_LETTER = re.compile(r"^\(?([A-Za-z])\)?(?:[.:)]|\s|$)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)?\s*\(?([A-Za-z])\)?(?:[.:)]|\s|$)", re.IGNORECASE)
_ARTICLES = re.compile(r"^(?:the|a|an)\s+")


def normalize(text: str) -> str:
    """Lower case, no surrounding punctuation, single spaces, no leading article."""
    text = " ".join(str(text).lower().split())
    text = text.strip(string.punctuation + " ")
    return _ARTICLES.sub("", text)


def _number(text: str) -> float | None:
    cleaned = normalize(text).replace(",", "")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def choice_letter(answer: str, choices: Sequence[str]) -> str | None:
    """The letter an answer picks: "B", "(b)", "B. text", "The answer is B", or a choice's text."""
    stripped = str(answer).strip()
    for pattern in (_LETTER, _ANSWER_IS):
        match = pattern.search(stripped) if pattern is _ANSWER_IS else pattern.match(stripped)
        if match and ord(match.group(1).upper()) - ord("A") < len(choices):
            return match.group(1).upper()
    wanted = normalize(stripped)
    for index, choice in enumerate(choices):
        if normalize(choice) == wanted:
            return chr(ord("A") + index)
    return None


def verify_stem(gold: str, answer: str, choices: Sequence[str] | None = None) -> tuple[bool, dict[str, Any]]:
    if choices:
        expected = choice_letter(gold, choices)
        picked = choice_letter(answer, choices)
        return expected is not None and picked == expected, {"expected": expected, "picked": picked}
    gold_number, answer_number = _number(gold), _number(answer)
    if gold_number is not None and answer_number is not None:
        close = math.isclose(gold_number, answer_number, rel_tol=1e-4, abs_tol=1e-9)
        return close, {"expected": gold_number, "got": answer_number}
    expected, got = normalize(gold), normalize(answer)
    return expected == got, {"expected": expected, "got": got}
