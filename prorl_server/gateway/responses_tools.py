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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_server.gateway.bodies import validate
from prorl_server.gateway.bodies.openai_responses import CustomTool, FunctionTool, NamespaceTool, ToolEntry
from prorl_server.gateway.common import ReplyCall, bad_request, function_tool, new_id

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


def _custom_tool(name: str, tool: CustomTool, path: str) -> dict[str, Any]:
    description = tool.description or ""
    grammar = tool.format
    if grammar is not None and grammar.type == "grammar":
        syntax, definition = grammar.syntax or "", grammar.definition or ""
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
    def read(cls, entries: Sequence[ToolEntry] | None) -> ResponsesTools:
        """The request's `tools` (each entry's own fields read after its type)."""
        found = cls()
        for index, entry in enumerate(entries or []):
            path = f"tools[{index}]"
            if entry.type in ("function", "custom"):
                found._add(entry, None, path)
            elif entry.type == "namespace":
                namespace = validate(NamespaceTool, entry.model_extra, path)
                for inner_index, inner in enumerate(namespace.tools):
                    if inner.type not in ("function", "custom"):
                        found.left_out.append(f"{namespace.name}.{inner.type}")
                        continue
                    found._add(inner, namespace.name, f"{path}.tools[{inner_index}]")
            else:
                found.left_out.append(str(entry.type))
        return found

    def _add(self, entry: ToolEntry, namespace: str | None, path: str) -> None:
        if entry.type == "custom":
            custom = validate(CustomTool, entry.model_extra, path)
            self._offer(Offered("custom", custom.name, namespace), path, lambda name: _custom_tool(name, custom, path))
        else:
            function = validate(FunctionTool, entry.model_extra, path)
            self._offer(
                Offered("function", function.name, namespace),
                path,
                lambda name: function_tool(name, function.description, function.parameters, path),
            )

    def _offer(self, offered: Offered, path: str, schema: Callable[[str], dict[str, Any]]) -> None:
        name = flat_name(offered.namespace, offered.name)
        if name in self.offered:
            raise bad_request(
                f"{path}: two tools would both be offered to the model as {name!r}: give them distinct names", path
            )
        self.offered[name] = offered
        self.tools.append(schema(name))

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
