"""The Responses API's tools as the model sees them, and the model's calls as the program expects them.

Real harnesses send more than flat function tools (Codex CLI: a `namespace` of sub-agent
functions on every call, `web_search`, a freeform `apply_patch` on some models):

- `function` tools are offered as they are;
- a `namespace` tool's functions are offered one by one, each under a flat name (`flat_name`:
  the namespace and the function's name joined by `__`, or just appended when the namespace
  already ends in `_`, as MCP namespaces such as `mcp__server__` do), since a model's chat
  template knows no namespaces; a call of such a name goes back to the program as a
  `function_call` with the function's own `name` and its `namespace`, as the Responses API
  writes it, and the program's copy of it in a later `input` is read back the same way;
- a `custom` (freeform) tool is offered as a function of one string argument, `input` (its
  grammar, if any, in the description); a call goes back as a `custom_tool_call` whose `input`
  is that string;
- every other tool type (hosted tools the gateway cannot run: `web_search`, `file_search`,
  `code_interpreter`, `image_generation`, `mcp`, `computer_use_preview`, `local_shell`,
  `tool_search`, ...) is left out of what the model sees: not refused, so a harness that always
  sends them still runs; the types left out are recorded per call (the result's
  `details.gateway.tools_left_out`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prorl_server.gateway.common import Fields, ReplyCall, bad_request, function_tool, new_id

CUSTOM_INPUT = "input"
"""The one argument of a custom (freeform) tool as the model sees it."""


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for function `name` of `namespace` (see the module docstring)."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


@dataclass(frozen=True)
class Offered:
    """One tool as the program named it."""

    kind: str
    """"function" or "custom"."""
    name: str
    namespace: str | None


def _custom_tool(name: str, tool: Fields, path: str) -> dict[str, Any]:
    description = tool.string("description") or ""
    grammar = tool.obj("format")
    if grammar is not None and grammar.string("type") == "grammar":
        syntax, definition = grammar.string("syntax") or "", grammar.string("definition") or ""
        description = f"{description}\n\nThe input follows this {syntax} grammar:\n{definition}".strip()
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "The tool's whole input, as text."}},
        "required": [CUSTOM_INPUT],
    }
    return function_tool(name, description, parameters, path)


@dataclass
class ResponsesTools:
    """A request's tools: what the model is offered, and how to name its calls back."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    """The tools the model sees (the chat's OpenAI function form), under their flat names."""
    offered: dict[str, Offered] = field(default_factory=dict)
    """By the name the model sees."""
    left_out: list[str] = field(default_factory=list)
    """The types of the tools left out (one entry per tool)."""

    @classmethod
    def read(cls, fields: Fields) -> ResponsesTools:
        found = cls()
        for index, value in enumerate(fields.array("tools") or []):
            path = f"tools[{index}]"
            tool = Fields.of(value, path)
            kind = tool.string("type")
            if kind == "function":
                found._add(Offered("function", tool.required_string("name"), None), tool, path)
            elif kind == "custom":
                found._add(Offered("custom", tool.required_string("name"), None), tool, path)
            elif kind == "namespace":
                namespace = tool.required_string("name")
                for inner_index, inner_value in enumerate(tool.array("tools", required=True) or []):
                    inner_path = f"{path}.tools[{inner_index}]"
                    inner = Fields.of(inner_value, inner_path)
                    inner_kind = inner.string("type")
                    if inner_kind not in ("function", "custom"):
                        found.left_out.append(f"{namespace}.{inner_kind}")
                        continue
                    found._add(Offered(inner_kind, inner.required_string("name"), namespace), inner, inner_path)
            else:
                found.left_out.append(str(kind))
        return found

    def _add(self, offered: Offered, tool: Fields, path: str) -> None:
        name = flat_name(offered.namespace, offered.name)
        if name in self.offered:
            raise bad_request(
                f"{path}: two tools would both be offered to the model as {name!r}: give them distinct names", path
            )
        self.offered[name] = offered
        if offered.kind == "custom":
            self.tools.append(_custom_tool(name, tool, path))
        else:
            self.tools.append(function_tool(name, tool.string("description"), tool.get("parameters"), path))

    def model_name(self, name: str, namespace: str | None) -> str:
        """The model's name for a call the program sends back (`name` in `namespace`)."""
        return flat_name(namespace, name)

    def find(self, name: str) -> str | None:
        """The model's name of the tool a `tool_choice` names: its flat name or its own name."""
        if name in self.offered:
            return name
        matches = [flat for flat, offered in self.offered.items() if offered.name == name]
        return matches[0] if len(matches) == 1 else None

    def output_item(self, call: ReplyCall) -> dict[str, Any]:
        """The call as the Responses API writes it, under the program's own names."""
        offered = self.offered.get(call.name, Offered("function", call.name, None))
        if offered.kind == "custom":
            value = call.arguments.get(CUSTOM_INPUT)
            text = value if isinstance(value, str) else json.dumps(call.arguments, ensure_ascii=False)
            item: dict[str, Any] = {
                "type": "custom_tool_call",
                "id": new_id("ctc_"),
                "call_id": call.id,
                "name": offered.name,
                "input": text,
                "status": "completed",
            }
        else:
            item = {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call.id,
                "name": offered.name,
                "arguments": call.arguments_json,
                "status": "completed",
            }
        if offered.namespace is not None:
            item["namespace"] = offered.namespace
        return item
