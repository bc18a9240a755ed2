"""OpenAI's Chat Completions API (`POST /v1/chat/completions`) and model list (`GET /v1/models`).

Supported: `messages` with roles system, developer (as system), user, assistant (with `tool_calls`)
and tool (`tool_call_id`); content as a string or a list of text parts (joined with newlines);
function `tools`; `tool_choice`; `max_tokens` / `max_completion_tokens` (the latter wins);
`temperature`, `top_p`, `stop`, `seed`; `n` = 1; `stream` with `stream_options.include_usage`;
vLLM's `chat_template_kwargs`. `model` is free: any name is accepted and echoed back.

Approximated (the job's chat cannot force or forbid a call):
- `tool_choice: "required"` and a named function send the tools (the named one only) but the
  model may still answer without a call;
- `tool_choice: "none"` sends no tools and reads no calls from the text (a token backend renders
  the tools of a job's first turn into its prompt once, whatever later turns send);
- `stop`: the backend's reply says "stop" whether it met a stop sequence or ended its turn.

Refused with 400: `n` > 1, image/audio/file content parts, the legacy `functions` /
`function_call` and `role: "function"`, tools other than function tools.
Ignored: `response_format`, `logprobs`, `top_logprobs`, penalties, `logit_bias`, `user`,
`metadata`, `store`, `parallel_tool_calls`, `reasoning_effort`, `service_tier`.
"""

from __future__ import annotations

import time
from typing import Any

from prorl_server.gateway.bodies import validate
from prorl_server.gateway.bodies.openai_chat import (
    AssistantCall,
    AssistantFields,
    ChatCompletionRequest,
    Message,
    ToolChoice,
    ToolFields,
)
from prorl_server.gateway.common import (
    ChatTurns,
    GatewayError,
    Reply,
    bad_request,
    function_tool,
    json_response,
    new_id,
    only_tool,
    plain_tool_choice,
    sampling_for,
    sse_event,
    sse_response,
    text_of,
)
from prorl_server.llm.base import ChatMessage, ToolCall
from prorl_server.sandbox.runtime.relay import HttpResponse

OWNER = "prorl"

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "authentication": "invalid_request_error",
    "permission": "permission_error",
    "not_found": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "too_large": "invalid_request_error",
    "unavailable": "server_error",
    "api_error": "server_error",
}
ERROR_CODES = {
    "authentication": "invalid_api_key",
    "context_length": "context_length_exceeded",
    "not_found": "not_found",
    "method_not_allowed": "method_not_allowed",
    "rate_limit": "rate_limit_exceeded",
    "too_large": "request_too_large",
}


def error_body(error: GatewayError) -> dict[str, Any]:
    """OpenAI's error object (the same for every OpenAI route)."""
    message = error.message
    if error.kind == "context_length":
        # The wording clients (litellm, ...) recognise as a context window error.
        message = f"This model's maximum context length is exceeded by this request: {message}"
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(error.kind, "server_error"),
            "param": error.param,
            "code": error.code or ERROR_CODES.get(error.kind),
        }
    }


def messages_of(request: ChatCompletionRequest) -> list[ChatMessage]:
    return [_message(message, f"messages[{index}]") for index, message in enumerate(request.messages)]


def _message(message: Message, path: str) -> ChatMessage:
    role = message.role
    content = text_of(message.content, f"{path}.content")
    if role in ("system", "developer"):
        return {"role": "system", "content": content}
    if role == "user":
        return {"role": "user", "content": content}
    if role == "assistant":
        assistant: ChatMessage = {"role": "assistant", "content": content}
        calls = validate(AssistantFields, message.model_extra, path).tool_calls
        if calls:
            assistant["tool_calls"] = [_tool_call(call) for call in calls]
        return assistant
    if role == "tool":
        call_id = validate(ToolFields, message.model_extra, path).tool_call_id
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    if role == "function":
        raise bad_request(f"{path}.role: the legacy 'function' role is not supported; use 'tool'", f"{path}.role")
    raise bad_request(f"{path}.role: unknown role {role!r}", f"{path}.role")


def _tool_call(call: AssistantCall) -> ToolCall:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def tools_of(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], bool]:
    """The tools to send and whether to read tool calls from the reply, after `tool_choice`."""
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(request.tools or []):
        path = f"tools[{index}]"
        kind = tool.type or "function"
        if kind != "function":
            raise bad_request(f"{path} is a {kind!r} tool: only function tools are supported", path)
        if tool.function is None:
            raise bad_request(f"{path}.function: this field is required", f"{path}.function")
        function = tool.function
        tools.append(function_tool(function.name, function.description, function.parameters, path))
    choice = request.tool_choice
    plain = plain_tool_choice(choice, tools)
    if plain is not None:
        return plain
    if isinstance(choice, dict):
        chosen = validate(ToolChoice, choice, "tool_choice")
        if chosen.type == "function":
            if chosen.function is None:
                raise bad_request("tool_choice.function: this field is required", "tool_choice.function")
            return only_tool(tools, chosen.function.name, "tool_choice"), True
        if chosen.type == "allowed_tools":
            listed = chosen.allowed_tools.tools if chosen.allowed_tools is not None else None
            if listed is None:
                raise bad_request("tool_choice.allowed_tools.tools: this field is required", "tool_choice")
            names = {str((item.get("function") or {}).get("name")) for item in listed if isinstance(item, dict)}
            narrowed = [tool for tool in tools if tool["function"]["name"] in names]
            return narrowed, bool(narrowed)
        raise bad_request(f"tool_choice of type {chosen.type!r} is not supported", "tool_choice")
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
        for c in reply.calls
    ]


def completion(reply: Reply, *, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not reply.calls else None,
        "refusal": None,
    }
    if reply.calls:
        message["tool_calls"] = _calls(reply)
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish}],
        "usage": _usage(reply),
    }


def completion_chunks(reply: Reply, *, model: str, include_usage: bool) -> list[bytes]:
    """The reply as chat.completion.chunk events, then `data: [DONE]`."""
    base = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        value: dict[str, Any] = {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            value["usage"] = None
        return sse_event(value)

    events = [chunk({"role": "assistant", "content": ""})]
    if reply.content:
        events.append(chunk({"content": reply.content}))
    for index, call in enumerate(reply.calls):
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        events.append(chunk({"tool_calls": [head]}))
        events.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments_json}}]}))
    events.append(chunk({}, reply.finish))
    if include_usage:
        events.append(sse_event({**base, "choices": [], "usage": _usage(reply)}))
    events.append(sse_event("[DONE]"))
    return events


async def handle_chat_completions(turns: ChatTurns, body: dict[str, Any]) -> HttpResponse:
    request = validate(ChatCompletionRequest, body)
    if request.n is not None and request.n != 1:
        raise bad_request(f"n: only one choice per request is supported, not {request.n}", "n")
    for legacy in ("functions", "function_call"):
        if getattr(request, legacy) is not None:
            raise bad_request(f"{legacy}: the legacy function-calling fields are not supported; use tools", legacy)
    messages = messages_of(request)
    tools, parse_calls = tools_of(request)
    sampling = sampling_for(
        turns.default_sampling,
        max_tokens=request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=request.stop,
        seed=request.seed,
        template_kwargs=request.chat_template_kwargs,
    )
    options = request.stream_options
    include_usage = bool(options is not None and options.include_usage)
    model = request.model or turns.model
    reply = await turns.run(messages, tools, sampling, parse_calls=parse_calls)
    if request.stream:
        return sse_response(completion_chunks(reply, model=model, include_usage=include_usage))
    return json_response(200, completion(reply, model=model))


def model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": OWNER}


def handle_models(turns: ChatTurns, name: str | None) -> HttpResponse:
    """GET /v1/models (the one model) or /v1/models/{name}."""
    if name is None:
        return json_response(200, {"object": "list", "data": [model_object(turns.model)]})
    if name != turns.model:
        raise GatewayError(404, f"The model {name!r} does not exist", kind="not_found", param="model")
    return json_response(200, model_object(turns.model))
