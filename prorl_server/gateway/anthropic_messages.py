"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`, `GET /v1/models`).

Supported: `system` (a string or text blocks, joined with newlines); `messages` with text,
tool_use (assistant) and tool_result (user) blocks: a tool_use is an assistant `tool_calls`
entry, each tool_result a `tool` message (its text: a string or text blocks; `is_error` is not
marked), text blocks after them a user message; `tools` (`input_schema` -> `parameters`);
`tool_choice` auto / any / tool / none; `max_tokens` (required); `stop_sequences`;
`temperature`, `top_p`; `role: "system"` messages anywhere in `messages` (text blocks: a
system message there, rendered as the model's template renders one); `stream` with Anthropic's
named events (message_start,
content_block_start / _delta (text_delta, input_json_delta) / _stop, message_delta with the
stop_reason and usage, message_stop). `model` is free: any name is accepted and echoed back.

Approximated: `tool_choice` any / tool cannot force a call (the named tool alone is sent);
`none` sends no tools. `stop_reason` is end_turn, max_tokens or tool_use: a reply that met one
of the `stop_sequences` is reported as end_turn (the backend does not say which stop it met).
Thinking blocks in the history are dropped. Ignored on purpose (docs/llm.md lists them per
harness): `thinking`, `top_k`, `metadata`, `cache_control`, `service_tier`,
`context_management`, `output_config`, `container`, `mcp_servers`, the `anthropic-beta`
header. A structured tool call whose arguments are not a JSON object has `input` {}. Server and
Anthropic-defined tool types (web search, web fetch, code execution, bash, text editor, ...)
are left out of what the model sees, not refused, and recorded (the result's
`details.gateway.tools_left_out`).

Refused with 400: a missing `max_tokens`; image, document and other non-text blocks.

`count_tokens` answers a rough estimate (about 4 characters per token over the JSON of the
system prompt, messages and tools): the real count needs the job's tokenizer and template.
"""

from __future__ import annotations

import json
import math
from typing import Any

from prorl_server.gateway.bodies import validate
from prorl_server.gateway.bodies.anthropic_messages import (
    CustomTool,
    MessagesBody,
    MessagesRequest,
    NamedChoice,
    ToolResult,
    ToolUse,
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
    sampling_for,
    sse_event,
    sse_response,
)
from prorl_server.llm.base import ChatMessage, ToolCall
from prorl_server.sandbox.runtime.relay import HttpResponse

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "too_large": "request_too_large",
    "unavailable": "overloaded_error",
    "api_error": "api_error",
}


def error_body(error: GatewayError) -> dict[str, Any]:
    """Anthropic's error object."""
    kind = ERROR_TYPES.get(error.kind, "api_error")
    message = f"prompt is too long: {error.message}" if error.kind == "context_length" else error.message
    return {"type": "error", "error": {"type": kind, "message": message}}


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _blocks(content: Any, path: str) -> list[tuple[str, dict[str, Any]]]:
    """A message's content as (path, block) pairs; a string is one text block."""
    if isinstance(content, str):
        return [(path, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise bad_request(f"{path} must be a string or an array of content blocks", path)
    blocks = []
    for index, block in enumerate(content):
        where = f"{path}[{index}]"
        if not isinstance(block, dict):
            raise bad_request(f"{where} must be an object", where)
        blocks.append((where, block))
    return blocks


def _text(block: dict[str, Any], path: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{path}.text must be a string", f"{path}.text")
    return text


def _unsupported(block: dict[str, Any], path: str) -> GatewayError:
    return bad_request(
        f"{path} is a {block.get('type')!r} block: this gateway takes text, tool_use and tool_result "
        "blocks only (no images, documents or server tools)",
        path,
    )


def _result_text(result: ToolResult, path: str) -> str:
    content = result.content
    if content is None:
        return ""
    texts = []
    for where, inner in _blocks(content, f"{path}.content"):
        if inner.get("type") != "text":
            raise _unsupported(inner, where)
        texts.append(_text(inner, where))
    return "\n".join(texts)


def system_of(body: MessagesBody) -> str | None:
    system = body.system
    if system is None:
        return None
    texts = []
    for where, block in _blocks(system, "system"):
        if block.get("type") != "text":
            raise _unsupported(block, where)
        texts.append(_text(block, where))
    return "\n".join(texts)


def messages_of(body: MessagesBody) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    system = system_of(body)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        path = f"messages[{index}]"
        role = message.role
        blocks = _blocks(message.content, f"{path}.content")
        if role == "user":
            messages.extend(_user(blocks))
        elif role == "assistant":
            messages.append(_assistant(blocks))
        elif role == "system":  # anywhere in the conversation (Claude Code's mid-conversation system beta)
            messages.append({"role": "system", "content": _system_text(blocks)})
        else:
            raise bad_request(f"{path}.role must be 'user', 'assistant' or 'system', not {role!r}", f"{path}.role")
    return messages


def _system_text(blocks: list[tuple[str, dict[str, Any]]]) -> str:
    for where, block in blocks:
        if block.get("type") != "text":
            raise _unsupported(block, where)
    return "\n".join(_text(block, where) for where, block in blocks)


def _user(blocks: list[tuple[str, dict[str, Any]]]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    texts: list[str] = []
    for where, block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = validate(ToolResult, block, where)
            out.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": _result_text(result, where)})
        else:
            raise _unsupported(block, where)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[tuple[str, dict[str, Any]]]) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for where, block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use":
            use = validate(ToolUse, block, where)
            calls.append(
                {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported(block, where)
    message: ChatMessage = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def tools_of(body: MessagesBody, left_out: list[str] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The tools to send and whether to read tool calls from the reply, after `tool_choice`. Server
    and Anthropic-defined tools (web search, code execution, bash, text editor, ...) are left out of
    what the model sees, their types added to `left_out`."""
    tools: list[dict[str, Any]] = []
    for index, entry in enumerate(body.tools or []):
        path = f"tools[{index}]"
        kind = entry.type
        if kind not in (None, "custom"):
            if left_out is not None:
                left_out.append(kind)
            continue
        tool = validate(CustomTool, entry.model_extra, path)
        tools.append(function_tool(tool.name, tool.description, tool.input_schema, path))
    choice = body.tool_choice
    if choice is None:
        return tools, bool(tools)
    kind = choice.type
    if kind == "auto":
        return tools, bool(tools)
    if kind == "none":
        return [], False
    if kind == "any":
        if not tools:
            raise bad_request("tool_choice is 'any' but the request has no tools", "tool_choice")
        return tools, True
    if kind == "tool":
        name = validate(NamedChoice, choice.model_extra, "tool_choice").name
        return only_tool(tools, name, "tool_choice"), True
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, not {kind!r}", "tool_choice.type")


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "input_tokens": reply.prompt_tokens,
        "output_tokens": reply.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.content or not reply.calls:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
    return blocks


def message_object(reply: Reply, *, model: str) -> dict[str, Any]:
    return {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(reply),
        "stop_reason": STOP_REASONS[reply.finish],
        "stop_sequence": None,
        "usage": _usage(reply),
    }


def message_events(reply: Reply, *, model: str) -> list[bytes]:
    """The reply as Anthropic's stream of named events."""
    start = {**message_object(reply, model=model), "content": [], "stop_reason": None}
    start["usage"] = {**_usage(reply), "output_tokens": 0}
    events = [
        sse_event({"type": "message_start", "message": start}, "message_start"),
        sse_event({"type": "ping"}, "ping"),
    ]
    for index, block in enumerate(content_blocks(reply)):
        if block["type"] == "text":
            opening: dict[str, Any] = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            opening = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(
            sse_event({"type": "content_block_start", "index": index, "content_block": opening}, "content_block_start")
        )
        if delta.get("text") != "":
            events.append(
                sse_event({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            )
        events.append(sse_event({"type": "content_block_stop", "index": index}, "content_block_stop"))
    finish = {
        "type": "message_delta",
        "delta": {"stop_reason": STOP_REASONS[reply.finish], "stop_sequence": None},
        "usage": {"output_tokens": reply.completion_tokens},
    }
    events.append(sse_event(finish, "message_delta"))
    events.append(sse_event({"type": "message_stop"}, "message_stop"))
    return events


async def handle_messages(turns: ChatTurns, body: dict[str, Any]) -> HttpResponse:
    request = validate(MessagesRequest, body)
    messages = messages_of(request)
    left_out: list[str] = []
    tools, parse_calls = tools_of(request, left_out)
    turns.left_out(left_out)
    sampling = sampling_for(
        turns.default_sampling,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=request.stop_sequences,
    )
    model = request.model or turns.model
    reply = await turns.run(messages, tools, sampling, parse_calls=parse_calls)
    if request.stream:
        return sse_response(message_events(reply, model=model))
    return json_response(200, message_object(reply, model=model))


CHARS_PER_TOKEN = 4


def handle_count_tokens(body: dict[str, Any]) -> HttpResponse:
    """A rough estimate (see the module docstring); the request is checked as a messages request."""
    request = validate(MessagesBody, body)
    messages = messages_of(request)
    tools, _ = tools_of(request)
    size = len(json.dumps(messages, ensure_ascii=False)) + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)
    return json_response(200, {"input_tokens": math.ceil(size / CHARS_PER_TOKEN)})


def model_object(model: str) -> dict[str, Any]:
    return {"type": "model", "id": model, "display_name": model, "created_at": "1970-01-01T00:00:00Z"}


def handle_models(turns: ChatTurns, name: str | None) -> HttpResponse:
    """GET /v1/models in Anthropic's shape (a request with an `anthropic-version` header)."""
    if name is None:
        page = {"data": [model_object(turns.model)], "has_more": False, "first_id": turns.model, "last_id": turns.model}
        return json_response(200, page)
    if name != turns.model:
        raise GatewayError(404, f"model: {name}", kind="not_found")
    return json_response(200, model_object(turns.model))
