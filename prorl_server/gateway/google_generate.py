"""Google's Gemini API (`POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent`,
`:countTokens`, `GET /v1beta/models`), as Gemini CLI and the google-genai SDKs call it.

Supported: `contents` with roles user and model; text parts (a content's texts joined with
newlines), `functionCall` parts (model) and `functionResponse` parts (user: each a `tool`
message, its `response` object as JSON text, or its `output` / `content` when that is the only
field and a string); `thought` parts are dropped, `thoughtSignature` ignored. `systemInstruction`
(a system message first); `tools[].functionDeclarations` (`parametersJsonSchema`, or the
OpenAPI-style `parameters` with its upper-case type names written as JSON Schema's);
`toolConfig.functionCallingConfig` mode AUTO / VALIDATED / ANY (with `allowedFunctionNames`) /
NONE; `generationConfig` maxOutputTokens, temperature, topP, stopSequences, seed,
candidateCount 1. The answer has one candidate (text part, then one `functionCall` part per
call, each with an `id` that the program's `functionResponse` names), `finishReason` STOP or
MAX_TOKENS, and `usageMetadata`. `:streamGenerateContent?alt=sse` sends the answer as one
server-sent event (`data: {...}`); without `alt=sse`, as a JSON array of one response.

Calls without an `id` in the history (a client that drops them) get one from their place
(`call_<content>_<part>`), and a `functionResponse` without one answers the earliest
unanswered call of its name: the same history always reads the same way, so calls still
continue one token chain.

Tools of other kinds (googleSearch, googleSearchRetrieval, codeExecution, urlContext,
fileSearch, googleMaps, computerUse, retrieval, ...) are left out of what the model sees and
recorded (the result's `details.gateway.tools_left_out`). Ignored on purpose (docs/llm.md):
`safetySettings`, `cachedContent`, `labels`, `generationConfig.thinkingConfig`, topK,
responseMimeType / responseSchema / responseJsonSchema (the model's text is not constrained),
presence and frequency penalties, responseLogprobs.

Refused with 400: inline data, file data and other non-text parts; candidateCount > 1.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prorl_server.gateway.bodies import validate
from prorl_server.gateway.bodies.google_generate import (
    Content,
    CountTokensRequest,
    FunctionCall,
    FunctionResponse,
    GenerateRequest,
    GenerationConfig,
    Part,
)
from prorl_server.gateway.common import (
    ChatTurns,
    GatewayError,
    Reply,
    bad_request,
    dumps,
    function_tool,
    json_response,
    new_id,
    only_tool,
    sampling_for,
    sse_response,
)
from prorl_server.llm.base import ChatMessage, ToolCall
from prorl_server.sandbox.runtime.relay import HttpResponse

ROUTE = re.compile(r"^/(?:v1beta|v1alpha|v1)?/?models/(?P<model>[^/:]+):(?P<method>[A-Za-z]+)$")
"""A model call's path (the `/v1` prefix may already have been taken off)."""
METHODS = ("generateContent", "streamGenerateContent", "countTokens")
MODEL_CALLS = ("generateContent", "streamGenerateContent")
LIST = re.compile(r"^/(?:v1beta|v1alpha)/models(?:/(?P<model>[^/:]+))?$")

STATUS = {
    "invalid_request": (400, "INVALID_ARGUMENT"),
    "context_length": (400, "INVALID_ARGUMENT"),
    "method_not_allowed": (405, "INVALID_ARGUMENT"),
    "authentication": (401, "UNAUTHENTICATED"),
    "permission": (403, "PERMISSION_DENIED"),
    "not_found": (404, "NOT_FOUND"),
    "rate_limit": (429, "RESOURCE_EXHAUSTED"),
    "too_large": (413, "INVALID_ARGUMENT"),
    "unavailable": (503, "UNAVAILABLE"),
    "api_error": (500, "INTERNAL"),
}


def error_body(error: GatewayError) -> dict[str, Any]:
    """Google's error object."""
    status = STATUS.get(error.kind, (error.status, "INTERNAL"))[1]
    message = error.message
    if error.kind == "context_length":
        message = f"The input token count exceeds the maximum number of tokens allowed: {message}"
    return {"error": {"code": error.status, "message": message, "status": status}}


def is_google(path: str) -> bool:
    """Whether `path` (without its query) is one of this module's routes."""
    return bool(ROUTE.match(path) or LIST.match(path))


# ---------------------------------------------------------------------------------------------
# Requests


def _parts(content: Content, path: str) -> list[tuple[str, Part]]:
    return [(f"{path}.parts[{i}]", part) for i, part in enumerate(content.parts or [])]


def _unsupported(part: Part, path: str) -> GatewayError:
    return bad_request(
        f"{path} is a part with {part.kinds()}: this gateway takes text, functionCall and functionResponse "
        "parts only (no inline or file data, no executable code)",
        path,
    )


def system_of(request: GenerateRequest) -> str | None:
    system = request.system_instruction
    if system is None:
        return None
    if isinstance(system, str):
        return system
    texts = []
    for path, part in _parts(validate(Content, system, "systemInstruction"), "systemInstruction"):
        if part.text is None:
            raise _unsupported(part, path)
        texts.append(part.text)
    return "\n".join(texts)


def _response_text(response: Any) -> str:
    """A functionResponse's `response` as the tool message's text."""
    if isinstance(response, dict) and len(response) == 1:
        (only,) = response.values()
        if isinstance(only, str) and next(iter(response)) in ("output", "content", "result"):
            return only
    if isinstance(response, str):
        return response
    return json.dumps(response, ensure_ascii=False)


def messages_of(request: GenerateRequest) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    system = system_of(request)
    if system:
        messages.append({"role": "system", "content": system})
    unanswered: list[tuple[str, str]] = []  # (id, name) of the calls not yet answered
    for index, content in enumerate(request.contents):
        role = content.role or "user"
        if role == "model":
            messages.append(_model_message(content, index, unanswered))
        elif role in ("user", "function", "tool"):
            messages.extend(_user_messages(content, index, unanswered))
        else:
            raise bad_request(
                f"contents[{index}].role must be 'user' or 'model', not {role!r}", f"contents[{index}].role"
            )
    return messages


def _model_message(content: Content, index: int, unanswered: list[tuple[str, str]]) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for part_index, (path, part) in enumerate(_parts(content, f"contents[{index}]")):
        if part.thought:
            continue
        if part.function_call is not None:
            call = validate(FunctionCall, part.function_call, f"{path}.functionCall")
            call_id = call.id or f"call_{index}_{part_index}"
            unanswered.append((call_id, call.name))
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.args)},
                }
            )
        elif part.text is not None:
            texts.append(part.text)
        else:
            raise _unsupported(part, path)
    message: ChatMessage = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(content: Content, index: int, unanswered: list[tuple[str, str]]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    texts: list[str] = []
    for part_index, (path, part) in enumerate(_parts(content, f"contents[{index}]")):
        if part.function_response is not None:
            result = validate(FunctionResponse, part.function_response, f"{path}.functionResponse")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            name = result.name
            call_id = result.id
            answered = next((i for i, (cid, cname) in enumerate(unanswered) if cid == call_id), None)
            if answered is None and call_id is None:
                answered = next((i for i, (_, cname) in enumerate(unanswered) if cname == name), None)
            if answered is not None:
                call_id = unanswered.pop(answered)[0]
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id or f"call_{index}_{part_index}",
                    "name": name,
                    "content": _response_text(result.response),
                }
            )
        elif part.text is not None:
            if not part.thought:
                texts.append(part.text)
        else:
            raise _unsupported(part, path)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _json_schema(schema: Any) -> Any:
    """An OpenAPI-style Gemini schema (`type: "OBJECT"`, ...) with JSON Schema's lower-case types."""
    if isinstance(schema, dict):
        out: dict[str, Any] = {}
        for key, value in schema.items():
            if key == "type" and isinstance(value, str):
                out[key] = value.lower()
            elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                out[key] = {name: _json_schema(inner) for name, inner in value.items()}
            else:
                out[key] = _json_schema(value) if isinstance(value, dict | list) else value
        return out
    if isinstance(schema, list):
        return [_json_schema(item) for item in schema]
    return schema


def tools_of(request: GenerateRequest, left_out: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The tools to send and whether to read calls, after `toolConfig`; the kinds left out added to
    `left_out`."""
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(request.tools or []):
        left_out.extend(key for key, inner in (tool.model_extra or {}).items() if inner is not None)
        for declaration_index, declaration in enumerate(tool.function_declarations or []):
            where = f"tools[{index}].functionDeclarations[{declaration_index}]"
            schema = declaration.parameters_json_schema
            if schema is None and declaration.parameters is not None:
                schema = _json_schema(declaration.parameters)
            tools.append(function_tool(declaration.name, declaration.description, schema, where))
    config = request.tool_config
    calling = config.function_calling_config if config is not None else None
    mode = (calling.mode if calling is not None else None) or "AUTO"
    mode = mode.upper()
    if mode in ("AUTO", "VALIDATED", "MODE_UNSPECIFIED"):
        return tools, bool(tools)
    if mode == "NONE":
        return [], False
    if mode == "ANY":
        assert calling is not None
        allowed = calling.allowed_function_names
        if allowed:
            if len(allowed) == 1:
                return only_tool(tools, str(allowed[0]), "toolConfig.functionCallingConfig.allowedFunctionNames"), True
            tools = [tool for tool in tools if tool["function"]["name"] in set(map(str, allowed))]
        if not tools:
            raise bad_request(
                "toolConfig.functionCallingConfig.mode is ANY but no function is declared",
                "toolConfig.functionCallingConfig",
            )
        return tools, True
    raise bad_request(
        f"toolConfig.functionCallingConfig.mode must be AUTO, ANY, NONE or VALIDATED, not {mode!r}",
        "toolConfig.functionCallingConfig.mode",
    )


# ---------------------------------------------------------------------------------------------
# Answers


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "promptTokenCount": reply.prompt_tokens,
        "candidatesTokenCount": reply.completion_tokens,
        "totalTokenCount": reply.prompt_tokens + reply.completion_tokens,
    }


def response_object(reply: Reply, *, model: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if reply.content or not reply.calls:
        parts.append({"text": reply.content})
    for call in reply.calls:
        parts.append({"functionCall": {"id": call.id, "name": call.name, "args": call.arguments}})
    return {
        "candidates": [
            {
                "content": {"role": "model", "parts": parts},
                "finishReason": "MAX_TOKENS" if reply.finish == "length" else "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": _usage(reply),
        "modelVersion": model,
        "responseId": new_id(""),
    }


async def handle_generate(turns: ChatTurns, body: dict[str, Any], *, path: str) -> HttpResponse:
    """generateContent / streamGenerateContent (`path` with its query: the model, `alt=sse`)."""
    target = urlsplit(path)
    match = ROUTE.match(target.path)
    assert match is not None
    model, method = match["model"], match["method"]
    request = validate(GenerateRequest, body)
    messages = messages_of(request)
    left_out: list[str] = []
    tools, parse_calls = tools_of(request, left_out)
    turns.left_out(left_out)
    config = request.generation_config or GenerationConfig()
    if config.candidate_count is not None and config.candidate_count > 1:
        raise bad_request(
            "generationConfig.candidateCount must be 1: one sample per call", "generationConfig.candidateCount"
        )
    sampling = sampling_for(
        turns.default_sampling,
        max_tokens=config.max_output_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        stop=config.stop_sequences,
        seed=config.seed,
    )
    reply = await turns.run(messages, tools, sampling, parse_calls=parse_calls)
    answer = response_object(reply, model=model)
    if method == "streamGenerateContent":
        if parse_qs(target.query).get("alt") == ["sse"]:
            return sse_response([f"data: {dumps(answer)}\r\n\r\n".encode()])
        return json_response(200, [answer])
    return json_response(200, answer)


CHARS_PER_TOKEN = 4


def handle_count_tokens(body: dict[str, Any]) -> HttpResponse:
    """A rough estimate, as Anthropic's count_tokens: about 4 characters a token."""
    inner = validate(CountTokensRequest, body).generate_content_request
    counted, prefix = (inner, "generateContentRequest") if inner is not None else (body, "")
    if counted.get("contents") is None:
        return json_response(200, {"totalTokens": 0})
    request = validate(GenerateRequest, counted, prefix)
    messages = messages_of(request)
    tools, _ = tools_of(request, [])
    size = len(json.dumps(messages, ensure_ascii=False)) + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)
    return json_response(200, {"totalTokens": math.ceil(size / CHARS_PER_TOKEN)})


def model_object(model: str) -> dict[str, Any]:
    return {
        "name": f"models/{model}",
        "displayName": model,
        "supportedGenerationMethods": list(METHODS),
    }


def handle_models(turns: ChatTurns, path: str) -> HttpResponse:
    match = LIST.match(urlsplit(path).path)
    name = match["model"] if match is not None else None
    if name is None:
        return json_response(200, {"models": [model_object(turns.model)]})
    if name != turns.model:
        raise GatewayError(
            404, f"models/{name} is not found: this gateway serves models/{turns.model}", kind="not_found"
        )
    return json_response(200, model_object(turns.model))
