"""Task lines: the JSONL input of `prorl run`, read and checked before anything is submitted.

A line is a JSON object::

    {"id": "q1", "handler": "math", "instance": {"question": "...", "answer": "42"},
     "sampling": {"temperature": 1.0, "max_tokens": 512}, "limits": {"max_turns": 6},
     "sandbox": {...}, "labels": {"k": "v"}, "priority": 0, "retry": {...},
     "min_policy_version": 0}

Only "instance" is needed; "id" defaults to `line-N`, "handler" to the command's
--handler. A line without "instance" is the instance itself (its "id" and
"handler" and the request fields above aside), so {"id": "q1", "question": ...,
"answer": ...} works with --handler math. The request fields are those of
`prorl.v1.RolloutRequest`, in snake_case (camelCase is read too).

A bad line is a `LineError` naming the file, the line and the field as a path
in snake_case (`tasks.jsonl:3: limits.max_turn: unknown field; did you mean
'max_turns'?`): the run goes on with the other lines unless told to stop.
Whether an instance suits its family is for the server to say (INVALID_ARGUMENT
at submission, recorded by `prorl run` as a rejection).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import ParseDict, ParseError

from prorl_client import v1

# Task-line keys that are RolloutRequest fields taken from the line as they are.
REQUEST_FIELDS = ("sampling", "limits", "sandbox", "labels", "priority", "retry", "min_policy_version")
LINE_FIELDS = ("id", "handler", "instance", *REQUEST_FIELDS)
# Set by `prorl run` itself, never by a line.
RUNNER_FIELDS = ("job_id", "group_id")


@dataclass(frozen=True)
class LineError:
    """Why one line of a task file cannot be run."""

    path: Path
    line: int
    field: str
    """Where in the line, as a snake_case path ("limits.max_turns"); "" for the line as a whole."""
    message: str

    def __str__(self) -> str:
        where = f" {self.field}:" if self.field else ""
        return f"{self.path}:{self.line}:{where} {self.message}"


class BadLine(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(known))}"


def _check_fields(value: Any, descriptor: Any, path: str) -> None:
    """Unknown keys anywhere in a message's dict, named by their snake_case path."""
    if not isinstance(value, dict):
        return  # ParseDict says what is wrong with the value's type
    by_name: dict[str, FieldDescriptor] = {field.name: field for field in descriptor.fields}
    by_json = {field.json_name: field for field in descriptor.fields}
    for key, item in value.items():
        field = by_name.get(key) or by_json.get(key)
        where = f"{path}.{key}" if path else str(key)
        if field is None:
            raise BadLine(where, "unknown field" + _did_you_mean(str(key), list(by_name)))
        inner = field.message_type
        if (
            field.type != FieldDescriptor.TYPE_MESSAGE
            or inner is None
            or inner.full_name.startswith("google.protobuf.")
        ):
            continue
        if inner.GetOptions().map_entry:
            continue
        where = f"{path}.{field.name}" if path else field.name
        if field.is_repeated and isinstance(item, list):
            for index, element in enumerate(item):
                _check_fields(element, inner, f"{where}[{index}]")
        else:
            _check_fields(item, inner, where)


def check_request_fields(body: dict[str, Any]) -> None:
    """Raise BadLine for a request field that is unknown or of the wrong type."""
    _check_fields(body, v1.RolloutRequest.DESCRIPTOR, "")
    try:
        ParseDict(body, v1.RolloutRequest())
    except ParseError as exc:
        text = str(exc)
        # protobuf names the field by its message path: point at the line's key instead.
        field = next((key for key in body if key in text), "")
        raise BadLine(field, text) from None


def parse_line(text: str, number: int, default_handler: str) -> dict[str, Any]:
    """One task line as {"id", "handler", "instance", request fields...}; BadLine if it cannot run."""
    try:
        task = json.loads(text)
    except ValueError as exc:
        raise BadLine("", f"not JSON ({exc})") from None
    if not isinstance(task, dict):
        raise BadLine("", f"a task line is a JSON object, not {type(task).__name__}")
    for name in RUNNER_FIELDS:
        if name in task:
            raise BadLine(name, f"set by prorl run (from the output file, the task id and the sample); drop {name!r}")
    task.setdefault("id", f"line-{number}")
    task.setdefault("handler", default_handler)
    if not isinstance(task["id"], (str, int)) or isinstance(task["id"], bool) or str(task["id"]) == "":
        raise BadLine("id", "must be a non-empty string or an integer")
    if not isinstance(task["handler"], str) or not task["handler"]:
        raise BadLine("handler", "must be a non-empty string")
    if "instance" in task:
        unknown = [key for key in task if key not in LINE_FIELDS]
        if unknown:
            key = str(unknown[0])
            raise BadLine(key, "unknown field" + _did_you_mean(key, list(LINE_FIELDS)))
        if not isinstance(task["instance"], dict):
            raise BadLine("instance", "must be a JSON object")
    else:
        task = {
            "id": task.pop("id"),
            "handler": task.pop("handler"),
            "instance": {k: v for k, v in task.items() if k not in REQUEST_FIELDS},
            **{k: task[k] for k in REQUEST_FIELDS if k in task},
        }
    task["id"] = str(task["id"])
    check_request_fields({k: task[k] for k in ("handler", "instance", *REQUEST_FIELDS) if k in task})
    return task


def read_task_lines(
    path: Path, default_handler: str, *, text: str | None = None
) -> tuple[list[dict[str, Any]], list[LineError]]:
    """The file's runnable tasks, and an error per line that is not (blank lines are skipped).
    `text`: the lines themselves (standard input), `path` only naming them.

    Two lines with one id are an error on the second: results are keyed by task id.
    """
    tasks: list[dict[str, Any]] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    content = path.read_text() if text is None else text
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = parse_line(line, number, default_handler)
            if task["id"] in seen:
                raise BadLine("id", f"{task['id']!r} is also the id of line {seen[task['id']]}")
        except BadLine as exc:
            errors.append(LineError(path, number, exc.field, exc.message))
            continue
        seen[task["id"]] = number
        tasks.append(task)
    return tasks, errors
