"""OpenAI's Responses API (`POST /v1/responses`), stateless, as far as real harnesses need it.

Supported: `input` as a string or a list of items: messages (roles user, system, developer,
assistant; content a string or input_text / output_text parts), `function_call` and
`custom_tool_call` items (joined to the assistant message before them; a `namespace` read back
as responses_tools.py names it) and `function_call_output` / `custom_tool_call_output` items
(`tool` messages); `reasoning` items are dropped. `instructions` (a system message first);
`tools`: function, `namespace` and `custom` tools (responses_tools.py), every other (hosted)
tool type left out of what the model sees and recorded; `tool_choice` auto / none / required /
a function / allowed_tools; `max_output_tokens`, `temperature`, `top_p`; vLLM's
`chat_template_kwargs`. The response has `output` items (a message with one output_text part;
function_call items with id, call_id, name, namespace when the tool had one, and arguments;
custom_tool_call items with input), `output_text`, `usage`, and status `incomplete` (reason
max_output_tokens) when the reply was cut. `stream: true` sends response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / .done, response.content_part.done,
response.function_call_arguments.delta / .done (response.custom_tool_call_input.delta / .done),
response.output_item.done and response.completed (response.incomplete when cut).

Approximated as on the chat API: tool_choice required / a function cannot force a call.

Refused with 400: `previous_response_id`, `conversation`, `item_reference` items and
`background` (nothing is stored: send the whole conversation as `input`); `prompt` templates;
image and file inputs; input items of hosted tools (web_search_call, ...), which the gateway
never gives.
Ignored on purpose (docs/llm.md lists them per harness): `store`, `include`, `text` (formats
and verbosity), `reasoning`, `metadata`, `parallel_tool_calls`, `truncation`, `user`,
`prompt_cache_key`, `prompt_cache_retention`, `safety_identifier`, `service_tier`,
`client_metadata`, `stream_options`, `max_tool_calls`, `top_logprobs`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from prorl_server.gateway.bodies import validate
from prorl_server.gateway.bodies.openai_responses import (
    AllowedTools,
    ChosenTool,
    CustomCallItem,
    FunctionCallItem,
    Item,
    MessageItem,
    NamedChoice,
    OutputItem,
    ResponsesRequest,
)
from prorl_server.gateway.common import (
    ChatTurns,
    Reply,
    bad_request,
    json_response,
    new_id,
    only_tool,
    plain_tool_choice,
    sampling_for,
    sse_event,
    sse_response,
    text_of,
)
from prorl_server.gateway.responses_tools import CUSTOM_INPUT, ResponsesTools
from prorl_server.llm.base import ChatMessage, ToolCall
from prorl_server.sandbox.runtime.relay import HttpResponse

STATELESS = "this gateway is stateless and stores no responses: send the whole conversation as input"


def messages_of(request: ResponsesRequest, offered: ResponsesTools) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    value = request.input
    if value is None:
        raise bad_request("input: this field is required", "input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    if not isinstance(value, list):
        raise bad_request("input must be a string or an array of items", "input")
    assistant: ChatMessage | None = None  # the open assistant message: function calls join it
    for index, raw in enumerate(value):
        path = f"input[{index}]"
        item = validate(Item, raw, path)
        kind = item.type or ("message" if item.role is not None else None)
        if kind in ("function_call", "custom_tool_call"):
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                messages.append(assistant)
            assistant.setdefault("tool_calls", []).append(_call(raw, kind, path, offered))
            continue
        if kind == "reasoning":
            continue
        assistant = None
        if kind == "message":
            message = validate(MessageItem, raw, path)
            role = message.role
            content = text_of(message.content, f"{path}.content")
            if role in ("system", "developer"):
                messages.append({"role": "system", "content": content})
            elif role == "user":
                messages.append({"role": "user", "content": content})
            elif role == "assistant":
                assistant = {"role": "assistant", "content": content}
                messages.append(assistant)
            else:
                raise bad_request(f"{path}.role: unknown role {role!r}", f"{path}.role")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = validate(OutputItem, raw, path)
            messages.append(
                {"role": "tool", "tool_call_id": output.call_id, "content": text_of(output.output, f"{path}.output")}
            )
        elif kind == "item_reference":
            raise bad_request(f"{path} is an item_reference: {STATELESS}", path)
        else:
            raise bad_request(
                f"{path} is a {kind!r} item: only message, function_call, function_call_output, "
                "custom_tool_call, custom_tool_call_output and reasoning items are supported (the gateway "
                "runs no hosted tools, so it never gives their items)",
                path,
            )
    return messages


def _call(raw: Any, kind: str, path: str, offered: ResponsesTools) -> ToolCall:
    """A function_call / custom_tool_call item as the chat's tool call, under the model's name."""
    if kind == "custom_tool_call":
        custom = validate(CustomCallItem, raw, path)
        name, namespace, call_id = custom.name, custom.namespace, custom.call_id
        arguments = json.dumps({CUSTOM_INPUT: custom.input or ""}, ensure_ascii=False)
    else:
        call = validate(FunctionCallItem, raw, path)
        name, namespace, call_id, arguments = call.name, call.namespace, call.call_id, call.arguments
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": offered.model_name(name, namespace), "arguments": arguments},
    }


def tools_of(request: ResponsesRequest, offered: ResponsesTools) -> tuple[list[dict[str, Any]], bool]:
    """The tools to send and whether to read calls, after `tool_choice`."""
    tools = offered.tools
    choice = request.tool_choice
    plain = plain_tool_choice(choice, tools)
    if plain is not None:
        return plain
    if isinstance(choice, dict):
        chosen = validate(NamedChoice, choice, "tool_choice")
        kind = chosen.type
        if kind in ("function", "custom"):
            name = validate(ChosenTool, choice, "tool_choice").name
            return only_tool(tools, offered.find(name) or name, "tool_choice"), True
        if kind == "allowed_tools":
            listed = validate(AllowedTools, choice, "tool_choice").tools
            names = {offered.find(str(item.get("name"))) for item in listed if isinstance(item, dict)}
            narrowed = [tool for tool in tools if tool["function"]["name"] in names]
            return narrowed, bool(narrowed)
        raise bad_request(f"tool_choice of type {kind!r} is not supported", "tool_choice")
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")


def _message_item(reply: Reply, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": new_id("msg_"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}],
    }


def output_items(reply: Reply, offered: ResponsesTools) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reply.content or not reply.calls:
        items.append(_message_item(reply, "incomplete" if reply.finish == "length" else "completed"))
    items += [offered.output_item(call) for call in reply.calls]
    return items


def _usage(reply: Reply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def response_object(
    reply: Reply | None, *, request: Mapping[str, Any], offered: ResponsesTools, model: str, response_id: str
) -> dict[str, Any]:
    """The response; `reply` None: as it is before the reply (in progress, no output)."""
    output = output_items(reply, offered) if reply is not None else []
    status = "in_progress" if reply is None else "incomplete" if reply.finish == "length" else "completed"
    tools = request.get("tools") or []
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": model,
        "output": output,
        "output_text": reply.content if reply is not None else "",
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "store": False,
        "temperature": request.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": tools,
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": _usage(reply) if reply is not None else None,
        "metadata": request.get("metadata") or {},
    }


def response_events(reply: Reply, *, request: Mapping[str, Any], offered: ResponsesTools, model: str) -> list[bytes]:
    """The reply as the Responses API's stream of events."""
    response_id = new_id("resp_")
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append(sse_event({"type": kind, "sequence_number": len(events), **fields}, kind))

    opening = response_object(None, request=request, offered=offered, model=model, response_id=response_id)
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    final = response_object(reply, request=request, offered=offered, model=model, response_id=response_id)
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            emit(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            )
            emit("response.content_part.added", **ids, part={**part, "text": ""})
            if part["text"]:
                emit("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **ids, text=part["text"], logprobs=[])
            emit("response.content_part.done", **ids, part=part)
        elif item["type"] == "custom_tool_call":
            ids = {"item_id": item["id"], "output_index": index}
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "input": ""})
            emit("response.custom_tool_call_input.delta", **ids, delta=item["input"])
            emit("response.custom_tool_call_input.done", **ids, input=item["input"])
        else:
            ids = {"item_id": item["id"], "output_index": index}
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            emit("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    return events


async def handle_responses(turns: ChatTurns, body: dict[str, Any]) -> HttpResponse:
    for stateful in ("previous_response_id", "conversation"):  # before the rest: what to fix first
        if body.get(stateful) is not None:
            raise bad_request(f"{stateful}: {STATELESS}", stateful)
    request = validate(ResponsesRequest, body)
    if request.background:
        raise bad_request(f"background: {STATELESS}", "background")
    if request.prompt is not None:
        raise bad_request("prompt: stored prompt templates are not supported", "prompt")
    offered = ResponsesTools.read(request.tools)
    messages = messages_of(request, offered)
    tools, parse_calls = tools_of(request, offered)
    turns.left_out(offered.left_out)
    sampling = sampling_for(
        turns.default_sampling,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=None,
        template_kwargs=request.chat_template_kwargs,
    )
    model = request.model or turns.model
    reply = await turns.run(messages, tools, sampling, parse_calls=parse_calls)
    if request.stream:
        return sse_response(response_events(reply, request=body, offered=offered, model=model))
    answer = response_object(reply, request=body, offered=offered, model=model, response_id=new_id("resp_"))
    return json_response(200, answer)
