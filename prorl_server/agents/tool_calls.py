"""Reading tool calls from a model reply.

Two sources: the API's structured `tool_calls`, or `<tool_call>{json}</tool_call>`
blocks in the text (the convention of Hermes/Qwen-style chat templates, and
what small models write when the server has no tool parser). A malformed call
is kept with an `error` that tells the model what was wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from prorl_server.llm.base import ApiToolCall

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
FORMAT_HINT = 'Write each call as <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>.'


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str
    from_api: bool
    error: str | None = None


def _decode_arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(raw, dict):
        return raw, None
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f"the arguments are not valid JSON ({exc.msg} at position {exc.pos})"
        if isinstance(value, dict):
            return value, None
    return None, 'the arguments must be a JSON object, e.g. {"code": "print(1)"}'


def from_api(calls: tuple[ApiToolCall, ...]) -> list[ParsedCall]:
    parsed = []
    for call in calls:
        arguments, error = _decode_arguments(call.arguments_json)
        parsed.append(ParsedCall(call.id, call.name, arguments or {}, call.arguments_json, from_api=True, error=error))
    return parsed


def from_text(text: str, *, id_prefix: str = "call") -> list[ParsedCall]:
    parsed = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        call_id = f"{id_prefix}_{index}"
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            parsed.append(
                ParsedCall(call_id, "", {}, body, False, f"the tool call is not valid JSON ({exc.msg}). {FORMAT_HINT}")
            )
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            parsed.append(ParsedCall(call_id, "", {}, body, False, f'the tool call has no "name". {FORMAT_HINT}'))
            continue
        raw_arguments = value.get("arguments", value.get("parameters", {}))
        arguments, error = _decode_arguments(raw_arguments)
        arguments_json = raw_arguments if isinstance(raw_arguments, str) else json.dumps(raw_arguments)
        parsed.append(ParsedCall(call_id, value["name"], arguments or {}, arguments_json, False, error))
    return parsed
