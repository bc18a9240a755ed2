"""SWE-bench-style judging: apply a patch to the repository at its base commit
in a fresh sandbox, put the task's tests in place, run FAIL_TO_PASS and
PASS_TO_PASS with pytest, and resolve only if every one of them passes.

The steps follow SWE-bench's harness: the model's patch first, then the test
files the test patch touches are reset to the base commit (so the model cannot
have pre-empted them) and the test patch is applied; test outcomes are read
from pytest's `-rA` summary lines.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_server.errors import InfrastructureError
from prorl_server.sandbox.base import Sandbox

EVAL_DIR = "/tmp/prorl-eval"
PASSING = frozenset({"PASSED", "XFAIL"})
_STATUSES = ("PASSED", "FAILED", "ERROR", "XFAIL", "XPASS", "SKIPPED")
_FILE_HEADER = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|--- a/(\S+)|\+\+\+ b/(\S+))", re.MULTILINE)


@dataclass
class SWEVerdict:
    resolved: bool
    verdict: str
    """resolved, unresolved, patch_does_not_apply or tests_timed_out."""
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    log_tail: str = ""

    def details(self) -> dict[str, Any]:
        def failing(results: dict[str, str]) -> list[str]:
            return [test for test, status in results.items() if status not in PASSING]

        return {
            "verdict": self.verdict,
            "resolved": self.resolved,
            "fail_to_pass": self.fail_to_pass,
            "pass_to_pass_passed": len(self.pass_to_pass) - len(failing(self.pass_to_pass)),
            "pass_to_pass_failing": failing(self.pass_to_pass),
            "log_tail": self.log_tail,
        }


def patched_files(patch: str) -> list[str]:
    """Every path a unified diff touches (old and new names; git or plain headers)."""
    paths: list[str] = []
    for match in _FILE_HEADER.findall(patch):
        for path in match:
            if path and path not in paths:
                paths.append(path)
    return paths


def statuses_from_log(log: str, tests: Sequence[str]) -> dict[str, str]:
    """Each test's status from pytest's `-rA` summary; a test it never reports is MISSING."""
    reported: dict[str, str] = {}
    for line in log.splitlines():
        status, _, rest = line.partition(" ")
        if status in _STATUSES:
            reported.setdefault(rest, status)
            test, sep, _ = rest.partition(" - ")
            if sep:
                reported.setdefault(test, status)
    return {test: reported.get(test, "MISSING") for test in tests}


async def _git_apply(sandbox: Sandbox, repo: str, patch: str, name: str, timeout_s: float) -> tuple[bool, str]:
    path = f"{EVAL_DIR}/{name}"
    await sandbox.write_file(path, patch.encode())
    result = await sandbox.bash(
        f"cd {shlex.quote(repo)} && git apply --verbose --whitespace=nowarn {path}", timeout_s=timeout_s
    )
    return result.exit_code == 0, result.output[-2000:]


async def judge(
    sandbox: Sandbox,
    *,
    repo_dir: str,
    base_commit: str,
    patch: str,
    test_patch: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    pythonpath: str,
    timeout_s: float,
) -> SWEVerdict:
    """Judge `patch` in `sandbox`, a fresh sandbox whose repository is at `base_commit`."""
    repo = shlex.quote(repo_dir)
    await sandbox.bash(f"mkdir -p {EVAL_DIR}", timeout_s=30)
    if patch.strip():
        applied, output = await _git_apply(sandbox, repo_dir, patch, "model.patch", 60)
        if not applied:
            return SWEVerdict(False, "patch_does_not_apply", log_tail=output)
    if test_patch.strip():
        resets = " ; ".join(
            f"(git checkout -q {shlex.quote(base_commit)} -- {shlex.quote(p)} 2>/dev/null || rm -f -- {shlex.quote(p)})"
            for p in patched_files(test_patch)
        )
        await sandbox.bash(f"cd {repo} && {resets}", timeout_s=60)
        applied, output = await _git_apply(sandbox, repo_dir, test_patch, "test.patch", 60)
        if not applied:
            raise InfrastructureError(
                f"the task's test_patch does not apply at {base_commit}: {output[-500:]}", reason="swe_test_patch"
            )
    tests = list(dict.fromkeys([*fail_to_pass, *pass_to_pass]))
    env = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    selected = " ".join(shlex.quote(test) for test in tests)
    log_path = f"{EVAL_DIR}/pytest.log"
    run = await sandbox.bash(
        f"cd {repo} && {env}python3 -m pytest -rA -p no:cacheprovider {selected} > {log_path} 2>&1",
        timeout_s=timeout_s,
    )
    log = (await sandbox.read_file(log_path, max_bytes=4 << 20)).decode(errors="replace")
    tail = log[-3000:]
    if run.timed_out:
        return SWEVerdict(False, "tests_timed_out", log_tail=tail)
    f2p = statuses_from_log(log, fail_to_pass)
    p2p = statuses_from_log(log, pass_to_pass)
    resolved = all(status in PASSING for status in [*f2p.values(), *p2p.values()])
    return SWEVerdict(resolved, "resolved" if resolved else "unresolved", f2p, p2p, tail)
