"""Field types the families' instance models share, each with the message a user sees."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, PlainValidator, StrictFloat, StrictInt, StrictStr


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty string")
    return value


def _ground_truth(value: object) -> str | int | float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"must be the ground truth as text or a number, not {type(value).__name__}")
    if isinstance(value, str):
        _not_blank(value)
    return value


Text = Annotated[StrictStr, AfterValidator(_not_blank)]
"""A non-empty string."""
GroundTruth = Annotated[str | int | float, PlainValidator(_ground_truth)]
"""The ground truth: text or a number (never a boolean)."""


Seconds = StrictInt | StrictFloat


def _whole(value: int | float) -> int:
    """A count that arrived as a JSON number (3.0) is the integer it names."""
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("must be a whole number")
    return int(value)


Whole = Annotated[StrictInt | StrictFloat, AfterValidator(_whole)]
"""A whole number, as JSON (and a protobuf Struct, where every number is a float) carries it."""


def as_text(value: str | int | float) -> str:
    """A ground truth as text: 42.0 (how JSON numbers arrive) reads 42."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
