"""The `Backend` message and the server's backend settings, both ways.

AddBackend's message becomes `BackendSettings`, the model the config file uses
too, so one set of checks applies to both; a check that fails becomes an
InvalidArgument naming the field (`backend.<field>: what to fix`). Proto
defaults keep their documented meaning: an unset weight is 1, an unset
tool_call_parser hermes, an unset logprobs_mode processed.
"""

from __future__ import annotations

from typing import Any, cast

from google.protobuf import json_format, struct_pb2
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from prorl_client import v1
from prorl_server.errors import InvalidArgument
from prorl_server.llm.backend_settings import BACKEND_KINDS, SERVED_KINDS, BackendSettings, LogprobsMode
from prorl_server.llm.router import BackendEntry

KIND_NAMES: dict[str, v1.BackendKind] = {
    kind: cast(v1.BackendKind, v1.BackendKind.Value(f"BACKEND_KIND_{kind.upper()}")) for kind in SERVED_KINDS
}
"""Each kind a pool's backend can report, as its BackendKind value (BACKEND_KIND_<KIND>)."""
ADDABLE_KINDS: dict[v1.BackendKind, str] = {KIND_NAMES[kind]: kind for kind in BACKEND_KINDS}
"""The BackendKind values AddBackend takes (not the embedded model's)."""
LOGPROBS_MODES: dict[str, v1.LogprobsMode] = {"processed": v1.LOGPROBS_MODE_PROCESSED, "raw": v1.LOGPROBS_MODE_RAW}


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(values)
    return message


def backend_to_proto(entry: BackendEntry) -> v1.Backend:
    """A pool entry as AdminService shows it (the API key is write-only: never returned)."""
    info = entry.backend.info
    return v1.Backend(
        id=info.id,
        kind=KIND_NAMES.get(info.kind, v1.BACKEND_KIND_UNSPECIFIED),
        base_url=info.base_url,
        model=info.model,
        max_in_flight=info.max_in_flight,
        tokenizer_path=str(info.extra.get("tokenizer_path", "")),
        weight=info.weight,
        tool_call_parser=info.tool_call_parser,
        chat_template_kwargs=_struct(info.chat_template_kwargs) if info.chat_template_kwargs else None,
        logprobs_mode=LOGPROBS_MODES.get(info.logprobs_mode, v1.LOGPROBS_MODE_UNSPECIFIED),
        state=v1.BackendState(
            healthy=entry.healthy,
            in_flight=entry.in_flight,
            requests_total=entry.requests_total,
            errors_total=entry.errors_total,
            managed=entry.managed,
        ),
    )


def settings_from_proto(backend: v1.Backend) -> BackendSettings:
    """AddBackend's message as settings; InvalidArgument naming every field that is wrong."""
    mode: LogprobsMode = "raw" if backend.logprobs_mode == v1.LOGPROBS_MODE_RAW else "processed"
    data: dict[str, Any] = {
        "id": backend.id,
        # A kind AddBackend does not take stays a BackendKind name, which fails validation.
        "kind": ADDABLE_KINDS.get(backend.kind, _kind_name(backend.kind)),
        "base_url": backend.base_url,
        "model": backend.model,
        "api_key": backend.api_key,
        "max_in_flight": backend.max_in_flight,
        "tokenizer_path": backend.tokenizer_path,
        "weight": backend.weight or 1.0,
        "tool_call_parser": backend.tool_call_parser or "hermes",
        "chat_template_kwargs": json_format.MessageToDict(backend.chat_template_kwargs),
        "logprobs_mode": mode,
    }
    try:
        return BackendSettings.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument("; ".join(_problem(error) for error in exc.errors())) from None


def _kind_name(kind: int) -> str:
    try:
        return str(v1.BackendKind.Name(kind))
    except ValueError:
        return str(kind)


def _problem(error: ErrorDetails) -> str:
    field = ".".join(str(part) for part in error["loc"])
    if field == "kind":
        usable = ", ".join(f"BACKEND_KIND_{kind.upper()}" for kind in BACKEND_KINDS)
        return f"backend.kind: {error.get('input')} cannot be added; use one of {usable}"
    message = error["msg"].removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    if not field:  # the whole message: never echo it (it holds the API key)
        return f"backend: {message}"
    got = repr(error.get("input"))[:80]
    if field == "weight":
        message += "; unset or 0 means 1"
    return f"backend.{field}: {message} (got {got})"
