"""SWE: fix a real repository so that its failing tests pass (SWE-bench style).

Instances carry SWE-bench's fields: instance_id, repo, base_commit,
problem_statement, patch (the gold fix, never shown to the agent), test_patch,
FAIL_TO_PASS and PASS_TO_PASS (lists, or JSON strings of lists as in the
published datasets), plus `image`, a sandbox image holding the repository at
base_commit in `repo_dir` (default /testbed). Optional: `pythonpath` for the
tests (e.g. "src") and `eval_timeout_s`. With `version` (or a swebench 5
`eval_script`), the instance is judged as SWE-bench's official evaluation
runs it: pytest, Django's tests/runtests.py or SymPy's bin/test (see
verifiers/swe.py); an instance whose official runner is anything else
(Sphinx's tox, ...) is refused at Submit. Every FAIL_TO_PASS and PASS_TO_PASS
test must PASS (an XFAIL or a skip does not) unless `swebench_grading` is
true, which grades as SWE-bench does.

The agent works with bash and the file editor. Its submission is whatever the
repository's `git diff` against base_commit says when it stops, never text the
model wrote; evaluation applies that diff in a fresh sandbox from the same
image (see verifiers/swe.py).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictBool, StrictStr, field_validator, model_validator

from prorl_server.agents.base import EvalOutcome, RolloutContext, RunOutcome, TaskInstance
from prorl_server.agents.fields import Seconds, Text
from prorl_server.agents.loop import ToolLoopHandler, describe_tools
from prorl_server.agents.tools import BashTool, EditorTool, FinishTool
from prorl_server.errors import InfrastructureError, InvalidArgument, PolicyError
from prorl_server.sandbox.snapshot import RUNTIME_SCRATCH, Root
from prorl_server.verifiers.swe import RUNNER_SCRIPTS, judge, runner_command
from prorl_server.verifiers.swebench.specs import EvalSpec, UnknownSpec, official_runner, spec_for

DEFAULT_REPO_DIR = "/testbed"
DEFAULT_EVAL_TIMEOUT_S = 300.0
MAX_PATCH_BYTES = 1 << 20
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")

SYSTEM_PROMPT = """You are a software engineer fixing an issue in a Python repository.
The repository is checked out at {repo_dir}. Use the tools to explore it, reproduce the issue,
edit the source and check your fix. Do not change the tests. Your changes to the repository
are your submission: when you are done, call finish.

Tools:
{tools}

To use a tool, reply with one call in this exact format:
<tool_call>{{"name": "bash", "arguments": {{"command": "grep -rn 'def main' {repo_dir}"}}}}</tool_call>"""

USER_PROMPT = """Repository: {repo} (at {repo_dir})

<issue>
{problem_statement}
</issue>

Make the smallest change to the source that resolves the issue, then call finish."""


class SubmitTool(FinishTool):
    """finish without an answer: the repository's state is the submission."""

    description = "Stop working: the current changes to the repository are your submission."
    parameters = {
        "type": "object",
        "properties": {"summary": {"type": "string", "description": "Optional: what you changed and why."}},
        "required": [],
    }


def _test_list(value: Any) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list, whether given as a list or as a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ValueError(f"is a string but not a JSON list: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(test, str) and test.strip() for test in value):
        raise ValueError("must be a list of pytest node ids")
    return value


def node_ids(instance: dict[str, Any], field: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS of a raw instance dict (see `_test_list`)."""
    try:
        return _test_list(instance.get(field, []))
    except ValueError as exc:
        raise InvalidArgument(f"swe instance field {field!r} {exc}") from None


TestIds = Annotated[list[str], BeforeValidator(_test_list)]


JUDGED_RUNNERS = frozenset({"pytest", *RUNNER_SCRIPTS})
RUNNER_NAMES = {
    "tox": "tox",
    "other": "a command other than pytest",
}


class SWEInstance(TaskInstance):
    """SWE-bench's fields, plus the image that holds the repository at base_commit."""

    model_config = TaskInstance.model_config | {"strict": False}  # lists may arrive as JSON strings
    # Columns of SWE-bench, SWE-Gym, SWE-smith rows (as `prorl import-swe` writes them) and of the
    # shipped tasks' task.json that judging does not use.
    ignored_fields = frozenset(
        {
            "hints_text", "created_at", "environment_setup_commit", "dataset", "evaluation", "eval_type",
            "swesmith_repo", "image_name", "layout", "pypi", "requirements", "upstream",
        }
    )  # fmt: skip

    instance_id: Text
    repo: Text
    base_commit: Text
    problem_statement: Text
    image: Text
    patch: StrictStr = ""
    """The gold fix: never shown to the agent."""
    test_patch: StrictStr = ""
    pythonpath: StrictStr = ""
    repo_dir: StrictStr = DEFAULT_REPO_DIR
    FAIL_TO_PASS: TestIds
    PASS_TO_PASS: TestIds = []
    eval_timeout_s: Seconds = Field(DEFAULT_EVAL_TIMEOUT_S, gt=0, le=3600)
    version: StrictStr = ""
    """SWE-bench's version of the repository: with `repo`, it names the official evaluation."""
    eval_script: StrictStr = ""
    """A swebench 5 instance's own evaluation (with `log_parser`)."""
    log_parser: StrictStr = ""
    swebench_grading: StrictBool = False
    """Grade as SWE-bench does (an XFAIL passes, a skipped PASS_TO_PASS test is kept), for
    comparing with published numbers. Off by default: then every selected test must PASS,
    so code under test that calls pytest.xfail() or pytest.skip() cannot resolve."""

    @field_validator("base_commit")
    @classmethod
    def _hex_commit(cls, value: str) -> str:
        if not _COMMIT.match(value):
            raise ValueError("must be a hex commit id (7-40 lowercase digits)")
        return value

    @field_validator("repo_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value

    @field_validator("FAIL_TO_PASS")
    @classmethod
    def _some_test(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must name at least one test")
        return value

    @model_validator(mode="after")
    def _judged_runner(self) -> SWEInstance:
        """The judge runs pytest, Django's tests/runtests.py and SymPy's bin/test: refuse,
        rather than score wrongly, an instance whose official evaluation runs another
        test runner (tox, ...) or a command the judge cannot split."""
        runner = "pytest"
        if self.eval_script:
            try:
                runner = spec_for(self.model_dump()).runner
            except UnknownSpec as exc:
                raise ValueError(f"its eval_script cannot be used: {exc}") from None
        else:
            runner = official_runner(self.repo, self.version) or runner
        if runner not in JUDGED_RUNNERS:
            raise ValueError(
                f"{self.repo} {self.version} runs its tests with {RUNNER_NAMES.get(runner, runner)} in SWE-bench's "
                f"official evaluation; this server judges {', '.join(sorted(JUDGED_RUNNERS))} runs only"
            )
        if runner in RUNNER_SCRIPTS:
            try:
                runner_command(spec_for(self.model_dump()), self.test_patch)
            except UnknownSpec as exc:
                raise ValueError(f"its official evaluation cannot be run: {exc}") from None
        return self

    def evaluation(self) -> EvalSpec | None:
        """The official evaluation (its runner, and the log parser SWE-bench grades it with)."""
        if not (self.eval_script or self.version):
            return None
        try:
            spec = spec_for(self.model_dump())
        except UnknownSpec:
            return None
        return spec if spec.runner in JUDGED_RUNNERS else None


@dataclass(frozen=True)
class SWERunOutcome(RunOutcome):
    patch: str = ""
    """The submission: the repository's diff against base_commit when the agent stopped."""


class SWEHandler(ToolLoopHandler[SWEInstance, SWERunOutcome]):
    name = "swe"
    instance_model = SWEInstance
    tools = (BashTool(), EditorTool(), SubmitTool())

    def fork_roots(self, instance: SWEInstance) -> Sequence[Root]:
        """The repository's working tree (its .git is the image's, at the same base commit), kept
        as its changes since the job started (it is the image's, the same in every sandbox), and
        the temporary directory."""
        return (
            Root("repo", instance.repo_dir, exclude=(".git",), pristine=True),
            Root("tmp", exclude=RUNTIME_SCRATCH),
        )

    def image_for(self, instance: SWEInstance) -> str | None:
        return instance.image

    def system_text(self, instance: SWEInstance) -> str:
        return SYSTEM_PROMPT.format(repo_dir=instance.repo_dir, tools=describe_tools(self.tools))

    def user_prompt(self, instance: SWEInstance) -> str:
        return USER_PROMPT.format(
            repo=instance.repo, repo_dir=instance.repo_dir, problem_statement=instance.problem_statement
        )

    async def init(self, ctx: RolloutContext[SWEInstance]) -> None:
        sandbox = await ctx.open_sandbox()
        instance = ctx.instance
        result = await sandbox.bash(f"cd {shlex.quote(instance.repo_dir)} && git rev-parse HEAD", timeout_s=60)
        found = result.output.strip()
        head = found.splitlines()[-1] if found else ""
        if result.exit_code != 0 or not head.startswith(instance.base_commit):
            raise InfrastructureError(
                f"image {instance.image!r} does not hold the repository at base_commit "
                f"{instance.base_commit} in {instance.repo_dir} (found: {found[-300:]!r})",
                reason="swe_image_mismatch",
            )

    async def submission(self, ctx: RolloutContext[SWEInstance], outcome: RunOutcome) -> SWERunOutcome:
        patch = await self._repository_diff(ctx)
        return SWERunOutcome(outcome.stop_reason, outcome.answer, patch=patch)

    @staticmethod
    async def _repository_diff(ctx: RolloutContext[SWEInstance]) -> str:
        """The submission: every change in the work tree (new files included) against base_commit."""
        out = "/tmp/prorl-submission.patch"
        base = shlex.quote(ctx.instance.base_commit)
        result = await ctx.sandbox.bash(
            f"cd {shlex.quote(ctx.instance.repo_dir)} && git add -A && git diff --cached --binary {base} > {out}",
            timeout_s=120,
        )
        if result.exit_code != 0:
            # Init saw git work at base_commit, and since then only the agent's commands
            # ran here: a diff that fails now (.git deleted, /tmp full) is the policy's doing.
            raise PolicyError(
                f"git diff of the agent's repository failed: {result.output[-500:]}", reason="swe_diff_failed"
            )
        return (await ctx.sandbox.read_file(out, max_bytes=MAX_PATCH_BYTES + 1)).decode(errors="replace")

    async def evaluate(self, ctx: RolloutContext[SWEInstance], outcome: SWERunOutcome) -> EvalOutcome:
        instance = ctx.instance
        patch = outcome.patch
        details: dict[str, Any] = {
            "stop_reason": outcome.stop_reason,
            "instance_id": instance.instance_id,
            "patch": patch,
        }
        if len(patch) > MAX_PATCH_BYTES:
            return EvalOutcome(0.0, {**details, "patch": patch[:4096], "verdict": "patch_too_large"})
        sandbox = await ctx.open_sandbox()  # fresh: nothing but the diff carries over from the agent's sandbox
        verdict = await judge(
            sandbox,
            repo_dir=instance.repo_dir,
            base_commit=instance.base_commit,
            patch=patch,
            test_patch=instance.test_patch,
            fail_to_pass=instance.FAIL_TO_PASS,
            pass_to_pass=instance.PASS_TO_PASS,
            pythonpath=instance.pythonpath,
            timeout_s=float(instance.eval_timeout_s),
            evaluation=instance.evaluation(),
            swebench_grading=instance.swebench_grading,
        )
        return EvalOutcome(1.0 if verdict.resolved else 0.0, {**details, **verdict.details()})
