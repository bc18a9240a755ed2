"""The request body of Google's generateContent API, as the gateway reads it (prorl_server/gateway/google_generate.py
says what each field does). A part's function_call / function_response is read by the handler through
`FunctionCall` / `FunctionResponse` where the content's role uses it; a tool's keys other than
`function_declarations` are tools the gateway leaves out, whatever they hold."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic.alias_generators import to_camel

from prorl_server.gateway.bodies import Body, ObjectOrEmpty, Strings, between, invalid

PositiveInt = Annotated[StrictInt, Field(ge=1)]


def _array_of_parts(value: Any) -> Any:
    if not isinstance(value, list):
        raise invalid("{path} must be an array of parts")
    return value


class GoogleBody(Body):
    """Google's fields are camelCase on the wire (the models name them in snake_case)."""

    model_config = ConfigDict(alias_generator=to_camel)


class Part(GoogleBody):
    thought: StrictBool | None = None
    text: StrictStr | None = None
    function_call: Any = None
    function_response: Any = None

    def kinds(self) -> str:
        """The part's keys, for the error that refuses it."""
        return ", ".join(sorted(self.model_dump(exclude_none=True, by_alias=True))) or "an empty part"


class FunctionCall(GoogleBody):
    name: StrictStr
    args: ObjectOrEmpty = {}
    id: StrictStr | None = None


class FunctionResponse(GoogleBody):
    name: StrictStr
    id: StrictStr | None = None
    response: Any = None


class Content(GoogleBody):
    role: StrictStr | None = None
    parts: Annotated[list[Part], BeforeValidator(_array_of_parts)] | None = None


class Declaration(GoogleBody):
    name: StrictStr
    description: StrictStr | None = None
    parameters_json_schema: Any = None
    parameters: Any = None


class Tool(GoogleBody):
    function_declarations: list[Declaration] | None = None


class CallingConfig(GoogleBody):
    mode: StrictStr | None = None
    allowed_function_names: list[Any] | None = None


class ToolConfig(GoogleBody):
    function_calling_config: CallingConfig | None = None


class GenerationConfig(GoogleBody):
    candidate_count: PositiveInt | None = None
    stop_sequences: Strings | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[StrictFloat, between(0.0, 2.0)] | None = None
    top_p: Annotated[StrictFloat, between(0.0, 1.0)] | None = None
    seed: StrictInt | None = None


class GenerateRequest(GoogleBody):
    system_instruction: Any = None
    """A string or a content of text parts."""
    contents: list[Content]
    tools: list[Tool] | None = None
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None


class CountTokensRequest(GoogleBody):
    generate_content_request: dict[str, Any] | None = None
    """The request to count (else the body is)."""
