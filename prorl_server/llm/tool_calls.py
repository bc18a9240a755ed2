"""Reading tool calls from a model reply.

Two sources: the API's structured `tool_calls`, or calls written in the
reply's text in the served model's own format, chosen per backend like
vLLM's `--tool-call-parser`:

- `hermes` (Qwen2.5/3, Hermes, SmolLM2): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- `llama3_json` (Llama 3.1/3.2/3.3): `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`
- `mistral` (v0.3, Nemo, Small): `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or
  `[TOOL_CALLS]name[ARGS]{...}` (newer tokenizers)
- `pythonic` (Llama 3.2/4 pythonic, Gemma): `[name(arg=1, other="x"), ...]`
- `deepseek_v3` (DeepSeek V3/R1): DeepSeek's tool-call tokens around `function`, the name and a
  fenced json block
- `openai` (gpt-oss, harmony): `... to=functions.name ... <|message|>{...}`
- `kimi_k2` (Kimi K2): `<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}`
- `deepseek_v31` (DeepSeek V3.1): DeepSeek's tool-call tokens around the name and the JSON arguments
  (no `function` type, no fence)
- `glm4` (GLM-4-9B-Chat, GLM-4-0414): the name on its own line, then the JSON arguments
  (`name\n{...}`; the model then samples `<|observation|>`)
- `glm45` (GLM-4.5, GLM-4.6): `<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>`
- `cohere` (Command R, Command R+ tool use): `Action:` and a JSON list of
  `{"tool_name": ..., "parameters": {...}}`, in a json fence
- `granite` (IBM Granite 3.x): `<|tool_call|>[{"name": ..., "arguments": {...}}]`

A call that starts in the format but cannot be read is kept with an `error`
that tells the model what was wrong (a format error: it counts in the
result, so a silently unparsed format cannot train a run on garbage).
Text-parsed call ids are 9 alphanumerics (Mistral's templates require it).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prorl_server.llm.base import TOOL_CALL_PARSERS, ApiToolCall


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str
    from_api: bool
    error: str | None = None


# DeepSeek's tool-call tokens are written with fullwidth bars and "lower one eighth block" spaces.
_DS_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_DS_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
_DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
_DS_SEP = "<\uff5ctool\u2581sep\uff5c>"

FORMAT_HINTS = {
    "hermes": 'Write each call as <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>.',
    "llama3_json": 'Write a call as a JSON object: {"name": "TOOL", "parameters": {...}}.',
    "mistral": 'Write calls as [TOOL_CALLS][{"name": "TOOL", "arguments": {...}}].',
    "pythonic": 'Write calls as a Python list of calls: [TOOL(argument="value")].',
    "deepseek_v3": f"Write calls as {_DS_CALLS_BEGIN}{_DS_CALL_BEGIN}function{_DS_SEP}TOOL\\n"
    f"```json\\n{{...}}\\n```{_DS_CALL_END}{_DS_CALLS_END}.",
    "openai": "Call a tool on the commentary channel: to=functions.TOOL <|constrain|>json<|message|>{...}.",
    "kimi_k2": "Write calls as <|tool_calls_section_begin|><|tool_call_begin|>functions.TOOL:0"
    "<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>.",
    "deepseek_v31": f"Write calls as {_DS_CALLS_BEGIN}{_DS_CALL_BEGIN}TOOL{_DS_SEP}{{...}}"
    f"{_DS_CALL_END}{_DS_CALLS_END}.",
    "glm4": "Write a call as the tool's name on a line of its own, then its arguments as a JSON object: TOOL\\n{...}.",
    "glm45": "Write each call as <tool_call>TOOL\\n<arg_key>ARGUMENT</arg_key>\\n<arg_value>VALUE</arg_value>"
    "\\n</tool_call>.",
    "cohere": 'Write Action: and a JSON list of calls: Action:\\n```json\\n[{"tool_name": "TOOL", "parameters": {...}}]'
    "\\n```.",
    "granite": 'Write calls as <|tool_call|>[{"name": "TOOL", "arguments": {...}}].',
}
FORMAT_HINT = FORMAT_HINTS["hermes"]


def format_hint(parser: str) -> str:
    return FORMAT_HINTS.get(parser or "hermes", FORMAT_HINT)


def call_id(prefix: str, index: int) -> str:
    """A 9-character alphanumeric id (Mistral's templates refuse any other)."""
    base = re.sub(r"[^A-Za-z0-9]", "", prefix)[:6] + "c"
    return base + str(index).rjust(9 - len(base), "0")


def _decode_arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(raw, dict):
        return raw, None
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f"the arguments are not valid JSON ({exc.msg} at position {exc.pos})"
        if isinstance(value, dict):
            return value, None
    return None, 'the arguments must be a JSON object, e.g. {"code": "print(1)"}'


def from_api(calls: tuple[ApiToolCall, ...]) -> list[ParsedCall]:
    parsed = []
    for call in calls:
        arguments, error = _decode_arguments(call.arguments_json)
        parsed.append(ParsedCall(call.id, call.name, arguments or {}, call.arguments_json, from_api=True, error=error))
    return parsed


class _Calls:
    """Collects the calls of one reply with their ids."""

    def __init__(self, prefix: str, parser: str) -> None:
        self.prefix = prefix
        self.hint = format_hint(parser)
        self.calls: list[ParsedCall] = []

    def bad(self, raw: str, problem: str) -> None:
        self.calls.append(ParsedCall(self._id(), "", {}, raw, False, f"{problem}. {self.hint}"))

    def add(self, name: Any, raw_arguments: Any) -> None:
        if not isinstance(name, str) or not name:
            self.bad(
                json.dumps(raw_arguments) if not isinstance(raw_arguments, str) else raw_arguments,
                "the call has no name",
            )
            return
        arguments, error = _decode_arguments(raw_arguments)
        arguments_json = raw_arguments if isinstance(raw_arguments, str) else json.dumps(raw_arguments)
        error = f"{error}. {self.hint}" if error else None
        self.calls.append(ParsedCall(self._id(), name, arguments or {}, arguments_json, False, error))

    def add_object(
        self,
        value: Any,
        raw: str,
        *,
        name_key: str = "name",
        arguments_keys: tuple[str, ...] = ("arguments", "parameters"),
        what: str = "tool call",
    ) -> None:
        if not isinstance(value, dict) or not isinstance(value.get(name_key), str):
            self.bad(raw, f'the {what} has no "{name_key}"')
            return
        raw_arguments: Any = next((value[key] for key in arguments_keys if key in value), {})
        self.add(value[name_key], raw_arguments)

    def add_objects(self, value: Any, **keys: Any) -> None:
        """Each call of a JSON list of call objects (or the one object)."""
        for item in value if isinstance(value, list) else [value]:
            self.add_object(item, json.dumps(item), **keys)

    def json_at(self, text: str, what: str) -> tuple[bool, Any]:
        """(True, the JSON value at the start of `text`), or (False, None) with a format error
        saying that `what` is not valid JSON."""
        try:
            value, _ = _json_prefix(text)
        except json.JSONDecodeError as exc:
            self.bad(text.strip(), f"{what} ({exc.msg})")
            return False, None
        return True, value

    def _id(self) -> str:
        return call_id(self.prefix, len(self.calls))


def _json_prefix(text: str) -> tuple[Any, int]:
    """The JSON value at the start of `text` (after spaces) and where it ends."""
    stripped = text.lstrip()
    value, end = json.JSONDecoder().raw_decode(stripped)
    return value, end + len(text) - len(stripped)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str, calls: _Calls) -> None:
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.bad(body, f"the tool call is not valid JSON ({exc.msg})")
            continue
        calls.add_object(value, body)


_LLAMA_START = re.compile(r'(?:<\|python_tag\|>\s*)?\{\s*"(?:name|type)"\s*:')


def _llama3_json(text: str, calls: _Calls) -> None:
    position = 0
    while (match := _LLAMA_START.search(text, position)) is not None:
        start = text.index("{", match.start())
        try:
            value, end = _json_prefix(text[start:])
        except json.JSONDecodeError as exc:
            calls.bad(text[start:].strip(), f"the tool call is not valid JSON ({exc.msg})")
            return
        calls.add_object(value, text[start : start + end])
        position = start + end


def _mistral(text: str, calls: _Calls) -> None:
    for chunk in text.split("[TOOL_CALLS]")[1:]:
        body = chunk.strip()
        if body.startswith("["):
            read, value = calls.json_at(body, "the tool calls are not a valid JSON list")
            if read:
                calls.add_objects(value)
            continue
        name, sep, rest = body.partition("[ARGS]")  # the v11+ tokenizer: name[ARGS]{...}
        if not sep:
            calls.bad(body, "the call has no arguments")
            continue
        read, arguments = calls.json_at(rest, "the arguments are not valid JSON")
        if read:
            calls.add(name.split("[CALL_ID]")[0].strip(), arguments)


_PYTHONIC_START = re.compile(r"(?:<\|python_start\|>\s*)?\[\s*[A-Za-z_][\w.]*\s*\(")


def _pythonic(text: str, calls: _Calls) -> None:
    match = _PYTHONIC_START.search(text)
    if match is None:
        return
    start = text.index("[", match.start())
    end = text.rfind("]")
    source = text[start : end + 1] if end > start else text[start:]
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        calls.bad(source, f"the calls are not a valid Python list ({exc.msg})")
        return
    if not isinstance(tree.body, ast.List):
        calls.bad(source, "the calls must be a Python list")
        return
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            calls.bad(ast.unparse(node), "each call must be name(argument=value, ...) with keyword arguments")
            continue
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            calls.bad(ast.unparse(node), "argument values must be literals")
            continue
        calls.add(ast.unparse(node.func), arguments)


_DEEPSEEK = re.compile(
    re.escape(_DS_CALL_BEGIN)
    + r"\w*"
    + re.escape(_DS_SEP)
    + r"([^\n]*)\n```(?:json)?\n(.*?)\n```\s*(?:"
    + re.escape(_DS_CALL_END)
    + "|$)",
    re.DOTALL,
)


def _deepseek_calls(pattern: re.Pattern[str], text: str, calls: _Calls) -> None:
    """Each call in DeepSeek's tokens, `pattern` giving the name and the arguments; one call
    begun but not in the layout makes the whole reply a format error."""
    if _DS_CALL_BEGIN not in text:
        return
    found = list(pattern.finditer(text))
    if len(found) < text.count(_DS_CALL_BEGIN):
        calls.bad(text[text.index(_DS_CALL_BEGIN) :], "a tool call is not in the expected layout")
        return
    for match in found:
        calls.add(match.group(1).strip(), match.group(2).strip())


def _deepseek_v3(text: str, calls: _Calls) -> None:
    _deepseek_calls(_DEEPSEEK, text, calls)


_HARMONY = re.compile(
    r"to=functions\.([\w.-]+)[^<]*?(?:<\|channel\|>[^<]*?)?(?:<\|constrain\|>[^<]*?)?<\|message\|>(.*?)"
    r"(?:<\|call\|>|<\|end\|>|<\|start\|>|<\|channel\|>|$)",
    re.DOTALL,
)


def _openai(text: str, calls: _Calls) -> None:
    for match in _HARMONY.finditer(text):
        calls.add(match.group(1), match.group(2).strip())
    if not calls.calls and "to=functions." in text:
        calls.bad(text[text.index("to=functions.") :], "the tool call has no <|message|> with its arguments")


_KIMI = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)"
    r"(?:<\|tool_call_end\|>|$)",
    re.DOTALL,
)


def _kimi_k2(text: str, calls: _Calls) -> None:
    found = list(_KIMI.finditer(text))
    for match in found:
        calls.add(match.group(1), match.group(2).strip())
    if not found and "<|tool_call_begin|>" in text:
        calls.bad(text[text.index("<|tool_call_begin|>") :], "the tool call has no <|tool_call_argument_begin|>")


_DS31 = re.compile(
    re.escape(_DS_CALL_BEGIN)
    + r"([^\n<]*?)"
    + re.escape(_DS_SEP)
    + r"(.*?)(?:"
    + re.escape(_DS_CALL_END)
    + "|"
    + re.escape(_DS_CALLS_END)
    + "|$)",
    re.DOTALL,
)


def _deepseek_v31(text: str, calls: _Calls) -> None:
    _deepseek_calls(_DS31, text, calls)


_GLM4 = re.compile(r"\A\s*([A-Za-z_][\w.-]*)[ \t]*\n\s*(?=\{)")


def _glm4(text: str, calls: _Calls) -> None:
    match = _GLM4.match(text)
    if match is None:
        return
    read, value = calls.json_at(text[match.end() :], "the arguments are not valid JSON")
    if read:
        calls.add(match.group(1), value)


_GLM45_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45_value(raw: str) -> Any:
    """A value as the template writes it: strings as they are, other values as JSON."""
    stripped = raw.strip()
    if stripped[:1] in ("{", "["):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return raw
    return raw


def _glm45(text: str, calls: _Calls) -> None:
    for chunk in text.split("<tool_call>")[1:]:
        body, closed, _ = chunk.partition("</tool_call>")
        if not closed:
            calls.bad(body.strip(), "the tool call is not closed with </tool_call>")
            continue
        name, _, _ = body.partition("<arg_key>")
        name = name.strip()
        pairs = list(_GLM45_PAIR.finditer(body))
        leftover = _GLM45_PAIR.sub("", body[len(body) - len(body.lstrip()) :])
        if not re.fullmatch(r"[A-Za-z_][\w.-]*", name) or leftover.strip() != name:
            calls.bad(body.strip(), "the tool call is not in the expected layout")
            continue
        calls.add(name, {pair.group(1).strip(): _glm45_value(pair.group(2)) for pair in pairs})


_COHERE = re.compile(r"Action:\s*(?:```(?:json)?\s*)?")


def _cohere(text: str, calls: _Calls) -> None:
    match = _COHERE.search(text)
    if match is None:
        return
    read, value = calls.json_at(text[match.end() :], "the actions are not a valid JSON list")
    if read:
        calls.add_objects(value, name_key="tool_name", arguments_keys=("parameters",), what="action")


def _granite(text: str, calls: _Calls) -> None:
    for chunk in text.split("<|tool_call|>")[1:]:
        read, value = calls.json_at(chunk, "the tool calls are not a valid JSON list")
        if read:
            calls.add_objects(value)


PARSERS: dict[str, Callable[[str, _Calls], None]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "pythonic": _pythonic,
    "deepseek_v3": _deepseek_v3,
    "openai": _openai,
    "kimi_k2": _kimi_k2,
    "deepseek_v31": _deepseek_v31,
    "glm4": _glm4,
    "glm45": _glm45,
    "cohere": _cohere,
    "granite": _granite,
}
assert tuple(PARSERS) == TOOL_CALL_PARSERS


# Where the calls written in a reply are, per format, to cut them off the text a program sees:
# blocks removed wherever they stand, or everything from where the calls start.
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_DS_START = re.compile(re.escape(_DS_CALLS_BEGIN) + "|" + re.escape(_DS_CALL_BEGIN))
_BLOCKS: dict[str, re.Pattern[str]] = {"hermes": _TOOL_CALL_BLOCK, "glm45": _TOOL_CALL_BLOCK}
_STARTS: dict[str, re.Pattern[str]] = {
    "llama3_json": _LLAMA_START,
    "mistral": re.compile(re.escape("[TOOL_CALLS]")),
    "pythonic": _PYTHONIC_START,
    "deepseek_v3": _DS_START,
    "openai": re.compile(r"(?:<\|start\|>[^<]*)?(?:<\|channel\|>[^<]*)?to=functions\."),
    "kimi_k2": re.compile(r"<\|tool_calls_section_begin\|>|<\|tool_call_begin\|>"),
    "deepseek_v31": _DS_START,
    "glm4": _GLM4,
    "cohere": re.compile(r"Action:"),
    "granite": re.compile(re.escape("<|tool_call|>")),
}
assert sorted([*_BLOCKS, *_STARTS]) == sorted(PARSERS)


def text_without_calls(text: str, parser: str = "hermes") -> str:
    """`text` without the tool calls written in it in the format `parser` names ("" = hermes)."""
    parser = parser or "hermes"
    block = _BLOCKS.get(parser)
    if block is not None:
        return block.sub("", text).strip()
    match = _STARTS[parser].search(text)
    return text[: match.start()].strip() if match is not None else text


def parse_text(text: str, parser: str = "hermes", *, id_prefix: str = "call") -> list[ParsedCall]:
    """The calls written in `text` in the format `parser` names ("" = hermes)."""
    calls = _Calls(id_prefix, parser or "hermes")
    PARSERS[parser or "hermes"](text, calls)
    return calls.calls


def from_text(text: str, *, id_prefix: str = "call") -> list[ParsedCall]:
    """Hermes/Qwen-style `<tool_call>` blocks (the default format)."""
    return parse_text(text, "hermes", id_prefix=id_prefix)
