"""The request body of Anthropic's Messages API, as the gateway reads it (prorl_server/gateway/anthropic_messages.py
says what each field does). Content blocks are read by the handler (text blocks, and the fields of a tool_use
or tool_result block through `ToolUse` / `ToolResult`): what a block must hold depends on its type. A tool's
and a tool_choice's own fields are read after their type (`CustomTool`, `NamedChoice`): a server tool is
left out, whatever it holds."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, PlainValidator, StrictBool, StrictFloat, StrictInt, StrictStr

from prorl_server.gateway.bodies import Body, ObjectOrEmpty, Present, between, invalid
from prorl_server.gateway.common import kind_of


def _string_array(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise invalid("{path} must be an array, not " + kind_of(value))
    if not all(isinstance(item, str) for item in value):
        raise invalid("{path} must be an array of strings")
    return tuple(value)


class Message(Body):
    role: StrictStr
    content: Present
    """A string or content blocks."""


class ToolUse(Body):
    """The fields of an assistant's tool_use block."""

    input: ObjectOrEmpty = {}
    id: StrictStr
    name: StrictStr


class ToolResult(Body):
    """The fields of a user's tool_result block."""

    tool_use_id: StrictStr
    content: Any = None
    """A string or text blocks."""


class ToolEntry(Body):
    type: StrictStr | None = None
    """None or "custom": a tool the model is offered; any other: a server tool, left out."""


class CustomTool(Body):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: Any = None


class ToolChoice(Body):
    type: StrictStr


class NamedChoice(Body):
    """The fields of a tool_choice of type "tool"."""

    name: StrictStr


class MessagesBody(Body):
    """What `count_tokens` reads too."""

    messages: list[Message]
    system: Any = None
    """A string or text blocks."""
    tools: list[ToolEntry] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(MessagesBody):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Annotated[tuple[str, ...], PlainValidator(_string_array)] | None = None
    temperature: Annotated[StrictFloat, between(0.0, 1.0)] | None = None
    top_p: Annotated[StrictFloat, between(0.0, 1.0)] | None = None
    stream: StrictBool | None = None
    model: StrictStr | None = None
