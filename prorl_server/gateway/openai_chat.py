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

import json
import time
from typing import Any

from prorl_server.gateway.common import (
    ChatTurns,
    Fields,
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


def messages_of(fields: Fields) -> list[dict[str, Any]]:
    raw = fields.array("messages", required=True)
    assert raw is not None
    return [_message(value, f"messages[{index}]") for index, value in enumerate(raw)]


def _message(value: Any, path: str) -> dict[str, Any]:
    fields = Fields.of(value, path)
    role = fields.required_string("role")
    content = text_of(fields.get("content"), fields.name("content"))
    if role in ("system", "developer"):
        return {"role": "system", "content": content}
    if role == "user":
        return {"role": "user", "content": content}
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": content}
        calls = fields.array("tool_calls")
        if calls:
            message["tool_calls"] = [_tool_call(call, f"{path}.tool_calls[{i}]") for i, call in enumerate(calls)]
        return message
    if role == "tool":
        return {"role": "tool", "tool_call_id": fields.required_string("tool_call_id"), "content": content}
    if role == "function":
        raise bad_request(f"{path}.role: the legacy 'function' role is not supported; use 'tool'", fields.name("role"))
    raise bad_request(f"{path}.role: unknown role {role!r}", fields.name("role"))


def _tool_call(value: Any, path: str) -> dict[str, Any]:
    fields = Fields.of(value, path)
    function = fields.obj("function")
    if function is None:
        raise bad_request(f"{path}.function: this field is required", f"{path}.function")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    elif not isinstance(arguments, str):
        raise bad_request(f"{path}.function.arguments must be a string", f"{path}.function.arguments")
    return {
        "id": fields.required_string("id"),
        "type": "function",
        "function": {"name": function.required_string("name"), "arguments": arguments},
    }


def tools_of(fields: Fields) -> tuple[list[dict[str, Any]], bool]:
    """The tools to send and whether to read tool calls from the reply, after `tool_choice`."""
    tools: list[dict[str, Any]] = []
    for index, value in enumerate(fields.array("tools") or []):
        path = f"tools[{index}]"
        tool = Fields.of(value, path)
        kind = tool.string("type") or "function"
        if kind != "function":
            raise bad_request(f"{path} is a {kind!r} tool: only function tools are supported", path)
        function = tool.obj("function")
        if function is None:
            raise bad_request(f"{path}.function: this field is required", f"{path}.function")
        tools.append(
            function_tool(
                function.required_string("name"), function.string("description"), function.get("parameters"), path
            )
        )
    choice = fields.get("tool_choice")
    plain = plain_tool_choice(choice, tools)
    if plain is not None:
        return plain
    if isinstance(choice, dict):
        chosen = Fields(choice, "tool_choice")
        choice_kind = chosen.string("type")
        if choice_kind == "function":
            function = chosen.obj("function")
            if function is None:
                raise bad_request("tool_choice.function: this field is required", "tool_choice.function")
            return only_tool(tools, function.required_string("name"), "tool_choice"), True
        if choice_kind == "allowed_tools":
            allowed = chosen.obj("allowed_tools")
            listed = allowed.array("tools") if allowed is not None else None
            if listed is None:
                raise bad_request("tool_choice.allowed_tools.tools: this field is required", "tool_choice")
            names = {str((item.get("function") or {}).get("name")) for item in listed if isinstance(item, dict)}
            narrowed = [tool for tool in tools if tool["function"]["name"] in names]
            return narrowed, bool(narrowed)
        raise bad_request(f"tool_choice of type {choice_kind!r} is not supported", "tool_choice")
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
    fields = Fields(body)
    n = fields.integer("n", minimum=1)
    if n is not None and n != 1:
        raise bad_request(f"n: only one choice per request is supported, not {n}", "n")
    for legacy in ("functions", "function_call"):
        if fields.has(legacy):
            raise bad_request(f"{legacy}: the legacy function-calling fields are not supported; use tools", legacy)
    messages = messages_of(fields)
    tools, parse_calls = tools_of(fields)
    max_tokens = fields.integer("max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", minimum=1)
    sampling = sampling_for(
        turns.default_sampling,
        max_tokens=max_tokens,
        temperature=fields.number("temperature", minimum=0.0, maximum=2.0),
        top_p=fields.number("top_p", minimum=0.0, maximum=1.0),
        stop=fields.strings("stop"),
        seed=fields.integer("seed"),
        template_kwargs=fields.template_kwargs(),
    )
    stream = fields.boolean("stream")
    options = fields.obj("stream_options")
    include_usage = options.boolean("include_usage") if options is not None else False
    model = fields.string("model") or turns.model
    reply = await turns.run(messages, tools, sampling, parse_calls=parse_calls)
    if stream:
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
