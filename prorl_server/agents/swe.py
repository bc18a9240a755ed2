"""SWE: fix a real repository so that its failing tests pass (SWE-bench style).

Instances carry SWE-bench's fields: instance_id, repo, base_commit,
problem_statement, patch (the gold fix, never shown to the agent), test_patch,
FAIL_TO_PASS and PASS_TO_PASS (lists, or JSON strings of lists as in the
published datasets), plus `image`, a sandbox image holding the repository at
base_commit in `repo_dir` (default /testbed). Optional: `pythonpath` for the
tests (e.g. "src") and `eval_timeout_s`.

The agent works with bash and the file editor. Its submission is whatever the
repository's `git diff` against base_commit says when it stops, never text the
model wrote; evaluation applies that diff in a fresh sandbox from the same
image (see verifiers/swe.py).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from prorl_server.agents.base import EvalOutcome, RolloutContext
from prorl_server.agents.loop import ToolLoopHandler, describe_tools, run_tool_loop
from prorl_server.agents.tools import BashTool, EditorTool, FinishTool
from prorl_server.errors import InfrastructureError, InvalidArgument, PolicyError
from prorl_server.verifiers.swe import judge

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


def node_ids(instance: dict[str, Any], field: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list, whether given as a list or as a JSON string of one."""
    value = instance.get(field, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"swe instance field {field!r} is a string but not a JSON list: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(test, str) and test.strip() for test in value):
        raise InvalidArgument(f"swe instance field {field!r} must be a list of pytest node ids")
    return value


class SWEHandler(ToolLoopHandler):
    name = "swe"
    tools = (BashTool(), EditorTool(), SubmitTool())

    def image_for(self, instance: dict[str, Any]) -> str | None:
        image = instance.get("image")
        return image if isinstance(image, str) and image else None

    def validate(self, instance: dict[str, Any]) -> None:
        for key in ("instance_id", "repo", "base_commit", "problem_statement", "image"):
            if not isinstance(instance.get(key), str) or not instance[key].strip():
                raise InvalidArgument(f"swe instance needs a non-empty string field {key!r}")
        if not _COMMIT.match(instance["base_commit"]):
            raise InvalidArgument("swe instance field 'base_commit' must be a hex commit id (7-40 lowercase digits)")
        for key in ("patch", "test_patch", "pythonpath"):
            if not isinstance(instance.get(key, ""), str):
                raise InvalidArgument(f"swe instance field {key!r} must be a string")
        repo_dir = instance.get("repo_dir", DEFAULT_REPO_DIR)
        if not isinstance(repo_dir, str) or not repo_dir.startswith("/"):
            raise InvalidArgument("swe instance field 'repo_dir' must be an absolute path")
        if not node_ids(instance, "FAIL_TO_PASS"):
            raise InvalidArgument("swe instance field 'FAIL_TO_PASS' must name at least one test")
        node_ids(instance, "PASS_TO_PASS")
        timeout = instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise InvalidArgument("swe instance field 'eval_timeout_s' must be a number in (0, 3600]")

    @staticmethod
    def repo_dir(instance: dict[str, Any]) -> str:
        return str(instance.get("repo_dir", DEFAULT_REPO_DIR))

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return USER_PROMPT.format(
            repo=instance["repo"], repo_dir=self.repo_dir(instance), problem_statement=instance["problem_statement"]
        )

    async def init(self, ctx: RolloutContext) -> None:
        sandbox = await ctx.open_sandbox()
        repo_dir = shlex.quote(self.repo_dir(ctx.instance))
        result = await sandbox.bash(f"cd {repo_dir} && git rev-parse HEAD", timeout_s=60)
        found = result.output.strip()
        head = found.splitlines()[-1] if found else ""
        if result.exit_code != 0 or not head.startswith(ctx.instance["base_commit"]):
            raise InfrastructureError(
                f"image {ctx.instance['image']!r} does not hold the repository at base_commit "
                f"{ctx.instance['base_commit']} in {self.repo_dir(ctx.instance)} (found: {found[-300:]!r})",
                reason="swe_image_mismatch",
            )

    async def run(self, ctx: RolloutContext) -> None:
        repo_dir = self.repo_dir(ctx.instance)
        outcome = await run_tool_loop(
            ctx,
            system_prompt=SYSTEM_PROMPT.format(repo_dir=repo_dir, tools=describe_tools(self.tools)),
            user_prompt=self.user_prompt(ctx.instance),
            tools=self.tools,
        )
        ctx.state["stop_reason"] = outcome.stop_reason
        ctx.state["patch"] = await self._repository_diff(ctx, repo_dir)

    @staticmethod
    async def _repository_diff(ctx: RolloutContext, repo_dir: str) -> str:
        """The submission: every change in the work tree (new files included) against base_commit."""
        out = "/tmp/prorl-submission.patch"
        base = shlex.quote(ctx.instance["base_commit"])
        result = await ctx.sandbox.bash(
            f"cd {shlex.quote(repo_dir)} && git add -A && git diff --cached --binary {base} > {out}", timeout_s=120
        )
        if result.exit_code != 0:
            # Init saw git work at base_commit, and since then only the agent's commands
            # ran here: a diff that fails now (.git deleted, /tmp full) is the policy's doing.
            raise PolicyError(
                f"git diff of the agent's repository failed: {result.output[-500:]}", reason="swe_diff_failed"
            )
        return (await ctx.sandbox.read_file(out, max_bytes=MAX_PATCH_BYTES + 1)).decode(errors="replace")

    async def evaluate(self, ctx: RolloutContext) -> EvalOutcome:
        instance = ctx.instance
        patch = str(ctx.state.get("patch", ""))
        details: dict[str, Any] = {
            "stop_reason": ctx.state.get("stop_reason"),
            "instance_id": instance["instance_id"],
            "patch": patch,
        }
        if len(patch) > MAX_PATCH_BYTES:
            return EvalOutcome(0.0, {**details, "patch": patch[:4096], "verdict": "patch_too_large"})
        sandbox = await ctx.open_sandbox()  # fresh: nothing but the diff carries over from the agent's sandbox
        verdict = await judge(
            sandbox,
            repo_dir=self.repo_dir(instance),
            base_commit=instance["base_commit"],
            patch=patch,
            test_patch=str(instance.get("test_patch", "")),
            fail_to_pass=node_ids(instance, "FAIL_TO_PASS"),
            pass_to_pass=node_ids(instance, "PASS_TO_PASS"),
            pythonpath=str(instance.get("pythonpath", "")),
            timeout_s=float(instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)),
        )
        return EvalOutcome(1.0 if verdict.resolved else 0.0, {**details, **verdict.details()})
