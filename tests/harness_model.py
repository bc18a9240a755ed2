"""A scripted model for the coding-agent CLIs of localhost/prorl-harnesses (tests/integration/test_harnesses.py).

The fake vLLM hands the script each prompt as token ids; decoded, it is the
conversation rendered by Qwen2.5's chat template, tools included (`<tools>`,
one JSON schema a line). The script reads which tools the harness offers and
their parameters from there, so one plan drives every harness through its own
tools: its shell tool, its read tool and its edit tool (Codex has none: it edits
with `apply_patch`, run through its shell tool). A reply is the step of the plan
that the count of assistant turns in the prompt says, its calls in the hermes
`<tool_call>` format the gateway reads; a call that offers no tools (a title or a
summary the harness asks for on the side) gets a line of plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QWEN25_TEMPLATE = (
    Path(__file__).resolve().parent / "data" / "chat_templates" / "Qwen--Qwen2.5-7B-Instruct.jinja"
).read_text()

# A tool the plan calls: ("shell", command), ("read", path), ("edit", (path, old, new)) or ("patch", codex_patch).
Call = tuple[str, Any]
Step = list[Call] | str


@dataclass(frozen=True)
class Harness:
    """One CLI: how a job runs it, and the names of its tools."""

    name: str
    argv: list[str]
    shell: str
    read: str | None
    edit: str | None


def tools_in(prompt: str) -> dict[str, dict[str, Any]]:
    """The tools of a rendered prompt: name -> JSON-schema parameters."""
    match = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.DOTALL)
    tools: dict[str, dict[str, Any]] = {}
    for line in match.group(1).splitlines() if match else []:
        spec = json.loads(line)
        function = spec.get("function", spec)
        tools[function["name"]] = function.get("parameters") or {}
    return tools


def _properties(schema: dict[str, Any]) -> list[str]:
    return list((schema.get("properties") or {}).keys())


def _pick(schema: dict[str, Any], *words: str) -> str:
    """The parameter whose name holds all of `words` (case-insensitive), e.g. file_path, filePath, absolute_path."""
    for name in _properties(schema):
        if all(word in name.lower() for word in words):
            return name
    raise AssertionError(f"no parameter with {words} among {_properties(schema)}")


def arguments(harness: Harness, tools: dict[str, dict[str, Any]], call: Call) -> tuple[str, dict[str, Any]]:
    """The tool name and arguments of one planned call, in the harness's own parameter names; any other
    required text parameter (Gemini CLI's `instruction`, a `description`) gets a line saying what the call does."""
    name, args = _arguments(harness, tools, call)
    schema = tools[name]
    for required in schema.get("required") or []:
        if required not in args and (schema.get("properties") or {}).get(required, {}).get("type") == "string":
            args[required] = f"{call[0]} as planned"
    return name, args


def _arguments(harness: Harness, tools: dict[str, dict[str, Any]], call: Call) -> tuple[str, dict[str, Any]]:
    kind, value = call
    if kind in ("shell", "patch"):
        schema = tools[harness.shell]
        command = value if kind == "shell" else f"apply_patch <<'PRORL_PATCH'\n{value}PRORL_PATCH"
        names = _properties(schema)
        key = "command" if "command" in names else _pick(schema, "cmd")
        args: dict[str, Any] = {key: command}
        if "description" in names:
            args["description"] = "run a command"
        return harness.shell, args
    if kind == "read":
        assert harness.read is not None
        return harness.read, {_pick(tools[harness.read], "path"): value}
    assert kind == "edit" and harness.edit is not None
    path, old, new = value
    schema = tools[harness.edit]
    return harness.edit, {_pick(schema, "path"): path, _pick(schema, "old"): old, _pick(schema, "new"): new}


def reply_for(harness: Harness, plan: list[Step], prompt: str) -> str:
    tools = tools_in(prompt)
    if not tools:
        return "Working on the task"
    step = plan[min(prompt.count("<|im_start|>assistant") - 1, len(plan) - 1)]
    if isinstance(step, str):
        return step
    calls = []
    for call in step:
        name, args = arguments(harness, tools, call)
        calls.append(f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>")
    return "\n".join(calls)


def script(harness: Harness, plan: list[Step], decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """The fake vLLM's script: decode the prompt (special tokens kept) and reply with the plan's step."""
    return lambda prompt: reply_for(harness, plan, decode(prompt))


def shell_plan() -> list[Step]:
    """A shell call, then two at once (parallel calls), then the answer on its own last line. No `$(...)`
    or `$((...))`: Qwen Code refuses a command with one as an injection."""
    return [
        [("shell", "expr 6 \\* 7")],
        [("shell", "expr 111 + 222"), ("shell", "expr 444 + 555")],
        "The command printed it.\n42",
    ]


def hunks(patch: str) -> list[tuple[str, str, str]]:
    """A unified diff as edits: (path, old text, new text) per hunk, each the hunk's lines without the last newline."""
    edits: list[tuple[str, str, str]] = []
    path = ""
    old: list[str] | None = None
    new: list[str] = []
    for line in [*patch.splitlines(), "@@ end"]:
        if line.startswith(("@@", "diff --git")) and old is not None:
            edits.append((path, "\n".join(old), "\n".join(new)))
            old = None
        if line.startswith("+++ b/"):
            path = line[len("+++ b/") :]
        elif line.startswith("@@"):
            old, new = [], []
        elif old is not None and line[:1] in (" ", "-", "+"):
            if line[0] != "+":
                old.append(line[1:])
            if line[0] != "-":
                new.append(line[1:])
    return edits


def codex_patch(patch: str) -> str:
    """A unified diff in apply_patch's own format (`*** Update File:`, `@@` and the hunk's lines)."""
    out = ["*** Begin Patch"]
    for line in patch.splitlines():
        if line.startswith("+++ b/"):
            out.append(f"*** Update File: {line[len('+++ b/') :]}")
        elif line.startswith("@@"):
            out.append("@@")
        elif line[:1] in (" ", "-", "+") and not line.startswith(("--- ", "+++ ")):
            out.append(line)
    return "\n".join([*out, "*** End Patch"]) + "\n"


def swe_plan(harness: Harness, patch: str, workdir: str, *, right: bool) -> list[Step]:
    """Read each file the fix touches, change it with the harness's edit tool (the gold hunks, or for `right`
    False the first hunk's old text with a comment added, which fixes nothing), then say it is done."""
    edits = hunks(patch)
    if not right:
        path, old, _ = edits[0]
        edits = [(path, old, old + "  # not the fix")]
    steps: list[Step] = []
    if harness.edit is None:
        wrong = "".join(
            f"*** Begin Patch\n*** Update File: {path}\n@@\n"
            + "".join(f"-{line}\n" for line in old.splitlines())
            + "".join(f"+{line}\n" for line in new.splitlines())
            + "*** End Patch\n"
            for path, old, new in edits
        )
        steps.append([("patch", codex_patch(patch) if right else wrong)])
    else:
        if harness.read is not None:
            steps.append([("read", f"{workdir}/{path}") for path in dict.fromkeys(path for path, _, _ in edits)])
        steps.extend([("edit", (f"{workdir}/{path}", old, new))] for path, old, new in edits)
    steps.append("The fix is in place.")
    return steps
