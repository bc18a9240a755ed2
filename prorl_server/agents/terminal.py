"""Terminal: a Harbor / Terminal-Bench task, done in a shell and judged by its tests.

An instance is one Harbor task folder as `prorl import-harbor` writes it: the
task's `name`, its `instruction` (instruction.md), the sandbox `image` its
environment was built into (or one the operator pre-loaded), the `workdir`
its Dockerfile sets (default /app), the files of its tests/ folder (`tests`,
path -> text), the pytest files its test.sh runs (`test_files`), its time
limits (`agent_timeout_s`, `verifier_timeout_s`) and resources (`cpus`,
`memory_mib`; `storage_mib` for the record). The reference solution is never
part of it.

The limits are enforced: the agent is stopped at `agent_timeout_s` and judged
on what it left (`stop_reason` agent_timeout, as Harbor still verifies after an
AgentTimeoutError), the tests run within `verifier_timeout_s`, the sandboxes
get the task's CPUs and memory (`needs`, applied at Submit), and the job's
budget covers the task's times.

The agent works with bash and the file editor in the task's image. Its
submission is its working directory as it left it (a tar archive taken by the
server, never anything the model wrote); evaluation unpacks it into a fresh
sandbox of the same image and runs the task's tests there (see
verifiers/terminal.py). What the agent did outside the working directory, and
processes it left running, do not carry over: a task whose tests check those
cannot be judged here.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import Field, StrictStr, field_validator, model_validator

from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome, TaskInstance, TaskNeeds
from prorl_server.agents.fields import Seconds, Text, Whole
from prorl_server.agents.loop import ToolLoopHandler, describe_tools, run_tool_loop
from prorl_server.agents.tools import BashTool, EditorTool, FinishTool
from prorl_server.errors import PolicyError
from prorl_server.sandbox.snapshot import RUNTIME_SCRATCH, Root
from prorl_server.verifiers.terminal import judge

DEFAULT_WORKDIR = "/app"
DEFAULT_TESTS_DIR = "/tests"
DEFAULT_VERIFIER_TIMEOUT_S = 300.0
OVERHEAD_S = 120.0
"""A job's time beyond the agent's and the tests' when the task sets both: its two sandboxes
started, the working directory archived and unpacked (the least budget Submit gives it)."""
MAX_STATE_BYTES = 64 << 20
"""The agent's working directory, archived, at most (larger: `state_too_large`, reward 0)."""
MAX_TEST_BYTES = 4 << 20
STATE_PATH = "/tmp/prorl-state.tar"
# Harbor's logs folder for the verifier: emptied (made) before the tests run.
LOGS_DIRS = ("/logs/verifier",)

SYSTEM_PROMPT = """You are working in a Linux terminal to complete a task.
Your working directory is {workdir}. Use the tools to inspect the system, run commands and edit files.
What you leave in {workdir} is checked by tests when you are done: then call finish.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "bash", "arguments": {{"command": "ls -la {workdir}"}}}}</tool_call>"""

USER_PROMPT = """<task>
{instruction}
</task>

Complete the task in {workdir}, then call finish."""


class DoneTool(FinishTool):
    """finish without an answer: the working directory is the submission."""

    description = "Stop working: the working directory as you leave it is checked by the task's tests."
    parameters = {
        "type": "object",
        "properties": {"summary": {"type": "string", "description": "Optional: what you did."}},
        "required": [],
    }


def _relative(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and all(parts)


class TerminalInstance(TaskInstance):
    """A Harbor task as `prorl import-harbor` writes it."""

    ignored_fields = frozenset({"source", "metadata", "environment"})

    name: Text
    instruction: Text
    image: Text
    workdir: StrictStr = DEFAULT_WORKDIR
    tests_dir: StrictStr = DEFAULT_TESTS_DIR
    """Where the tests go in the judging sandbox (Harbor: /tests)."""
    tests: dict[StrictStr, StrictStr] = Field(min_length=1)
    """The task's tests/ folder: relative path -> text."""
    test_files: list[Text] = Field(min_length=1)
    """The pytest files (paths in `tests`) the task's test.sh runs."""
    agent_timeout_s: Seconds = Field(0, ge=0, le=24 * 3600)
    """Harbor's [agent] timeout_sec: the agent is stopped there and judged on what it left
    (`stop_reason` agent_timeout). 0: none (the job's budget limits the agent)."""
    verifier_timeout_s: Seconds = Field(DEFAULT_VERIFIER_TIMEOUT_S, gt=0, le=3600)
    """Harbor's [verifier] timeout_sec: the tests' time (past it: `tests_timed_out`)."""
    cpus: Seconds | None = Field(None, gt=0)
    """Harbor's [environment] cpus: the sandboxes' CPUs unless the request's sandbox.cpus says
    otherwise; more than the server's sandbox.max_cpus is refused at Submit."""
    memory_mib: Whole | None = Field(None, ge=16)
    """Harbor's [environment] memory_mb, likewise (sandbox.memory_mib, sandbox.max_memory_mib)."""
    storage_mib: Whole | None = Field(None, ge=1)
    """Harbor's [environment] storage_mb, for the record: the sandboxes have no disk quota."""

    @field_validator("workdir", "tests_dir")
    @classmethod
    def _absolute_folder(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") == "":
            raise ValueError("must be an absolute path other than /")
        return value.rstrip("/")

    @field_validator("tests")
    @classmethod
    def _test_paths(cls, value: dict[str, str]) -> dict[str, str]:
        for path in value:
            if not _relative(path):
                raise ValueError(f"{path!r} is not a relative path inside the tests folder")
        if sum(len(text.encode()) for text in value.values()) > MAX_TEST_BYTES:
            raise ValueError(f"the tests are over {MAX_TEST_BYTES >> 20} MiB")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TerminalInstance:
        for path in self.test_files:
            if path not in self.tests:
                raise ValueError(f"test_files: {path!r} is not among the tests")
            if not path.endswith(".py"):
                raise ValueError(f"test_files: {path!r} is not a pytest file (.py)")
        work, tests = self.workdir + "/", self.tests_dir + "/"
        if work.startswith(tests) or tests.startswith(work):
            raise ValueError("workdir and tests_dir must not contain one another")
        return self


@dataclass(frozen=True)
class TerminalRunOutcome(RunOutcome):
    state_bytes: int = 0
    """The size of the archive of the agent's working directory (MAX_STATE_BYTES + 1: too large)."""
    agent_time_carried_s: float = 0.0
    """A fork's: the agent time its parent had used up to the branch (counted in agent_timeout_s)."""


class TerminalHandler(ToolLoopHandler[TerminalInstance, TerminalRunOutcome]):
    name = "terminal"
    instance_model = TerminalInstance
    tools = (BashTool(), EditorTool(), DoneTool())

    def image_for(self, instance: TerminalInstance) -> str | None:
        return instance.image

    def fork_roots(self, instance: TerminalInstance) -> Sequence[Root]:
        """The task's working directory, the submission a fork goes on from (the image's files
        when the job starts, like a SWE repository: carried as its changes), and the temporary
        directory. The runtime's own workdir (/workspace) is not the task's."""
        return (Root("workdir", instance.workdir, pristine=True), Root("tmp", exclude=RUNTIME_SCRATCH))

    def needs(self, instance: TerminalInstance) -> TaskNeeds:
        return self.needs_for(instance, float(instance.agent_timeout_s))

    @staticmethod
    def needs_for(instance: TerminalInstance, agent_s: float) -> TaskNeeds:
        """The task's CPUs and memory, and a budget for `agent_s` of the agent's time (0: none)
        with the tests' own time and the job's work around them."""
        verifier_s = float(instance.verifier_timeout_s)
        budget_from = f"{agent_s:g}s for the agent + verifier_timeout_s {verifier_s:g}s + {OVERHEAD_S:g}s overhead"
        return TaskNeeds(
            cpus=None if instance.cpus is None else float(instance.cpus),
            memory_mib=None if instance.memory_mib is None else int(instance.memory_mib),
            resources_from="the terminal instance's cpus and memory_mib, Harbor's [environment] cpus and memory_mb",
            budget_s=agent_s + verifier_s + OVERHEAD_S if agent_s else 0.0,
            budget_from=budget_from,
        )

    async def run(self, ctx: RolloutContext[TerminalInstance]) -> TerminalRunOutcome:
        """The tool loop, ended at the task's agent timeout if it has one (Harbor's [agent]
        timeout_sec: the agent is stopped and judged on what it left, `stop_reason` agent_timeout)."""
        limit = float(ctx.instance.agent_timeout_s)
        if not limit:
            return await super().run(ctx)
        system, user = self.system_text(ctx.instance), self.user_prompt(ctx.instance)
        # A fork's agent has what its parent's had left at the branch: the same total time.
        carried = ctx.branching.carried_time_s if ctx.branching is not None else 0.0
        try:
            async with ctx.time_limit(limit, used_s=carried) as deadline:
                outcome = await run_tool_loop(ctx, system_prompt=system, user_prompt=user, tools=self.tools)
        except TimeoutError:
            if not deadline.expired():  # some step's own timeout, not the agent's
                raise
            outcome = RunOutcome("agent_timeout")
        return replace(await self.submission(ctx, outcome), agent_time_carried_s=carried)

    def system_text(self, instance: TerminalInstance) -> str:
        return SYSTEM_PROMPT.format(workdir=instance.workdir, tools=describe_tools(self.tools))

    def user_prompt(self, instance: TerminalInstance) -> str:
        return USER_PROMPT.format(instruction=instance.instruction.strip(), workdir=instance.workdir)

    async def submission(self, ctx: RolloutContext[TerminalInstance], outcome: RunOutcome) -> TerminalRunOutcome:
        size = await self._archive_state(ctx)
        return TerminalRunOutcome(outcome.stop_reason, outcome.answer, state_bytes=size)

    @staticmethod
    async def _archive_state(ctx: RolloutContext[TerminalInstance]) -> int:
        """Archive the working directory in the agent's sandbox; its size in bytes."""
        workdir = shlex.quote(ctx.instance.workdir)
        result = await ctx.sandbox.bash(
            f"mkdir -p {workdir} && tar --ignore-failed-read -C {workdir} -cf {STATE_PATH} . "
            f"&& stat -c %s {STATE_PATH}",
            timeout_s=300,
        )
        lines = result.output.strip().splitlines()
        if result.exit_code != 0 or not lines or not lines[-1].isdigit():
            # Only the agent's commands ran in this sandbox: a working directory that cannot
            # be archived (deleted, /tmp filled) is the policy's doing.
            raise PolicyError(
                f"the agent's working directory could not be archived: {result.output[-500:]}",
                reason="terminal_state_unreadable",
            )
        return int(lines[-1])

    async def evaluate(self, ctx: RolloutContext[TerminalInstance], outcome: TerminalRunOutcome) -> EvalOutcome:
        instance = ctx.instance
        details: dict[str, Any] = {
            "stop_reason": outcome.stop_reason,
            "task": instance.name,
            "state_bytes": outcome.state_bytes,
        }
        if instance.agent_timeout_s:
            details["agent_timeout_s"] = float(instance.agent_timeout_s)
            if ctx.branching is not None and ctx.branching.resume_after is not None:
                details["agent_time_carried_s"] = round(outcome.agent_time_carried_s, 3)
        if outcome.state_bytes > MAX_STATE_BYTES:
            return EvalOutcome(0.0, {**details, "verdict": "state_too_large"})
        state = await ctx.sandbox.read_file(STATE_PATH, max_bytes=MAX_STATE_BYTES)
        fresh = await ctx.open_sandbox()  # the agent never touched it: only its working directory carries over
        await fresh.write_file(STATE_PATH, state)
        verdict = await judge(
            fresh,
            workdir=instance.workdir,
            tests_dir=instance.tests_dir,
            tests=instance.tests,
            run=instance.test_files,
            state_path=STATE_PATH,
            timeout_s=float(instance.verifier_timeout_s),
            logs_dirs=LOGS_DIRS,
        )
        return EvalOutcome(1.0 if verdict.passed else 0.0, {**details, **verdict.details()})
