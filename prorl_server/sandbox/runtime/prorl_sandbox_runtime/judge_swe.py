"""Swe mode: apply the model's patch, restore the test infrastructure it touched and
the test files, apply the test patch, and run the tests (pytest, or the instance's
official Django or SymPy command), their outcomes from the report pipe.
"""

import os
import shutil
import tempfile

from .pytest_run import run_pytest
from .repo_files import (
    applies_at_base,
    apply_patch,
    capped_list,
    file_digests,
    files_changed,
    git,
    is_test_infrastructure,
    nul_paths,
    package_inits,
    patch_paths,
    restore_protected,
    say,
    test_file_of,
    watched_files,
)
from .swebench_commands import run_runner


def judge_swe(spec):
    """Patch, restore test infrastructure, patch the tests, run them with the reporter."""
    workdir = tempfile.mkdtemp(prefix="prorl-judge-")
    try:
        return _judge_swe(spec, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _judge_swe(spec, workdir):
    repo = str(spec["repo_dir"])
    base = str(spec["base_commit"])
    tests = [str(test) for test in spec["tests"]]
    verdict = {"stage": "model_patch", "restored": [], "deleted": []}
    _, others, _ = git(repo, ["ls-files", "-z", "--others"])
    untracked_before = set(nul_paths(others))
    if spec.get("patch", "").strip():
        applied, log, _ = apply_patch(repo, spec["patch"], "model.patch", workdir)
        if not applied:
            verdict.update(ok=False, output=log)
            return verdict
    test_patch = str(spec.get("test_patch", ""))
    protected_files = set(test_file_of(test) for test in tests)
    protected_files.update(str(path) for path in spec.get("infrastructure") or [])
    # Every file under a tests/ folder is the tests' (helpers a test module imports
    # included): a fix has no business there. Off only when the spec says so.
    test_dirs = spec.get("protect_test_dirs", True) is not False
    test_patch_file = None
    if test_patch.strip():
        test_patch_file = os.path.join(workdir, "test.patch")
        with open(test_patch_file, "wb") as handle:
            handle.write(test_patch.encode("utf-8", "surrogateescape"))
        protected_files.update(patch_paths(repo, test_patch_file))
    protected_files.update(package_inits(set(test_file_of(test) for test in tests) | protected_files))
    ancestors = set()
    for path in protected_files:
        parts = path.split("/")
        ancestors.update("/".join(parts[:index]) for index in range(1, len(parts)))

    def protected(path):
        if test_dirs and "tests" in path.split("/")[:-1]:
            return True  # test packages (Django's tests/, SymPy's */tests/, a pytest suite's helpers)
        if path in protected_files or is_test_infrastructure(path):
            return True
        # Whatever stands where a protected file must go: a directory at a test file's
        # path (a file inside it), or a file or link where its folder must be.
        return path in ancestors or any(path.startswith(other + "/") for other in protected_files)

    verdict["stage"] = "restore"
    restored, deleted, still = restore_protected(repo, base, protected, untracked_before)
    verdict.update(restored=capped_list(restored), deleted=capped_list(deleted))
    if restored or deleted:
        say("restored to %s: %s\ndeleted: %s" % (base[:12], restored, deleted))
    if still:
        verdict.update(ok=False, output="cannot restore: %s" % capped_list(still, 20))
        return verdict
    verdict["stage"] = "test_patch"
    if test_patch_file is not None:
        applied, log, _ = apply_patch(repo, test_patch, "test.patch", workdir)
        if not applied:
            # The task's fault only if it does not apply at the base commit either;
            # otherwise the model's patch (what is left of it) stands in its way.
            verdict.update(ok=False, output=log, applies_at_base=applies_at_base(repo, base, test_patch_file, workdir))
            return verdict
    verdict["stage"] = "tests"
    watched = watched_files(repo, protected)
    before = file_digests(repo, watched)
    verdict["watched_files"] = len(watched)
    if spec.get("runner", "pytest") == "pytest":
        verdict.update(ok=True, **run_pytest(repo, spec, tests, workdir, before))
    else:
        verdict.update(ok=True, **run_runner(repo, spec, workdir, before))
    verdict["anomalies"] = list(verdict.get("anomalies") or []) + files_changed(repo, protected, before)
    return verdict
