"""The request body of OpenAI's Responses API, as the gateway reads it (prorl_server/gateway/openai_responses.py
and responses_tools.py say what each field does). An input item's and a tool's own fields are read after
its type (`MessageItem`, `FunctionCallItem`, ..., `FunctionTool`, ...): an item or a tool of a type the
gateway leaves out is not checked further."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, PlainValidator, StrictBool, StrictFloat, StrictInt, StrictStr

from prorl_server.gateway.bodies import Body, between, invalid


def _arguments(value: Any) -> str:
    if value is None:
        return "{}"
    if not isinstance(value, str):
        raise invalid("{path} must be a string")
    return value


class Item(Body):
    """One `input` item; without a type, one with a role is a message."""

    type: StrictStr | None = None
    role: Any = None


class MessageItem(Body):
    role: StrictStr
    content: Any = None
    """A string or text parts: read by `common.text_of`."""


class FunctionCallItem(Body):
    name: StrictStr
    namespace: StrictStr | None = None
    arguments: Annotated[str, PlainValidator(_arguments)] = "{}"
    call_id: StrictStr


class CustomCallItem(Body):
    name: StrictStr
    namespace: StrictStr | None = None
    input: StrictStr | None = None
    call_id: StrictStr


class OutputItem(Body):
    call_id: StrictStr
    output: Any = None
    """A string or text parts: read by `common.text_of`."""


class ToolEntry(Body):
    type: StrictStr | None = None
    """function, custom or namespace; any other: a hosted tool, left out."""


class FunctionTool(Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: Any = None


class Grammar(Body):
    type: StrictStr | None = None
    syntax: StrictStr | None = None
    definition: StrictStr | None = None


class CustomTool(Body):
    name: StrictStr
    description: StrictStr | None = None
    format: Grammar | None = None


class NamespaceTool(Body):
    name: StrictStr
    tools: list[ToolEntry]


class NamedChoice(Body):
    """The object form of `tool_choice` (the string forms are read before it)."""

    type: StrictStr | None = None


class ChosenTool(Body):
    name: StrictStr


class AllowedTools(Body):
    tools: list[Any]


class ResponsesRequest(Body):
    previous_response_id: Any = None
    conversation: Any = None
    background: StrictBool | None = None
    prompt: Any = None
    tools: list[ToolEntry] | None = None
    instructions: StrictStr | None = None
    input: Any = None
    """A string or an array of items (`Item`), read by the handler."""
    tool_choice: Any = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, between(0.0, 2.0)] | None = None
    top_p: Annotated[StrictFloat, between(0.0, 1.0)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: StrictBool | None = None
    model: StrictStr | None = None
