"""The shared tool loop (agents/loop.py run_tool_loop) without Podman or a model: a RolloutContext
built by hand, turns from a scripted in-process backend through the real router and session,
tools running in a fake sandbox (the real in-sandbox runtime as a local process)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio

from prorl_server.agents.base import Limits, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.events import AgentEvent, ModelTurnEvent, ToolCallEvent, ToolResultEvent
from prorl_server.agents.loop import run_tool_loop
from prorl_server.agents.recorder import TrajectoryRecorder
from prorl_server.agents.tools import BashTool, FinishTool, PythonTool
from prorl_server.llm.base import Sampling
from prorl_server.llm.router import BackendRouter
from prorl_server.llm.session import LLMSession
from prorl_server.sandbox.base import SandboxSpec
from tests.fakes.sandbox_provider import FakeContainer, FakeSandboxProvider
from tests.fakes.scripted_llm import Replies, ScriptedChatBackend, ScriptedReply, api_tool_call, tool_call_text

SPEC = SandboxSpec(image="fake-python", cpus=1.0, memory_mib=256, pids_limit=64)
TOOLS = (PythonTool(), BashTool(), FinishTool())
CONTEXT_FULL = ScriptedReply(status=400, error_message="This model's maximum context length is 8 tokens")


class Loop:
    """One run of the loop: the backend it talked to, what it recorded, the sandbox it used."""

    def __init__(self, backend: ScriptedChatBackend, ctx: RolloutContext[Any], events: list[AgentEvent]) -> None:
        self.backend = backend
        self.ctx = ctx
        self.events = events

    @property
    def workdir(self) -> Path:
        container = self.ctx.sandbox.container
        assert isinstance(container, FakeContainer)
        return container.workdir

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.ctx.recorder.messages

    def results(self) -> list[ToolResultEvent]:
        return [event for event in self.events if isinstance(event, ToolResultEvent)]


RunLoop = Callable[..., Awaitable[tuple[RunOutcome, Loop]]]


@pytest_asyncio.fixture
async def run_loop(fake_provider: FakeSandboxProvider) -> AsyncIterator[RunLoop]:
    """Runs the loop over a script in a fresh sandbox; everything is closed after the test."""
    routers: list[BackendRouter] = []
    contexts: list[RolloutContext[Any]] = []

    async def run(replies: Replies, *, max_turns: int = 5) -> tuple[RunOutcome, Loop]:
        backend = ScriptedChatBackend(replies)
        router = BackendRouter(health_interval_s=0)
        router.add(backend)
        routers.append(router)
        events: list[AgentEvent] = []
        ctx: RolloutContext[Any] = RolloutContext(
            job_id="loop-job",
            instance=TaskInstance(),
            limits=Limits(max_turns=max_turns, tool_timeout_s=10.0),
            sampling=Sampling(max_tokens=64, temperature=0.0),
            chat=LLMSession("loop-job", router).chat,
            sandbox_factory=lambda: fake_provider.create(SPEC),
            recorder=TrajectoryRecorder(events.append),
        )
        contexts.append(ctx)
        await ctx.open_sandbox()
        outcome = await run_tool_loop(ctx, system_prompt="You are tested.", user_prompt="What is 6 * 7?", tools=TOOLS)
        return outcome, Loop(backend, ctx, events)

    yield run
    for ctx in contexts:
        await ctx.close_sandboxes()
    for router in routers:
        await router.close()
    assert fake_provider.busy == 0


def kinds(events: list[AgentEvent]) -> list[tuple[str, int]]:
    return [(type(event).__name__, event.turn) for event in events]


async def test_finish_ends_the_run_with_the_answer_after_tools_really_ran(run_loop: RunLoop) -> None:
    outcome, loop = await run_loop(
        [
            tool_call_text("bash", {"command": "echo hello > note.txt && cat note.txt && pwd"}),
            "Checked. " + tool_call_text("finish", {"answer": "42"}),
        ]
    )

    assert outcome == RunOutcome("finish", "42")
    bash, finish = loop.results()
    # The command ran in the sandbox: its output, its exit code and the file it wrote.
    assert bash.call.name == "bash" and bash.output.exit_code == 0 and not bash.output.error
    assert bash.output.output == f"hello\n{loop.workdir}\n"
    assert (loop.workdir / "note.txt").read_text() == "hello\n"
    assert finish.output.ends_episode and finish.output.answer == "42" and finish.output.output == "Answer submitted."
    recorder = loop.ctx.recorder
    assert recorder.num_turns == 2 and recorder.format_errors == 0 and recorder.tools_s > 0
    assert [m["role"] for m in loop.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert loop.messages[3]["content"] == f"<tool_response>\nhello\n{loop.workdir}\n[exit code 0]\n</tool_response>"
    # The model saw the tools' schemas and, on its second turn, the bash result.
    first, second = loop.backend.requests
    assert [tool["function"]["name"] for tool in first.tools] == ["python", "bash", "finish"]
    assert first.messages == loop.messages[:2] and second.messages == loop.messages[:4]


async def test_the_recorder_reports_turns_calls_and_results_in_order(run_loop: RunLoop) -> None:
    _, loop = await run_loop(
        [tool_call_text("python", {"code": "print(6 * 7)"}), tool_call_text("finish", {"answer": "42"})]
    )

    assert kinds(loop.events) == [
        ("ModelTurnEvent", 0),
        ("ToolCallEvent", 0),
        ("ToolResultEvent", 0),
        ("ModelTurnEvent", 1),
        ("ToolCallEvent", 1),
        ("ToolResultEvent", 1),
    ]
    turn, call, result = loop.events[:3]
    assert isinstance(turn, ModelTurnEvent) and turn.result.backend_id == "scripted"
    assert turn.result.text == tool_call_text("python", {"code": "print(6 * 7)"})
    assert isinstance(call, ToolCallEvent) and call.call.name == "python"
    assert json.loads(call.call.arguments_json) == {"code": "print(6 * 7)"}
    assert isinstance(result, ToolResultEvent) and result.call == call.call and result.output.output == "42\n"


async def test_the_turn_limit_ends_the_run_without_an_answer(run_loop: RunLoop) -> None:
    replies = [tool_call_text("bash", {"command": f"echo turn {n}"}) for n in range(3)]
    outcome, loop = await run_loop(replies, max_turns=3)

    assert outcome == RunOutcome("max_turns", None)
    assert len(loop.backend.requests) == 3 and loop.ctx.recorder.num_turns == 3
    assert [result.output.output for result in loop.results()] == ["turn 0\n", "turn 1\n", "turn 2\n"]


async def test_a_full_context_ends_the_run_as_a_policy_outcome(run_loop: RunLoop) -> None:
    outcome, loop = await run_loop([tool_call_text("bash", {"command": "echo one"}), CONTEXT_FULL])

    assert outcome == RunOutcome("context_length", None)
    assert len(loop.backend.requests) == 2 and loop.ctx.recorder.num_turns == 1  # the refused turn is not one
    assert kinds(loop.events)[-1] == ("ToolResultEvent", 0)


async def test_a_reply_without_a_tool_call_is_a_format_error_answered_with_the_hint(run_loop: RunLoop) -> None:
    outcome, loop = await run_loop(["The answer is 42.", tool_call_text("finish", {"answer": "42"})])

    assert outcome == RunOutcome("finish", "42")
    assert loop.ctx.recorder.format_errors == 1
    assert kinds(loop.events) == [
        ("ModelTurnEvent", 0),
        ("ModelTurnEvent", 1),
        ("ToolCallEvent", 1),
        ("ToolResultEvent", 1),
    ]
    hint = loop.messages[3]
    assert loop.messages[2] == {"role": "assistant", "content": "The answer is 42."}
    assert hint["role"] == "user" and hint["content"].startswith("No tool call found.")
    assert '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>' in hint["content"]
    assert loop.backend.requests[1].messages[-1] == hint  # the model is told before its next turn


async def test_unknown_tools_and_bad_arguments_are_errors_fed_back(run_loop: RunLoop) -> None:
    outcome, loop = await run_loop(
        [
            tool_call_text("search", {"query": "6 * 7"}),
            tool_call_text("python", {"source": "print(1)"}),
            tool_call_text("bash", {"command": 7}),
            "<tool_call>{not json</tool_call>",
            tool_call_text("finish", {"answer": "42"}),
        ]
    )

    assert outcome == RunOutcome("finish", "42")
    errors = [result.output for result in loop.results()[:4]]
    assert all(output.error and output.exit_code is None for output in errors)
    unknown, missing, wrong_type, malformed = (output.output for output in errors)
    assert unknown == "Error: there is no tool 'search'. Available tools: bash, finish, python."
    assert missing.startswith("Error: python needs the argument 'code'")
    assert wrong_type == "Error: bash: argument 'command' must be a string"
    assert malformed.startswith("Error: ") and "not valid JSON" in malformed
    assert loop.ctx.recorder.format_errors == 4
    # Each error reached the model as the observation of its call, before its next turn.
    for turn, text in enumerate((unknown, missing, wrong_type, malformed), start=1):
        assert loop.backend.requests[turn].messages[-1] == {
            "role": "user",
            "content": f"<tool_response>\n{text}\n</tool_response>",
        }


async def test_several_calls_in_one_reply_run_in_order_and_finish_stops_the_rest(run_loop: RunLoop) -> None:
    reply = " ".join(
        [
            tool_call_text("bash", {"command": "echo one > first.txt; cat first.txt"}),
            tool_call_text("python", {"code": "print(open('first.txt').read().strip() + ' two')"}),
            tool_call_text("finish", {"answer": "42"}),
            tool_call_text("bash", {"command": "touch never.txt"}),
        ]
    )
    outcome, loop = await run_loop([reply])

    assert outcome == RunOutcome("finish", "42")
    assert [(r.call.name, r.output.output) for r in loop.results()] == [
        ("bash", "one\n"),
        ("python", "one two\n"),
        ("finish", "Answer submitted."),
    ]
    assert not (loop.workdir / "never.txt").exists()
    assert len({result.call.id for result in loop.results()}) == 3
    observations = loop.messages[-1]["content"]
    assert observations.count("<tool_response>") == 3 and "[exit code 0]" in observations


async def test_structured_calls_get_their_results_in_the_tool_role(run_loop: RunLoop) -> None:
    outcome, loop = await run_loop(
        [
            ScriptedReply(tool_calls=[api_tool_call("bash", {"command": "echo structured"}, "call_a")]),
            ScriptedReply(tool_calls=[api_tool_call("finish", {"answer": 42}, "call_b")]),
        ]
    )

    assert outcome == RunOutcome("finish", "42")  # a number is taken as its text
    assistant, tool = loop.messages[2], loop.messages[3]
    arguments = '{"command": "echo structured"}'
    assert assistant["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    ]
    assert tool == {"role": "tool", "tool_call_id": "call_a", "name": "bash", "content": "structured\n[exit code 0]"}
