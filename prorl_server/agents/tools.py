"""Tools an agent can call. bash and python run inside the job's sandbox."""

from __future__ import annotations

import abc
import json
from typing import Any, Protocol

from prorl_server.agents.outcomes import Limits, ToolOutput
from prorl_server.sandbox.base import Sandbox


class ToolContext(Protocol):
    """What a tool may use of its job (RolloutContext is one)."""

    @property
    def sandbox(self) -> Sandbox: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def tool_timeout_s(self) -> float:
        """limits.tool_timeout_s, within what is left of the agent's own time limit if any."""
        ...


class Tool(abc.ABC):
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON Schema of the arguments object."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """A message naming the problem, or None when the arguments fit the schema."""
        properties: dict[str, Any] = self.parameters.get("properties", {})
        for required in self.parameters.get("required", []):
            if required not in arguments:
                example = json.dumps({"name": self.name, "arguments": {required: "..."}})
                return f"{self.name} needs the argument {required!r}, e.g. {example}"
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"{self.name} has no argument(s) {unknown}; it takes {sorted(properties)}"
        for key, spec in properties.items():
            if key in arguments and spec.get("type") == "string" and not isinstance(arguments[key], str):
                return f"{self.name}: argument {key!r} must be a string"
        return None

    @abc.abstractmethod
    async def run(self, ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutput: ...


class BashTool(Tool):
    name = "bash"
    description = "Run a bash command in the sandbox and return its output and exit code."
    parameters = {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The command to run."}},
        "required": ["command"],
    }

    async def run(self, ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        result = await ctx.sandbox.bash(arguments["command"], timeout_s=ctx.tool_timeout_s)
        return ToolOutput(result.output, result.exit_code, result.truncated, duration_s=result.duration_s)


class PythonTool(Tool):
    name = "python"
    description = "Run Python 3 in the sandbox; names persist between calls. print() what you want to see."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python source to run."}},
        "required": ["code"],
    }

    async def run(self, ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        result = await ctx.sandbox.python(arguments["code"], timeout_s=ctx.tool_timeout_s)
        return ToolOutput(result.output, None, result.truncated, duration_s=result.duration_s)


class FinishTool(Tool):
    name = "finish"
    description = "Submit your final answer and end the task."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "The final answer."}},
        "required": ["answer"],
    }

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        if isinstance(arguments.get("answer"), (int, float)):
            arguments["answer"] = str(arguments["answer"])
        return super().check_arguments(arguments)

    async def run(self, ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        answer = arguments.get("answer")
        return ToolOutput(
            output="Answer submitted.", ends_episode=True, answer=answer if isinstance(answer, str) else None
        )


class EditorTool(Tool):
    """The str_replace file editor of the sandbox runtime, under the name
    SWE agents are trained with."""

    name = "str_replace_editor"
    description = (
        "View, create and edit files. view shows a file with line numbers (or lists a directory); "
        "create writes a new file; str_replace replaces one exact, unique occurrence of old_str with new_str; "
        "insert adds new_str after line insert_line; undo_edit reverts the last edit of a file."
    )
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string", "description": "Absolute path of the file or directory."},
            "file_text": {"type": "string", "description": "create: the content of the new file."},
            "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
            "new_str": {"type": "string", "description": "str_replace and insert: the new text."},
            "insert_line": {"type": "integer", "description": "insert: the line after which to insert (0: top)."},
            "view_range": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "view: [first, last] lines; -1 as last means the end of the file.",
            },
        },
        "required": ["command", "path"],
    }
    _RUNTIME_COMMANDS = {"undo_edit": "undo"}

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        problem = super().check_arguments(arguments)
        if problem:
            return problem
        allowed = self.parameters["properties"]["command"]["enum"]
        if arguments["command"] not in allowed:
            return f"{self.name}: command must be one of {allowed}, got {arguments['command']!r}"
        return None

    async def run(self, ctx: ToolContext, arguments: dict[str, Any]) -> ToolOutput:
        params = {k: v for k, v in arguments.items() if k not in ("command", "path")}
        command = self._RUNTIME_COMMANDS.get(arguments["command"], arguments["command"])
        result = await ctx.sandbox.edit(command, arguments["path"], **params)
        return ToolOutput(result.output, None, result.truncated, duration_s=result.duration_s)
