"""The request body of OpenAI's Chat Completions API, as the gateway reads it (prorl_server/gateway/openai_chat.py
says what each field does). A message's role-specific fields are read after its role (`AssistantFields`,
`ToolFields`): a field the role does not use is not checked, as the API does not check it."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, PlainValidator, StrictBool, StrictFloat, StrictInt, StrictStr

from prorl_server.gateway.bodies import Body, Strings, between, invalid

PositiveInt = Annotated[StrictInt, Field(ge=1)]


def _arguments(value: Any) -> str:
    """A call's arguments as JSON text: absent is `{}`, an object is encoded."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    raise invalid("{path} must be a string")


class CallFunction(Body):
    name: StrictStr
    arguments: Annotated[str, PlainValidator(_arguments)] = "{}"


class AssistantCall(Body):
    id: StrictStr
    function: CallFunction


class AssistantFields(Body):
    tool_calls: list[AssistantCall] | None = None


class ToolFields(Body):
    tool_call_id: StrictStr


class Message(Body):
    role: StrictStr
    content: Any = None
    """A string or text parts: read by `common.text_of`, which names the part it refuses."""


class Function(Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: Any = None


class Tool(Body):
    type: StrictStr | None = None
    function: Function | None = None


class NamedFunction(Body):
    name: StrictStr


class AllowedTools(Body):
    tools: list[Any] | None = None


class ToolChoice(Body):
    """The object form of `tool_choice` (the string forms are read before it)."""

    type: StrictStr | None = None
    function: NamedFunction | None = None
    allowed_tools: AllowedTools | None = None


class StreamOptions(Body):
    include_usage: StrictBool | None = None


class ChatCompletionRequest(Body):
    n: PositiveInt | None = None
    functions: Any = None
    function_call: Any = None
    messages: list[Message]
    tools: list[Tool] | None = None
    tool_choice: Any = None
    max_completion_tokens: PositiveInt | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[StrictFloat, between(0.0, 2.0)] | None = None
    top_p: Annotated[StrictFloat, between(0.0, 1.0)] | None = None
    stop: Strings | None = None
    seed: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    model: StrictStr | None = None
