"""STEM answers: multiple choice by letter (or choice text), numbers as scientists compare them,
other short answers normalised.

Numbers (`compare_quantities`): relatively, never absolutely, so that 0 is not "close" to
Planck's constant: |answer - gold| <= rel_tol * |gold|, widened to half a unit in the last
significant figure of the coarser of the two (6.63e-34 matches 6.626e-34; 9.8 matches 9.81)
as long as the answer keeps at least `sig_figs` figures (or as many as the gold has). Only a
gold of exactly 0 has an absolute floor, `abs_tol`. A number written without a decimal
point or exponent ("42", "1000") is exact as a gold. Units are read with pint: an answer in
other units of the same dimension is converted to the gold's ("6.626e-31 mJ s" for
"6.626e-34 J s"); incompatible units are wrong; an answer without a unit is taken to be in
the gold's, and where the gold has none the answer's is not converted.

A hedge scores 0: an answer must be one value. "A or B", "A, C", "6.6e-34 to 6.7e-34",
"between 1 and 2", "6.6e-34 ± 1e-35", two numbers: none of them reads as a single choice or
a single quantity, so none matches.

The check runs in a checker process (`checker_pool.py`): its regular expressions and unit
parsing see the policy's text, and there a slow one costs only its own job.
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from prorl_server.verifiers.checker_pool import shared_pool

MAX_NUMBER_CHARS = 200
"""A numeric answer longer than this is not one value."""
MAX_EXPONENT = 400

_ARTICLES = re.compile(r"^(?:the|a|an)\s+")


@dataclass(frozen=True)
class Tolerance:
    """How close a numeric answer must be; each field can be set per task (the instance's
    `rel_tol`, `abs_tol`, `sig_figs`)."""

    rel_tol: float = 1e-4
    abs_tol: float = 1e-9
    """Used only where the gold is exactly 0."""
    sig_figs: int = 3
    """The fewest significant figures an answer may round to (fewer, if the gold has fewer)."""

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> Tolerance:
        return cls(**{key: value for key, value in (values or {}).items() if value is not None})


def normalize(text: str) -> str:
    """Lower case, no surrounding punctuation, single spaces, no leading article."""
    text = " ".join(str(text).lower().split())
    text = text.strip(string.punctuation + " ")
    return _ARTICLES.sub("", text)


# --- multiple choice -------------------------------------------------------------

_CHOICE = re.compile(
    r"(?:(?:the\s+)?(?:final\s+|correct\s+)?answer\s*(?:is\s*:?|:|=)?\s*)?"
    r"(?:(?:option|choice)\s+)?"
    r"(?:\((?P<paren>[a-z])\)|\[(?P<bracket>[a-z])\]|(?P<bare>[a-z])(?![a-z]))"
    r"\s*(?:[.:)\-]\s*(?P<text>.*?))?\s*[.]?",
    re.IGNORECASE | re.DOTALL,
)


def choice_letter(answer: str, choices: Sequence[str]) -> str | None:
    """The one choice an answer picks: "B", "(b)", "B. <B's text>", "The answer is B", or a
    choice's text; None for anything else, hedges ("A or B", "B. or C") included."""
    stripped = str(answer).strip()
    if len(stripped) > 10 * (max((len(choice) for choice in choices), default=0) + 40):
        return None
    match = _CHOICE.fullmatch(stripped)
    if match:
        letter = (match.group("paren") or match.group("bracket") or match.group("bare")).upper()
        index = ord(letter) - ord("A")
        text = match.group("text")
        if index < len(choices) and (not text or normalize(text) == normalize(choices[index])):
            return letter
    wanted = normalize(stripped)
    for index, choice in enumerate(choices):
        if normalize(choice) == wanted:
            return chr(ord("A") + index)
    return None


# --- numbers and units -----------------------------------------------------------

_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2009": " ", "\u202f": " ", "\xa0": " "})
_LATEX_TEXT = re.compile(r"\\(?:mathrm|text|textrm|mathit|operatorname)\s*\{([^{}]*)\}")
_LATEX_SPACES = re.compile(r"\\[,;:! ]|\\quad|\$")
_PREFIX = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]{0,15}\s*=\s*)?(?:[≈~]\s*|(?:about|approximately|approx\.)\s+)?", re.I)
_NUMBER = re.compile(
    r"(?P<sign>[+-]?)\s*(?P<mantissa>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)"
    r"(?:\s*[eE]\s*(?P<e1>[+-]?\d+)"
    r"|\s*(?:[x\u00d7*\u00b7\u22c5]|\\times|\\cdot)\s*10\s*(?:\^|\*\*)\s*"
    r"(?:\{\s*(?P<e2>[+-]?\d+)\s*\}|\(\s*(?P<e3>[+-]?\d+)\s*\)|(?P<e4>[+-]?\d+))"
    r"|\s*(?:[x\u00d7*\u00b7\u22c5]|\\times|\\cdot)\s*10(?P<e5>[⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+))?"
)
_UNIT_EXPONENT = re.compile(
    r"(?:\^|\*\*)\s*(?:\{\s*[+-]?\d+\s*\}|\(\s*[+-]?\d+\s*\)|[+-]?\d+)|(?<=[A-Za-zµμΩÅ°])[+-]?\d"
)
_UNIT_CHARS = re.compile(r"[A-Za-zµμΩÅ°%·⋅*/^(){}\s+-]+")


@dataclass(frozen=True)
class Quantity:
    value: Decimal
    unit: str
    """As written ("" without one), checked to be a unit pint knows."""
    written_exact: bool
    """Written without a decimal point or exponent: an exact integer when it is the gold."""

    @property
    def sig_figs(self) -> int:
        digits = self.value.as_tuple().digits
        return 0 if not any(digits) else len(digits)

    @property
    def half_ulp(self) -> float:
        """Half a unit in the last written digit."""
        return 0.5 * 10.0 ** int(self.value.as_tuple().exponent)


def _clean(text: str) -> str:
    text = text.translate(_MINUS)
    text = _LATEX_TEXT.sub(r" \1 ", text)
    text = _LATEX_SPACES.sub(" ", text).replace("~", " ")
    return " ".join(text.split())


@functools.cache
def _units() -> Any:
    import pint

    return pint.UnitRegistry()


def _unit(text: str) -> Any | None:
    """pint's unit for `text`, or None when it is not a unit alone (a second number, a word)."""
    if not text:
        return _units().dimensionless
    if not _UNIT_CHARS.fullmatch(text) or re.search(r"\d", _UNIT_EXPONENT.sub("", text)):
        return None
    spelled = text.translate(_SUPERSCRIPTS).replace("{", "(").replace("}", ")").replace("⋅", "·")
    try:
        return _units().parse_units(spelled)
    except Exception:  # pint's errors for words, nonsense and scale factors have no common base
        return None


def parse_quantity(text: str) -> Quantity | None:
    """`text` as one number with an optional unit ("6.63e-34 J s", "6.626 \\times 10^{-34}",
    "c = 2.998 x 10⁸ m/s", with the multiplication sign too); None when it is anything else."""
    cleaned = _clean(str(text))
    if len(cleaned) > MAX_NUMBER_CHARS:
        return None
    prefix = _PREFIX.match(cleaned)
    rest = cleaned[prefix.end() if prefix else 0 :]
    number = _NUMBER.match(rest)
    if not number:
        return None
    exponent_text = next((number.group(g) for g in ("e1", "e2", "e3", "e4", "e5") if number.group(g)), None)
    exponent = int(exponent_text.translate(_SUPERSCRIPTS)) if exponent_text else 0
    if abs(exponent) > MAX_EXPONENT:
        return None
    mantissa = number.group("mantissa").replace(",", "")
    try:
        value = Decimal(f"{number.group('sign')}{mantissa}").scaleb(exponent)
    except InvalidOperation:
        return None
    unit_text = rest[number.end() :].strip().removesuffix(".").strip()
    if _unit(unit_text) is None:
        return None
    return Quantity(value, unit_text, written_exact="." not in mantissa and exponent_text is None)


def compare_quantities(gold: Quantity, answer: Quantity, tolerance: Tolerance) -> tuple[bool, dict[str, Any]]:
    """Whether `answer` is `gold` within `tolerance` (module docstring); details in the gold's unit."""
    gold_unit, answer_unit = _unit(gold.unit), _unit(answer.unit)
    value, half_ulp = float(answer.value), answer.half_ulp
    details: dict[str, Any] = {"expected": float(gold.value), "unit": str(gold_unit) if gold.unit else None}
    if gold.unit and answer.unit:
        try:
            converted = _units().Quantity(value, answer_unit).to(gold_unit).magnitude
            half_ulp = abs(_units().Quantity(value + half_ulp, answer_unit).to(gold_unit).magnitude - converted)
            value = float(converted)
        except Exception:  # pint's DimensionalityError, or an offset unit it cannot scale
            return False, {
                **details,
                "got": value,
                "reason": f"the answer's unit ({answer_unit}) does not convert to the gold's ({gold_unit})",
            }
    expected = float(gold.value)
    details["got"] = value
    if not (math.isfinite(value) and math.isfinite(expected)):
        return False, {**details, "reason": "not a finite number"}
    if expected == 0:
        allowed = tolerance.abs_tol
    else:
        allowed = tolerance.rel_tol * abs(expected)
        if answer.sig_figs > 0 and answer.sig_figs >= min(gold.sig_figs, tolerance.sig_figs):
            # the rounding of the coarser of the two (an exactly written gold has none)
            allowed = max(allowed, half_ulp, 0.0 if gold.written_exact else gold.half_ulp)
    details["tolerance"] = {**asdict(tolerance), "allowed": allowed}
    close = abs(value - expected) <= allowed * (1 + 1e-12)
    if not close:
        details["reason"] = f"off by {abs(value - expected):.4g}, more than the {allowed:.4g} allowed"
    return close, details


def verify_stem(
    gold: str,
    answer: str,
    choices: Sequence[str] | None = None,
    tolerance: Mapping[str, Any] | None = None,
) -> tuple[bool, dict[str, Any]]:
    """The verdict and its details. Runs in a checker process (it parses the policy's text)."""
    if choices:
        expected = choice_letter(gold, choices)
        picked = choice_letter(answer, choices)
        return expected is not None and picked == expected, {"expected": expected, "picked": picked}
    gold_quantity = parse_quantity(gold)
    if gold_quantity is not None:
        answer_quantity = parse_quantity(answer)
        if answer_quantity is None:
            return False, {
                "expected": float(gold_quantity.value),
                "got": normalize(answer)[:1000],
                "reason": "the answer is not one number (with at most a unit)",
            }
        return compare_quantities(gold_quantity, answer_quantity, Tolerance.of(tolerance))
    expected, got = normalize(gold), normalize(answer)
    return expected == got, {"expected": expected, "got": got[:1000]}


async def verify_stem_answer(
    gold: str,
    answer: str,
    choices: Sequence[str] | None = None,
    tolerance: Mapping[str, Any] | None = None,
) -> tuple[bool, dict[str, Any]]:
    """`verify_stem` in a checker process: never on the event loop, never past the pool's
    limits (then `VerificationFailed`, the job's own POLICY failure)."""
    args: dict[str, Any] = {"gold": gold, "answer": answer, "choices": list(choices) if choices else None}
    args["tolerance"] = dict(tolerance) if tolerance else None
    correct, details = await shared_pool().check("stem", args, what="the STEM answer")
    return bool(correct), dict(details)
