"""The multi-turn tool-calling loop shared by every task family."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prorl_server.agents.base import AgentHandler, RolloutContext
from prorl_server.agents.tool_calls import ParsedCall, format_hint, from_api, parse_text
from prorl_server.agents.tools import Tool, ToolOutput
from prorl_server.errors import ContextLengthExceeded
from prorl_server.llm.base import ChatResult


@dataclass(frozen=True)
class LoopOutcome:
    stop_reason: str
    """"finish" (the agent called finish), "max_turns", or "context_length" (the
    conversation outgrew the model's context: a policy outcome, evaluated as usual)."""


def describe_tools(tools: Sequence[Tool]) -> str:
    """Tool descriptions for the system prompt, for backends without tool support."""
    lines = [json.dumps(tool.schema()["function"]) for tool in tools]
    return "\n".join(lines)


async def _call_tool(ctx: RolloutContext, tools: dict[str, Tool], call: ParsedCall) -> ToolOutput:
    if call.error:
        return ToolOutput(output=f"Error: {call.error}", error=True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolOutput(
            output=f"Error: there is no tool {call.name!r}. Available tools: {', '.join(sorted(tools))}.",
            error=True,
        )
    problem = tool.check_arguments(call.arguments)
    if problem:
        return ToolOutput(output=f"Error: {problem}", error=True)
    started = time.perf_counter()
    output = await tool.run(ctx, call.arguments)
    if not output.duration_s:
        output = ToolOutput(
            output.output, output.exit_code, output.truncated, output.error, time.perf_counter() - started
        )
    return output


def _observation_text(output: ToolOutput) -> str:
    text = output.output
    if output.exit_code is not None:
        text = f"{text.rstrip()}\n[exit code {output.exit_code}]"
    return text


def _assistant(result: ChatResult, calls: list[ParsedCall], tool_role: bool) -> dict[str, object]:
    """The reply as a message; its calls as `tool_calls` when results go back in the `tool` role."""
    message: dict[str, object] = {"role": "assistant", "content": result.text}
    listed = [c for c in calls if c.from_api or (tool_role and c.name)]
    if listed:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in listed
        ]
    return message


async def run_tool_loop(
    ctx: RolloutContext, *, system_prompt: str, user_prompt: str, tools: Sequence[Tool]
) -> LoopOutcome:
    recorder = ctx.recorder
    by_name = {tool.name: tool for tool in tools}
    schemas = [tool.schema() for tool in tools]
    recorder.add_message({"role": "system", "content": system_prompt})
    recorder.add_message({"role": "user", "content": user_prompt})
    for turn in range(ctx.limits.max_turns):
        try:
            result = await ctx.chat(list(recorder.messages), schemas, ctx.sampling)
        except ContextLengthExceeded:
            return LoopOutcome("context_length")
        recorder.model_turn(turn, result)
        parser = result.tool_call_parser or "hermes"
        if result.tool_calls:
            calls = from_api(result.tool_calls)
        else:
            calls = parse_text(result.text, parser, id_prefix=f"t{turn}")
        # Results go back in the `tool` role when the template renders one (the format the model
        # was trained on); otherwise, and for calls without a name, as one user message per turn.
        tool_role = bool(result.tool_calls) or result.tool_role
        recorder.add_message(_assistant(result, calls, tool_role))
        if not calls:
            recorder.format_errors += 1
            recorder.add_message(
                {"role": "user", "content": f"No tool call found. {format_hint(parser)} Call finish with your answer."}
            )
            continue
        as_user: list[str] = []
        finished = False
        for call in calls:
            recorder.tool_call(turn, call)
            output = await _call_tool(ctx, by_name, call)
            output = recorder.tool_result(turn, call, output)  # as the trajectory keeps it (bounded)
            text = _observation_text(output)
            if call.from_api or (tool_role and call.name):
                recorder.add_message({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
            else:
                as_user.append(f"<tool_response>\n{text}\n</tool_response>")
            if ctx.state.get("finished"):
                finished = True
                break
        if as_user:
            recorder.add_message({"role": "user", "content": "\n".join(as_user)})
        if finished:
            return LoopOutcome("finish")
    return LoopOutcome("max_turns")


class ToolLoopHandler(AgentHandler):
    """A family whose agent is the shared tool loop in one sandbox.

    Subclasses give `tools`, `system_prompt` (with a `{tools}` placeholder),
    `user_prompt(instance)`, `validate` and `evaluate`.
    """

    system_prompt: str = "{tools}"
    tools: Sequence[Tool] = ()

    def user_prompt(self, instance: dict[str, Any]) -> str:
        raise NotImplementedError

    async def init(self, ctx: RolloutContext) -> None:
        await ctx.open_sandbox()

    async def run(self, ctx: RolloutContext) -> None:
        outcome = await run_tool_loop(
            ctx,
            system_prompt=self.system_prompt.format(tools=describe_tools(self.tools)),
            user_prompt=self.user_prompt(ctx.instance),
            tools=self.tools,
        )
        ctx.state["stop_reason"] = outcome.stop_reason
