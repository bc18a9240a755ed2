"""Request bodies as pydantic models, one module per API; this module turns a failed validation into
the gateway's one 400.

The models accept and keep fields they do not name (real clients send many: docs/llm.md), count a
null as absent (every optional field defaults to None), and use strict types (no "1" for 1, no true
for 1). A failure is answered with the first error pydantic reports, in the gateway's own words
(the ones clients and tests have seen since before the models), naming the field by its path from
pydantic's `loc` (`messages[2].content`, `tools[0].function.name`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, PlainValidator, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from prorl_server.gateway.common import GatewayError, bad_request, kind_of

Model = TypeVar("Model", bound=BaseModel)


class Body(BaseModel):
    """A JSON object of a request: unknown fields kept, nothing coerced."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


def invalid(message: str) -> PydanticCustomError:
    """An error in the gateway's words, raised from a validator: `{path}` in the message becomes the
    field's path."""
    return PydanticCustomError("gateway", message)


def between(minimum: float, maximum: float) -> BeforeValidator:
    """With `StrictFloat`: a number (an integer counts, a boolean does not) within [minimum, maximum].
    Checked before the type's conversion, so the error shows the number as it was sent."""

    def check(value: Any) -> Any:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and not minimum <= value <= maximum:
            raise invalid(f"{{path}} must be between {minimum} and {maximum}, not {value}")
        return value

    return BeforeValidator(check)


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise invalid("{path} must be a string or an array of strings, not " + kind_of(value))


Strings = Annotated[tuple[str, ...], PlainValidator(_strings)]
"""A string or an array of strings (stop sequences), as a tuple."""


def _present(value: Any) -> Any:
    if value is None:
        raise invalid("{path}: this field is required")
    return value


Present = Annotated[Any, AfterValidator(_present)]
"""Any value but null (a field that must be there, read by a hand-written reader after the model)."""


def _object(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("{path} must be an object")
    return value


ObjectOrEmpty = Annotated[dict[str, Any], PlainValidator(_object)]
"""A JSON object, {} when absent (a tool call's arguments)."""


def path_of(loc: Sequence[int | str], prefix: str = "") -> str:
    """`("messages", 2, "content")` -> `messages[2].content`."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else part
    return path


EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def message_of(error: ErrorDetails, prefix: str = "") -> GatewayError:
    """One pydantic error in the gateway's words."""
    path = path_of(error["loc"], prefix)
    kind = error["type"]
    ctx: Mapping[str, Any] = error.get("ctx") or {}
    if kind == "gateway":
        return bad_request(error["msg"].replace("{path}", path), path)
    if kind == "missing":
        return bad_request(f"{path}: this field is required", path)
    if kind in EXPECTED:
        return bad_request(f"{path} must be {EXPECTED[kind]}, not {kind_of(error['input'])}", path)
    if kind == "greater_than_equal":
        return bad_request(f"{path} must be at least {ctx['ge']}, not {error['input']}", path)
    return bad_request(f"{path}: {error['msg']}", path)


def validate(model: type[Model], data: Any, prefix: str = "") -> Model:
    """`data` as `model`, or the gateway's 400 for its first error (paths under `prefix`)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise message_of(exc.errors(include_url=False)[0], prefix) from None


__all__ = ["Body", "ObjectOrEmpty", "Present", "Strings", "between", "invalid", "message_of", "path_of", "validate"]
