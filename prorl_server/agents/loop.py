"""The multi-turn tool-calling loop shared by every task family."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prorl_server.agents.base import AgentHandler, RolloutContext
from prorl_server.agents.tool_calls import FORMAT_HINT, ParsedCall, from_api, from_text
from prorl_server.agents.tools import Tool, ToolOutput
from prorl_server.errors import ContextLengthExceeded


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


def _observation(call: ParsedCall, output: ToolOutput) -> dict[str, str]:
    text = output.output
    if output.exit_code is not None:
        text = f"{text.rstrip()}\n[exit code {output.exit_code}]"
    if call.from_api:
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


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
        calls = from_api(result.tool_calls) if result.tool_calls else from_text(result.text, id_prefix=f"t{turn}")
        assistant: dict[str, object] = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            assistant["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in result.tool_calls
            ]
        recorder.add_message(assistant)
        if not calls:
            recorder.format_errors += 1
            recorder.add_message(
                {"role": "user", "content": f"No tool call found. {FORMAT_HINT} Call finish with your answer."}
            )
            continue
        for call in calls:
            recorder.tool_call(turn, call)
            output = await _call_tool(ctx, by_name, call)
            recorder.tool_result(turn, call, output)
            recorder.add_message(_observation(call, output))
            if ctx.state.get("finished"):
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
