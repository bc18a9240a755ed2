"""Running the judging harness (sandbox/runtime/prorl_judge.py) for a verifier.

The harness writes its verdict on a pipe the judged code cannot reach, so the
judged code can at most prevent a verdict: kill the harness, its runner or the
runtime, or run it out of time. Such a run has no verdict; verifiers score it
0 as `no_verdict`, never as an infrastructure failure a trainer would mask.
Only what the judged code cannot have caused (the container taken away from
outside, a request the runtime refused) stays an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prorl_server.errors import PolicyError
from prorl_server.sandbox.base import JudgeResult, Sandbox

NO_VERDICT = "no_verdict"
# Seconds the harness may take beyond the judged code's own time (start-up, git, clean-up).
HARNESS_GRACE_S = 30.0
LOG_TAIL_CHARS = 3000


async def run_harness(sandbox: Sandbox, mode: str, spec: Mapping[str, Any], timeout_s: float) -> JudgeResult:
    """The harness's result; a sandbox the judged code broke gives a result without a verdict."""
    try:
        return await sandbox.judge(mode, spec, timeout_s=timeout_s)
    except PolicyError as exc:  # e.g. the runtime killed from inside: only the judged code runs there
        return JudgeResult(None, problem=f"the judged code broke its sandbox ({exc.reason}): {exc.message}")


def no_verdict_details(result: JudgeResult) -> dict[str, Any]:
    return {
        "verdict": NO_VERDICT,
        "reason": result.problem or "the judging harness gave no verdict",
        "output": result.output[-LOG_TAIL_CHARS:],
    }
