"""What the gateway's protocols share: the request's JSON, one turn on the job's chat, the reply.

Every protocol module turns its request into the messages, tools and sampling
of one `ChatFn` call (OpenAI chat form: roles system/user/assistant/tool,
assistant `tool_calls`, tool messages with `tool_call_id` and `name`), runs it
through `ChatTurns.run` and writes the `Reply` back in its own shapes.

Replies and history. A program sends the whole conversation on every call,
including the replies the gateway gave it, but in the provider's shapes: a
reply whose tool calls were written in the model's text comes back as the
text without the calls' markup plus structured calls. The job's chat should
see its own reply as it was sampled (a token backend refuses a history that
was rewritten; the built-in loop keeps the text as sampled too), so
`ChatTurns` remembers the sampled text of each reply whose calls it read from
the text, by call id, and puts it back as the assistant message's content
(with the program's `tool_calls`, whose ids its tool results name). Replies
with structured calls come back as they were given: nothing to put back. Tool
results go to the chat as `tool` messages, named after their calls; a
template without a tool role is the chat's business. This memory is per
gateway (per job) and bounded; it is not a recording: the job's `chat`
records.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prorl_server.llm.base import ChatFn, ChatMessage, ChatResult, Sampling
from prorl_server.llm.tool_calls import ParsedCall, from_api, parse_text, text_without_calls
from prorl_server.sandbox.runtime.relay import HttpResponse


class GatewayError(Exception):
    """A request the gateway answers with an error: each protocol writes it in its provider's format.

    `kind` is one of: invalid_request, authentication, permission, not_found, method_not_allowed,
    rate_limit, too_large, context_length, unavailable, api_error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


# ---------------------------------------------------------------------------------------------
# Request fields


def parse_body(body: bytes) -> dict[str, Any]:
    """The request's JSON object; 400 when the body is not one."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {kind_of(data)}")
    return data


def kind_of(value: Any) -> str:
    """How an error names a JSON value's type ("a string", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def sampling_for(
    default: Sampling,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    stop: tuple[str, ...] | None,
    seed: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Sampling:
    """The job's sampling with what the request sets over it."""
    return replace(
        default,
        max_tokens=default.max_tokens if max_tokens is None else max_tokens,
        temperature=default.temperature if temperature is None else temperature,
        top_p=default.top_p if top_p is None else top_p,
        stop=default.stop if stop is None else stop,
        seed=default.seed if seed is None else seed,
        chat_template_kwargs={**default.chat_template_kwargs, **(template_kwargs or {})},
    )


TEXT_PART_TYPES = ("text", "input_text", "output_text")


def text_of(content: Any, path: str) -> str:
    """A message's text: a string, or a list of text parts joined with newlines (as vLLM joins them).
    Any other part (images, audio, files) is refused, naming it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{path} must be a string or an array of content parts, not {kind_of(content)}", path)
    texts: list[str] = []
    for index, part in enumerate(content):
        where = f"{path}[{index}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{where} must be an object, not {kind_of(part)}", where)
        kind = part.get("type")
        if kind in TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.text must be a string, not {kind_of(text)}", f"{where}.text")
            texts.append(text)
        elif kind == "refusal":
            continue
        else:
            raise bad_request(
                f"{where} is a {kind!r} part: this gateway takes text only (text parts); "
                "images, audio and files are not supported",
                where,
            )
    return "\n".join(texts)


def function_tool(name: str, description: str | None, parameters: Any, path: str) -> dict[str, Any]:
    """A tool in the form the job's chat takes (OpenAI's `tools` entry)."""
    if not name:
        raise bad_request(f"{path}: a tool needs a name", path)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{path}: the parameters schema must be an object, not {kind_of(parameters)}", path)
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def plain_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool] | None:
    """(tools to send, whether to read calls) for an OpenAI `tool_choice` given as absent, "auto",
    "none" or "required" (both OpenAI APIs); None for the other forms, which each API reads."""
    if choice is None or choice == "auto":
        return tools, bool(tools)
    if choice == "none":
        return [], False
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice is 'required' but the request has no tools", "tool_choice")
        return tools, True
    return None


def only_tool(tools: list[dict[str, Any]], name: str, path: str) -> list[dict[str, Any]]:
    """The tools narrowed to the one a tool_choice names."""
    chosen = [tool for tool in tools if tool["function"]["name"] == name]
    if not chosen:
        raise bad_request(f"{path} names the tool {name!r}, which is not among the request's tools", path)
    return chosen


# ---------------------------------------------------------------------------------------------
# Replies


@dataclass(frozen=True)
class ReplyCall:
    id: str
    name: str
    arguments_json: str
    arguments: dict[str, Any]
    """The decoded arguments ({} when a structured call's arguments are not a JSON object)."""


@dataclass(frozen=True)
class Reply:
    """One model turn as the protocols write it."""

    content: str
    """The text the program sees: the sampled text without the tool calls read from it."""
    calls: tuple[ReplyCall, ...]
    finish: str
    """"stop", "length" or "tool_calls"."""
    prompt_tokens: int
    completion_tokens: int


def read_reply(result: ChatResult, *, parse_calls: bool, id_prefix: str) -> Reply:
    """The reply's text and tool calls: the backend's structured calls, else (when the request offered
    tools) the calls written in the text in the backend's format. A reply with a call that cannot be
    read (unknown layout, arguments that are not JSON) is given as text, whole, with no calls: the
    program sees what the model wrote."""
    parsed: list[ParsedCall] = []
    content = result.text
    if result.tool_calls:
        parsed = from_api(result.tool_calls)
    elif parse_calls:
        found = parse_text(result.text, result.tool_call_parser or "hermes", id_prefix=id_prefix)
        if found and all(call.error is None and call.name for call in found):
            parsed = found
            content = text_without_calls(result.text, result.tool_call_parser)
    calls = tuple(ReplyCall(c.id, c.name, c.arguments_json, c.arguments) for c in parsed)
    finish = "tool_calls" if calls else "length" if result.finish_reason == "length" else "stop"
    return Reply(content, calls, finish, result.prompt_tokens, result.completion_tokens)


class ChatTurns:
    """The job's chat as the protocols call it: the history's replies put back as sampled, the reply
    read, the reply remembered (see the module docstring)."""

    def __init__(
        self,
        chat: ChatFn,
        *,
        model: str,
        default_sampling: Sampling,
        remembered_calls: int = 4096,
        on_left_out: Callable[[Sequence[str]], None] | None = None,
    ) -> None:
        """`on_left_out(kinds)` is told, per call, of the tools the request offered that the gateway
        cannot run and so left out of what the model sees (hosted web search, ...): the job's record."""
        self.chat = chat
        self.model = model
        self.default_sampling = default_sampling
        self.on_left_out = on_left_out
        self._sampled: OrderedDict[str, str] = OrderedDict()
        """Per call id written in a reply's text: the reply's text as sampled."""
        self._capacity = remembered_calls

    async def run(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
        *,
        parse_calls: bool,
    ) -> Reply:
        if not messages:
            raise bad_request("the conversation has no messages", "messages")
        history = self.restore(messages)
        result = await self.chat(history, list(tools), sampling)
        reply = read_reply(result, parse_calls=parse_calls, id_prefix=secrets.token_hex(3))
        self._remember(result, reply)
        return reply

    def left_out(self, kinds: Sequence[str]) -> None:
        """Record the tools of one call that were left out of what the model sees (see __init__)."""
        if kinds and self.on_left_out is not None:
            self.on_left_out(list(kinds))

    def _remember(self, result: ChatResult, reply: Reply) -> None:
        if not reply.calls or result.tool_calls:
            return  # structured calls come back with the text as it was given: nothing to put back
        for call in reply.calls:
            self._sampled[call.id] = result.text
            self._sampled.move_to_end(call.id)
        while len(self._sampled) > self._capacity:
            self._sampled.popitem(last=False)

    def restore(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        """The history with this gateway's replies' text as sampled, tool messages named after their calls.

        A reply is put back when the program's copy has one of its call ids and its text is part of
        the sampled text (the gateway only took the calls' markup out); a copy the program edited
        stays as the program sent it."""
        history: list[ChatMessage] = []
        names: dict[str, str] = {}
        for message in messages:
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls"):
                ids = [str(call.get("id")) for call in message["tool_calls"]]
                sampled = next((self._sampled[i] for i in ids if i in self._sampled), None)
                if sampled is not None and str(message.get("content") or "").strip() in sampled:
                    message = {**message, "content": sampled}
                for call in message["tool_calls"]:
                    names[str(call.get("id"))] = str(call["function"]["name"])
            elif role == "tool" and "name" not in message and message.get("tool_call_id") in names:
                call_id = str(message["tool_call_id"])
                message = {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": names[call_id],
                    "content": message.get("content") or "",
                }
            history.append(message)
        return history


# ---------------------------------------------------------------------------------------------
# Responses


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_response(status: int, value: Any, headers: Mapping[str, str] | None = None) -> HttpResponse:
    return HttpResponse(
        status, {"content-type": "application/json", **(headers or {})}, json.dumps(value).encode("utf-8")
    )


def sse_event(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: `event:` (when named) and `data:` lines."""
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else dumps(data)
    return f"{head}data: {payload}\n\n".encode()


async def _pieces(events: Sequence[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def sse_response(events: Sequence[bytes]) -> HttpResponse:
    """A stream of server-sent events, relayed event by event. The turn is complete before the stream
    starts (the job's chat gives whole replies), so an error is always a status, never mid-stream."""
    headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
    return HttpResponse(200, headers, _pieces(list(events)))
