"""Command: an existing agent program, unmodified, judged by one of the built-in families.

The instance names the program and how to judge what it produces:

    {"program": {"argv": [...], "env": {...}, "cwd": "/testbed", "files": {path: text},
                 "timeout_s": 600, "sampling": "job" | "program"},
     "verifier": "math" | "stem" | "code" | "swe" | "terminal" | "rubric",
     "task": {... an instance of that family ...},
     "submission": "last_line" | "stdout" | "file" | "git_diff" | "workdir",
     "submission_path": "/tmp/answer.txt"}

The program runs in the job's sandbox (the task's image for SWE) with the
job's model gateway on the sandbox's own loopback: OPENAI_BASE_URL,
OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY, GOOGLE_GEMINI_BASE_URL and
GEMINI_API_KEY point at it (the key is the job's and dies with it), PRORL_TASK holds the task as the family's own
agent would be prompted (when under 64 KiB) and PRORL_TASK_FILE names a file with the same
text. If the program's last model call failed for want of a backend (none reachable, a
5xx, a timeout), the job fails as infrastructure; a call the backend refused (a 4xx: the
program's own request) is the program's doing, and the job is judged as usual.
Every call samples under the job's sampling (gateway/sampling.py): max_tokens and the stop
strings are the job's ceiling, chat_template_kwargs the job's only, and temperature, top_p
and seed the job's unless `program.sampling` is "program".
The sandbox keeps no network. Every model call goes through the job's LLM
session (routing, pause/resume, policy versions, exact tokens as chains).

When it ends (or runs out of its time), its submission is collected: the
last non-empty line of its stdout, all of it, a file, or the repository's
`git diff` against base_commit (SWE: what the SWE family always judges) or
the working directory (terminal: archived, as the terminal family takes it); the
family then evaluates it exactly as for its own agent, in a fresh sandbox.
"""

from __future__ import annotations

import shlex
import string
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, StrictStr, field_validator, model_validator

from prorl_server.agents.base import AgentHandler, EvalOutcome, RolloutContext, RunOutcome, TaskInstance, TaskNeeds
from prorl_server.agents.code import CodeHandler
from prorl_server.agents.fields import Seconds, Text
from prorl_server.agents.loop import ToolLoopHandler
from prorl_server.agents.math import MathHandler
from prorl_server.agents.outcomes import StopReason
from prorl_server.agents.rubric import RubricHandler
from prorl_server.agents.stem import StemHandler
from prorl_server.agents.swe import SWEHandler
from prorl_server.agents.terminal import TerminalHandler, TerminalInstance
from prorl_server.errors import InfrastructureError, InvalidArgument
from prorl_server.verifiers.harness import LOG_TAIL_CHARS

FAMILIES: dict[str, ToolLoopHandler[Any, Any]] = {
    "math": MathHandler(),
    "stem": StemHandler(),
    "code": CodeHandler(),
    "swe": SWEHandler(),
    "terminal": TerminalHandler(),
    "rubric": RubricHandler(),
}
# Families whose submission is the sandbox's state, taken as their own agent's is.
STATE_SUBMISSIONS = {"swe": "git_diff", "terminal": "workdir"}
MAX_SUBMISSION_BYTES = 1 << 20
DEFAULT_PROGRAM_TIMEOUT_S = 1200.0
"""Below the default job budget (jobs.default_budget_s, 1800 s), which covers init and eval too."""
MAX_TASK_ENV_BYTES = 64 << 10
"""PRORL_TASK only up to this size (an environment string has at most 128 KiB on Linux); the
file PRORL_TASK_FILE always holds the whole task."""
# Shells report a command that could not be found or run with these statuses.
NOT_RUNNABLE = (126, 127)
EnvName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class Program(TaskInstance):
    argv: list[Text] = Field(min_length=1)
    """The command, no shell; `$PRORL_TASK_FILE` (or any variable the job sets, `${NAME}`) in an
    argument is replaced by its value."""
    env: dict[EnvName, StrictStr] = {}
    cwd: StrictStr | None = None
    """Absolute; default: the sandbox's working directory (SWE: the repository)."""
    files: dict[StrictStr, StrictStr] = {}
    """Written (as UTF-8 text) before the program starts: e.g. the agent's own script."""
    timeout_s: Seconds = Field(DEFAULT_PROGRAM_TIMEOUT_S, gt=0, le=24 * 3600)
    sampling: Literal["job", "program"] = "job"
    """Whose temperature, top_p and seed a model call uses: the job's (its sampling parameters,
    whatever the program sends), or the program's. max_tokens, stop strings and the chat
    template's arguments stay the job's either way."""

    @field_validator("cwd")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value


class CommandTask(TaskInstance):
    program: Program
    verifier: Literal["math", "stem", "code", "swe", "terminal", "rubric"]
    task: dict[str, Any]
    """An instance of the verifier's family, checked as that family checks it."""
    submission: Literal["last_line", "stdout", "file", "git_diff", "workdir"] = "last_line"
    submission_path: StrictStr | None = None
    _judged: TaskInstance = PrivateAttr()

    @model_validator(mode="after")
    def _consistent(self) -> CommandTask:
        try:
            self._judged = FAMILIES[self.verifier].validate(self.task)
        except InvalidArgument as exc:
            raise ValueError(f"task: {exc.message}") from None
        if self.submission == "file" and not self.submission_path:
            raise ValueError("submission 'file' needs submission_path")
        if (self.submission == "git_diff") != (self.verifier == "swe"):
            raise ValueError("the swe verifier judges the repository's diff (submission 'git_diff'), and only it")
        if (self.submission == "workdir") != (self.verifier == "terminal"):
            raise ValueError("the terminal verifier judges the working directory (submission 'workdir'), and only it")
        return self

    @property
    def program_chooses_sampling(self) -> bool:
        """Read by the job's gateway (jobs/pipeline.py): `program.sampling == "program"`."""
        return self.program.sampling == "program"

    @property
    def judged(self) -> TaskInstance:
        """`task`, as its family's model."""
        return self._judged


@dataclass(frozen=True)
class ProgramOutcome(RunOutcome):
    exit_code: int | None = None
    log_tail: str = ""
    """What the program wrote on stderr (its stdout is the submission's source): for people."""
    judged: RunOutcome = field(default_factory=lambda: RunOutcome("program_exit"))
    """What the verifier family judges (for SWE, with the repository's diff)."""


class CommandHandler(AgentHandler[CommandTask, ProgramOutcome]):
    name = "command"
    instance_model = CommandTask

    def image_for(self, instance: CommandTask) -> str | None:
        return FAMILIES[instance.verifier].image_for(instance.judged)

    @staticmethod
    def program_timeout_s(instance: CommandTask) -> float:
        """The program's time: its timeout_s, and no more than a terminal task's own agent
        timeout (Harbor's [agent] timeout_sec) when it has one."""
        limit = float(instance.program.timeout_s)
        judged = instance.judged
        if isinstance(judged, TerminalInstance) and judged.agent_timeout_s:
            limit = min(limit, float(judged.agent_timeout_s))
        return limit

    def needs(self, instance: CommandTask) -> TaskNeeds:
        judged = instance.judged
        if isinstance(judged, TerminalInstance):
            agent_s = self.program_timeout_s(instance) if judged.agent_timeout_s else 0.0
            return TerminalHandler.needs_for(judged, agent_s)
        return FAMILIES[instance.verifier].needs(judged)

    async def init(self, ctx: RolloutContext[CommandTask]) -> None:
        family = FAMILIES[ctx.instance.verifier]
        await family.init(ctx.for_instance(ctx.instance.judged))  # the sandbox (SWE: checked at base_commit)

    async def run(self, ctx: RolloutContext[CommandTask]) -> ProgramOutcome:
        instance, sandbox = ctx.instance, ctx.sandbox
        if ctx.model_gateway is None:
            raise InfrastructureError("this server gives jobs no model gateway", reason="no_gateway")
        folder = await self._scratch_folder(ctx)
        async with ctx.model_gateway(sandbox) as gateway:
            family = FAMILIES[instance.verifier]
            task_text = family.user_prompt(instance.judged)
            await sandbox.write_file(f"{folder}/task.txt", task_text.encode())
            for path, text in instance.program.files.items():
                await sandbox.write_file(path, text.encode())
            base = f"http://127.0.0.1:{gateway.port}"
            env = {
                "OPENAI_BASE_URL": f"{base}/v1",
                "OPENAI_API_KEY": gateway.api_key,
                "ANTHROPIC_BASE_URL": base,
                "ANTHROPIC_API_KEY": gateway.api_key,
                "GOOGLE_GEMINI_BASE_URL": base,
                "GEMINI_API_KEY": gateway.api_key,
                "PRORL_TASK": task_text if len(task_text.encode()) <= MAX_TASK_ENV_BYTES else "",
                "PRORL_TASK_FILE": f"{folder}/task.txt",
                **instance.program.env,
            }
            command = self._command(instance, env, stdout=f"{folder}/stdout")
            result = await sandbox.bash(command, timeout_s=self.program_timeout_s(instance))
            outage = gateway.outage()
        if outage is not None:  # the program could not reach the model: not the policy's doing
            raise outage
        if result.exit_code in NOT_RUNNABLE and not ctx.recorder.num_turns:
            raise InfrastructureError(
                f"the program {instance.program.argv[0]!r} could not be run (exit {result.exit_code}): "
                f"{result.output[-500:]}",
                reason="program_not_runnable",
            )
        stop: StopReason = "program_timeout" if result.timed_out else "program_exit"
        state = STATE_SUBMISSIONS.get(instance.verifier)
        answer = await self._submission(ctx, f"{folder}/stdout") if state is None else None
        judged = RunOutcome(stop, answer=answer)
        if state is not None:  # the repository's diff (SWE), the working directory (terminal)
            judged = await FAMILIES[instance.verifier].submission(ctx.for_instance(instance.judged), judged)
        return ProgramOutcome(stop, judged.answer, exit_code=result.exit_code, log_tail=result.output, judged=judged)

    @staticmethod
    async def _scratch_folder(ctx: RolloutContext[CommandTask]) -> str:
        """A private folder for the task text and the program's stdout (never in the repository)."""
        result = await ctx.sandbox.bash("mktemp -d", timeout_s=30)
        folder = result.output.strip().splitlines()[-1] if result.output.strip() else ""
        if result.exit_code != 0 or not folder.startswith("/"):
            raise InfrastructureError(f"cannot make a scratch folder in the sandbox: {result.output[-300:]}")
        return folder

    @staticmethod
    def _command(instance: CommandTask, env: dict[str, str], *, stdout: str) -> str:
        program = instance.program
        assignments = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
        # $PRORL_TASK_FILE (and the job's other variables) may stand in the argv, e.g. --task-file $PRORL_TASK_FILE.
        argv = " ".join(shlex.quote(string.Template(arg).safe_substitute(env)) for arg in program.argv)
        cd = f"cd {shlex.quote(program.cwd)} && " if program.cwd else ""
        return f"{cd}env {assignments} {argv} </dev/null >{shlex.quote(stdout)}"

    async def _submission(self, ctx: RolloutContext[CommandTask], stdout: str) -> str | None:
        instance = ctx.instance
        path = instance.submission_path if instance.submission == "file" else stdout
        assert path is not None
        try:
            data = await ctx.sandbox.read_file(path, max_bytes=MAX_SUBMISSION_BYTES)
        except Exception:  # nothing written: nothing submitted
            return None
        text = data.decode(errors="replace")
        if instance.submission == "last_line":
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            return lines[-1] if lines else None
        return text.strip() or None

    async def evaluate(self, ctx: RolloutContext[CommandTask], outcome: ProgramOutcome) -> EvalOutcome:
        instance = ctx.instance
        family = FAMILIES[instance.verifier]
        evaluation = await family.evaluate(ctx.for_instance(instance.judged), outcome.judged)
        details = {
            **evaluation.details,
            "verifier": instance.verifier,
            "calls": ctx.recorder.num_turns,
            "exit_code": outcome.exit_code,
            "program_log_tail": outcome.log_tail[-LOG_TAIL_CHARS:],
        }
        return EvalOutcome(evaluation.reward, details)
