"""The multi-turn tool-calling loop shared by every task family."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any, cast

from prorl_server.agents.base import AgentHandler, InstanceT, OutcomeT, RolloutContext
from prorl_server.agents.outcomes import RunOutcome, ToolOutput
from prorl_server.agents.tools import Tool
from prorl_server.errors import ContextLengthExceeded
from prorl_server.llm.base import ChatMessage, ChatResult
from prorl_server.llm.tool_calls import ParsedCall, format_hint, from_api, parse_text


def describe_tools(tools: Sequence[Tool]) -> str:
    """Tool descriptions for the system prompt, for backends without tool support."""
    lines = [json.dumps(tool.schema()["function"]) for tool in tools]
    return "\n".join(lines)


async def _call_tool(ctx: RolloutContext[Any], tools: dict[str, Tool], call: ParsedCall) -> ToolOutput:
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
        output = dataclasses.replace(output, duration_s=time.perf_counter() - started)
    return output


def _observation_text(output: ToolOutput) -> str:
    text = output.output
    if output.exit_code is not None:
        text = f"{text.rstrip()}\n[exit code {output.exit_code}]"
    return text


def _assistant(result: ChatResult, calls: list[ParsedCall], tool_role: bool) -> ChatMessage:
    """The reply as a message; its calls as `tool_calls` when results go back in the `tool` role."""
    message: ChatMessage = {"role": "assistant", "content": result.text}
    listed = [c for c in calls if c.from_api or (tool_role and c.name)]
    if listed:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in listed
        ]
    return message


async def run_tool_loop(
    ctx: RolloutContext[Any], *, system_prompt: str, user_prompt: str, tools: Sequence[Tool]
) -> RunOutcome:
    """Turns until the agent calls finish, the turn limit, or the model's context is full."""
    recorder = ctx.recorder
    by_name = {tool.name: tool for tool in tools}
    schemas = [tool.schema() for tool in tools]
    branching = ctx.branching
    first = 0
    if branching is not None:  # the sandbox as it starts: what the snapshots are taken against
        await branching.begin(ctx)
    if branching is not None and branching.resume_after is not None:  # a fork: the parent's turns are in
        await branching.resume(ctx)
        first = branching.resume_after + 1
    else:
        recorder.add_message({"role": "system", "content": system_prompt})
        recorder.add_message({"role": "user", "content": user_prompt})

    async def boundary(turn: int) -> None:
        if branching is not None and turn + 1 < ctx.limits.max_turns:
            await branching.boundary(ctx, turn)

    for turn in range(first, ctx.limits.max_turns):
        try:
            result = await ctx.chat(list(recorder.messages), schemas, ctx.sampling)
        except ContextLengthExceeded:
            return RunOutcome("context_length")
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
            await boundary(turn)
            continue
        as_user: list[str] = []
        finished: ToolOutput | None = None
        for call in calls:
            recorder.tool_call(turn, call)
            output = await _call_tool(ctx, by_name, call)
            output = recorder.tool_result(turn, call, output)  # as the trajectory keeps it (bounded)
            text = _observation_text(output)
            if call.from_api or (tool_role and call.name):
                recorder.add_message({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
            else:
                as_user.append(f"<tool_response>\n{text}\n</tool_response>")
            if output.ends_episode:
                finished = output
                break
        if as_user:
            recorder.add_message({"role": "user", "content": "\n".join(as_user)})
        if finished is not None:
            return RunOutcome("finish", answer=finished.answer)
        await boundary(turn)
    return RunOutcome("max_turns")


class ToolLoopHandler(AgentHandler[InstanceT, OutcomeT]):
    """A family whose agent is the shared tool loop in one sandbox.

    Subclasses give `tools`, the prompts (`system_prompt` with a `{tools}`
    placeholder, or `system_text` for more; `user_prompt`), `instance_model`
    and `evaluate`. A family whose submission is more than the finish call's
    answer (SWE: the repository's diff) turns the loop's outcome into its own
    in `submission`.
    """

    system_prompt: str = "{tools}"
    tools: Sequence[Tool] = ()
    forkable = True

    def system_text(self, instance: InstanceT) -> str:
        return self.system_prompt.format(tools=describe_tools(self.tools))

    def user_prompt(self, instance: InstanceT) -> str:
        raise NotImplementedError

    async def init(self, ctx: RolloutContext[InstanceT]) -> None:
        await ctx.open_sandbox()

    async def run(self, ctx: RolloutContext[InstanceT]) -> OutcomeT:
        outcome = await run_tool_loop(
            ctx,
            system_prompt=self.system_text(ctx.instance),
            user_prompt=self.user_prompt(ctx.instance),
            tools=self.tools,
        )
        return await self.submission(ctx, outcome)

    async def submission(self, ctx: RolloutContext[InstanceT], outcome: RunOutcome) -> OutcomeT:
        """The run's outcome; by default the loop's own (families whose OutcomeT is RunOutcome)."""
        return cast(OutcomeT, outcome)
