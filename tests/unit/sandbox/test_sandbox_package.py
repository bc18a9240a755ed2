"""The in-sandbox package's shape where the judge's trust depends on it: every module the
harness runs is loaded when it starts (before any repository is on sys.path), and the
reporter's fingerprint covers the package's modules, so code under test that replaces a
function the reporter calls is seen."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_server.sandbox.runtime import PACKAGE_DIR, RUNTIME_DIR
from prorl_server.sandbox.runtime.prorl_sandbox_runtime import pytest_runner, repo_files, runner_guards

PACKAGE = "prorl_server.sandbox.runtime.prorl_sandbox_runtime"


def relative_imports(path: Path) -> tuple[set[str], set[str]]:
    """The package modules `path` imports at its top level, and those it imports inside a function."""
    top: set[str] = set()
    late: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            top.update([node.module] if node.module else [alias.name for alias in node.names])
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.level == 1:
                    late.add(inner.module or "")
    return top, late


def test_every_module_the_judge_runs_is_imported_when_it_starts() -> None:
    """Walk judge_main's imports: none of the modules reached imports a module of the package
    late (inside a function), where a repository on sys.path could matter."""
    reached, todo = set(), ["judge_main"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        top, late = relative_imports(PACKAGE_DIR / f"{name}.py")
        assert not late, f"{name}.py imports {sorted(late)} inside a function"
        todo.extend(module for module in top if (PACKAGE_DIR / f"{module}.py").exists())
    assert {"pytest_runner", "django_sympy_runners", "judge_swe", "candidate", "wire"} <= reached


def test_a_fresh_judge_process_has_the_whole_harness_loaded_before_it_reads_its_spec() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(RUNTIME_DIR)!r});"
        "import prorl_sandbox_runtime.judge_main;"
        "print(sorted(n for n in sys.modules if n.startswith('prorl_sandbox_runtime.')))"
    )
    result = subprocess.run([sys.executable, "-I", "-B", "-c", code], capture_output=True, text=True, check=True)
    loaded = {name.rpartition(".")[2] for name in ast.literal_eval(result.stdout.strip())}
    reached = {"judge_main"}
    for name in list(loaded):
        reached |= relative_imports(PACKAGE_DIR / f"{name}.py")[0]
    assert reached <= loaded | {"JUDGE_SCRIPT"}
    assert "bash" not in loaded and "server" not in loaded  # the runtime's modules stay out


def test_the_reporters_fingerprint_covers_the_package_modules_it_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conftest.py of the code under test that makes every test file look like the task's (by
    replacing file_digest) changes a fingerprinted entry: the run is reported tampered."""

    class Reporter:
        def pytest_runtest_logreport(self, report: object) -> None: ...

    assert importlib.import_module(PACKAGE) in runner_guards.own_modules()
    before = pytest_runner._fingerprint(Reporter)
    for key in (
        f"{PACKAGE}.repo_files.file_digest",
        f"{PACKAGE}.runner_guards.changed_keys",
        "reporter.pytest_runtest_logreport",
    ):
        assert key in before
    assert runner_guards.changed_keys(before, pytest_runner._fingerprint(Reporter)) == []
    monkeypatch.setattr(repo_files, "file_digest", lambda path: "the task's digest")
    assert runner_guards.changed_keys(before, pytest_runner._fingerprint(Reporter)) == [
        f"{PACKAGE}.repo_files.file_digest"
    ]
