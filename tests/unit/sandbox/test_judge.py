"""The judging harness's pure parts (the modules of sandbox/runtime/prorl_sandbox_runtime that
prorl_judge.py runs): the plain-data codec, the test-infrastructure matcher, reading the reporter's
outcome stream, and the server's reading of a harness run."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from prorl_server.sandbox.runtime.prorl_sandbox_runtime import (
    judge_function,
    plain_data,
    pytest_run,
    repo_files,
    swebench_commands,
)
from prorl_server.sandbox.runtime.protocol import JudgeResponse
from prorl_server.sandbox.sandbox import judge_result

PLAIN_VALUES: list[Any] = [
    None,
    True,
    0,
    -(10**5000),  # beyond int's decimal digit limit: ints travel as hex
    1.5,
    -0.0,
    math.inf,
    "héllo \ud800",  # a lone surrogate survives JSON
    b"\x00\xff",
    bytearray(b"ab"),
    1 + 2j,
    [1, [2, (3, "x")]],
    (1,),
    {"a": [1], (1, 2): {3: None}, frozenset({1}): 0.25},
    {1, 2, 3},
    frozenset({"a"}),
    [],
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=lambda v: type(v).__name__)
def test_plain_data_round_trips_exactly(value: Any) -> None:
    wire = json.loads(json.dumps(plain_data.encode_plain(value)))
    decoded = plain_data.decode_plain(wire)
    assert decoded == value and type(decoded) is type(value)


def test_floats_keep_nan_and_the_sign_of_zero() -> None:
    assert math.isnan(plain_data.decode_plain(plain_data.encode_plain(math.nan)))
    assert math.copysign(1, plain_data.decode_plain(plain_data.encode_plain(-0.0))) == -1


class AlwaysEqual:
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


class SneakyInt(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


class SneakyList(list[int]):
    pass


def _cycle() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


@pytest.mark.parametrize(
    "value",
    [AlwaysEqual(), SneakyInt(1), SneakyList([1]), [1, AlwaysEqual()], {"k": SneakyInt(2)}, _cycle(), len, iter([])],
    ids=["always-equal", "int-subclass", "list-subclass", "nested", "dict-value", "cycle", "function", "iterator"],
)
def test_anything_but_exact_builtin_data_is_refused(value: Any) -> None:
    with pytest.raises(plain_data.NotPlainData):
        plain_data.encode_plain(value)


@pytest.mark.parametrize(
    "wire",
    [
        ["bool", 1],
        ["int", 5],
        ["int", "zz"],
        ["float", "not a float"],
        ["str", 3],
        ["bytes", "!!"],
        ["list", "abc"],
        ["dict", [[["list", []], ["none"]]]],  # an unhashable key
        ["set", [["list", []]]],
        ["object", "AlwaysEqual"],
        "str",
        [],
        ["none", 1],
        ["dict", [[["none"]]]],
    ],
)
def test_decoding_trusts_nothing(wire: Any) -> None:
    with pytest.raises(plain_data.NotPlainData):
        plain_data.decode_plain(wire)


def test_decoding_refuses_deep_nesting() -> None:
    wire: Any = ["none"]
    for _ in range(plain_data.MAX_DEPTH + 5):
        wire = ["list", [wire]]
    with pytest.raises(plain_data.NotPlainData, match="deeper"):
        plain_data.decode_plain(wire)


def test_the_candidate_is_the_prompt_completed_or_a_whole_function_after_it() -> None:
    prompt = "def helper():\n    return 1\n\ndef add(a, b):\n    '''Add.'''\n"
    assert judge_function.candidate_sources(prompt, "    return a + b\n", "add") == [
        ("<answer>", prompt + "    return a + b\n", True)
    ]
    whole = "def add(a, b):\n    return a + b + helper() - 1\n"
    assert judge_function.candidate_sources(prompt, whole, "add") == [
        ("<prompt>", prompt, False),
        ("<answer>", whole, True),
    ]


@pytest.mark.parametrize(
    "path",
    [
        "conftest.py",
        "tests/conftest.py",
        "a/b/c/conftest.py",
        "pytest.ini",
        "tests/pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "sub/pyproject.toml",
        "pyproject.toml",
        "src/sitecustomize.py",
        "usercustomize.py",
        "evil.pth",
        "src/pkg/__pycache__/mod.cpython-311.pyc",
        "pkg/mod.pyc",
        "evil-1.0.dist-info/entry_points.txt",
        "src/evil-1.0.dist-info/METADATA",
        "parse.egg-info/entry_points.txt",
        "x.egg-info",
        "pkg.egg-link",
        "__pycache__/anything",
        ".gitattributes",
        # whatever the case: importlib.metadata finds X.DIST-INFO folders
        "EVIL_PLUGIN-1.0.DIST-INFO/entry_points.txt",
        "src/Evil.Egg-Info/entry_points.txt",
        "tests/CONFTEST.PY",
        "Evil.PTH",
        "PyProject.toml",
        "SETUP.CFG",
        "pkg/__PYCACHE__/x.pyc",
        # site's start-up modules in any form, eggs, stray entry points
        "sitecustomize/__init__.py",
        "src/usercustomize.cpython-311-x86_64-linux-gnu.so",
        "evil-1.0-py3.11.egg",
        "evil.egg/EGG-INFO/entry_points.txt",
        "anywhere/entry_points.txt",
        ".pytest_cache/v/cache/lastfailed",
    ],
)
def test_test_infrastructure_is_recognised_anywhere(path: str) -> None:
    assert repo_files.is_test_infrastructure(path)


@pytest.mark.parametrize(
    "path",
    [
        "idna/core.py",
        "tests/test_idna.py",
        "src/click/types.py",
        "conftest_helpers.py",
        "docs/setup.rst",
        "",
        "a//b",
        "setup.py",
        "pkg/site.py",
        "docs/sitecustomizing.rst",
    ],
)
def test_ordinary_files_are_not_infrastructure(path: str) -> None:
    assert not repo_files.is_test_infrastructure(path)


def report(nodeid: str, when: str, outcome: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "report", "nodeid": nodeid, "when": when, "outcome": outcome, "key": KEY, **extra}


def run_of(nodeid: str, call: str = "passed", **extra: Any) -> list[dict[str, Any]]:
    return [
        report(nodeid, "setup", "passed"),
        report(nodeid, "call", call, **extra),
        report(nodeid, "teardown", "passed"),
    ]


A, B, C = "t.py::a", "t.py::b", "t.py::c"


KEY = "0123abcd"


def stream(*reports: dict[str, Any], exitstatus: int = 0, collected: tuple[str, ...] = (A, B)) -> list[dict[str, Any]]:
    frames = [
        {"kind": "collected", "nodeids": list(collected)},
        *reports,
        {"kind": "finished", "exitstatus": exitstatus},
        {"kind": "exit", "code": exitstatus},
    ]
    return [{"key": KEY, **frame} for frame in frames]


def test_statuses_follow_pytests_summary() -> None:
    frames = stream(
        *run_of(A),
        *run_of(B, "failed"),
        report(C, "setup", "failed"),
        exitstatus=1,
        collected=(A, B, C),
    )
    outcome = pytest_run.aggregate_reports(frames, [A, B, C, "t.py::never"], KEY)
    assert outcome["statuses"] == {A: "PASSED", B: "FAILED", C: "ERROR", "t.py::never": "MISSING"}
    assert outcome["complete"] and outcome["anomalies"] == [] and outcome["exit_code"] == 1


@pytest.mark.parametrize(
    ("phases", "status"),
    [
        ([("setup", "skipped", True, False)], "XFAIL"),
        ([("setup", "skipped", False, False)], "SKIPPED"),
        ([("setup", "passed", False, False), ("call", "skipped", True, False)], "XFAIL"),
        ([("setup", "passed", False, False), ("call", "passed", True, False)], "XPASS"),
        ([("call", "passed", False, False), ("teardown", "failed", False, False)], "ERROR"),
        ([("call", "passed", False, False), ("call", "failed", False, True)], "FAILED"),  # a failing subtest
        ([("call", "failed", False, False), ("call", "passed", False, False)], "FAILED"),  # a pass never hides one
        ([], "MISSING"),
    ],
)
def test_phase_status(phases: list[tuple[str, str, bool, bool]], status: str) -> None:
    assert pytest_run.phase_status(phases) == status


@pytest.mark.parametrize(
    ("frames", "anomaly"),
    [
        (stream(*run_of(A), report(A, "call", "passed"), *run_of(B)), "two call reports"),
        (stream(*run_of(A), *run_of(B), *run_of(C)), "not collected"),
        (stream(*run_of(A), *run_of(B, "failed"), exitstatus=0), "reported success, but a test failed"),
        (stream(*run_of(A), *run_of(B), exitstatus=1), "none failed"),
        ([*stream(*run_of(A), *run_of(B)), report(A, "call", "passed")], "after the runner's last"),
        (
            stream(*run_of(A), {"kind": "tampered", "names": ["_pytest.runner.call_and_report"]}, *run_of(B)),
            "tampered with: ['_pytest.runner.call_and_report']",
        ),
        (stream(*run_of(A), {"kind": "verdict", "passed": True}, *run_of(B)), "unexpected verdict frame"),
        (
            [{**frame, "key": "guessed"} if frame["kind"] == "report" else frame for frame in stream(*run_of(A))],
            "did not come from the reporter",
        ),
    ],
    ids=[
        "duplicate",
        "uncollected",
        "success-with-failure",
        "failure-without-one",
        "late",
        "tampered",
        "unknown",
        "no-key",
    ],
)
def test_a_stream_that_does_not_add_up_is_an_anomaly(frames: list[dict[str, Any]], anomaly: str) -> None:
    outcome = pytest_run.aggregate_reports(frames, [A, B], KEY)
    assert any(anomaly in text for text in outcome["anomalies"]), outcome["anomalies"]


def test_a_stream_without_its_last_frames_is_incomplete() -> None:
    frames = stream(*run_of(A), *run_of(B))[:-2]  # the runner was killed or made to exit
    outcome = pytest_run.aggregate_reports(frames, [A, B], KEY)
    assert not outcome["complete"] and outcome["statuses"] == {A: "PASSED", B: "PASSED"}


def reply(**fields: Any) -> JudgeResponse:
    return JudgeResponse(**{"exit_code": 0, "timed_out": False, "output": "log", "duration_s": 1.0, **fields})


def test_a_verdict_counts_only_from_a_harness_that_ended_by_itself() -> None:
    assert judge_result(reply(verdict='{"passed": true}')).verdict == {"passed": True}
    for fields, problem in [
        ({"verdict": '{"passed": true}', "exit_code": -9}, "exit status -9"),
        ({"verdict": '{"passed": true}', "timed_out": True}, "out of time"),
        ({"verdict": None}, "no verdict"),
        ({"verdict": "[true]"}, "malformed"),
        ({"verdict": '{"passed": tr'}, "malformed"),
        ({"verdict": None, "verdict_truncated": True}, "oversized"),
    ]:
        result = judge_result(reply(**fields))
        assert result.verdict is None and problem in result.problem, (fields, result.problem)
        assert result.output == "log"


def runner_report(name: str, status: str, test_id: str = "", *, sub: bool = False, key: str = KEY) -> dict[str, Any]:
    return {"kind": "report", "id": test_id or name, "name": name, "status": status, "sub": sub, "key": key}


def test_django_and_sympy_outcomes_by_the_parsers_names() -> None:
    frames = [
        {"kind": "started", "key": KEY},
        runner_report("test_a (app.tests.T.test_a)", "PASSED"),
        runner_report("A docstring's first line.", "SKIPPED"),
        runner_report("test_b (app.tests.T.test_b)", "PASSED"),
        runner_report("test_b (app.tests.T.test_b)", "FAILED", sub=True),  # a failing subtest fails its test
        {"kind": "exit", "code": 1, "key": KEY},
    ]
    outcome = swebench_commands.aggregate_results(frames, KEY)
    assert outcome["statuses"] == {
        "test_a (app.tests.T.test_a)": "PASSED",
        "A docstring's first line.": "SKIPPED",
        "test_b (app.tests.T.test_b)": "FAILED",
    }
    assert outcome["complete"] and not outcome["anomalies"]


@pytest.mark.parametrize(
    ("frames", "anomaly"),
    [
        ([runner_report("t", "PASSED", key="forged")], "did not come from the reporter"),
        ([runner_report("t", "PASSED", "x@1"), runner_report("t", "PASSED", "x@1")], "two reports for x@1"),
        ([{"kind": "foreign", "what": "addSuccess(t)", "key": KEY}], "from outside the test runner"),
        ([{"kind": "tampered", "names": ["unittest.case.TestCase.run"], "key": KEY}], "tampered with"),
        ([runner_report("t", "FAILED")], "reported success, but a test failed"),
        ([runner_report("t", "BETTER")], "a report with status"),
    ],
)
def test_runner_outcomes_that_do_not_add_up(frames: list[dict[str, Any]], anomaly: str) -> None:
    outcome = swebench_commands.aggregate_results([*frames, {"kind": "exit", "code": 0, "key": KEY}], KEY)
    assert any(anomaly in found for found in outcome["anomalies"]), outcome["anomalies"]


def test_a_runner_stream_without_exit_is_incomplete() -> None:
    outcome = swebench_commands.aggregate_results([runner_report("t", "PASSED")], KEY)
    assert not outcome["complete"] and outcome["statuses"] == {"t": "PASSED"}


def test_the_init_of_test_folders_is_protected_never_the_packages() -> None:
    found = repo_files.package_inits({"tests/unit/test_a.py", "sympy/matrices/tests/test_m.py", "lib/mod.py"})
    assert found == {"tests/__init__.py", "tests/unit/__init__.py", "sympy/matrices/tests/__init__.py"}


def git_repo(path: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    for command in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
    ):
        subprocess.run(["git", *command], cwd=path, check=True, env=repo_files.git_env())
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()


def test_a_test_patch_that_applies_at_the_base_commit_is_told_apart(tmp_path: Path) -> None:
    """The harness checks the test patch against the base commit's tree (a scratch index):
    blocked by the model's patch when it applies there, the task's own fault when not."""
    repo = tmp_path / "repo"
    repo.mkdir()
    base = git_repo(repo, {"tests/test_a.py": "def test_a():\n    pass\n"})
    adds = tmp_path / "adds.patch"
    adds.write_text(
        "diff --git a/tests/test_b.py b/tests/test_b.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/tests/test_b.py\n@@ -0,0 +1 @@\n+x = 1\n"
    )
    (repo / "tests" / "test_b.py").mkdir()  # what a model's patch may leave in its way
    (repo / "tests" / "test_b.py" / "x").write_text("x")
    assert repo_files.applies_at_base(str(repo), base, str(adds), str(tmp_path))
    wrong = tmp_path / "wrong.patch"
    wrong.write_text("--- a/tests/test_a.py\n+++ b/tests/test_a.py\n@@ -1 +1 @@\n-def test_z():\n+def test_y():\n")
    assert not repo_files.applies_at_base(str(repo), base, str(wrong), str(tmp_path))


def test_the_run_may_not_change_the_tests_files(tmp_path: Path) -> None:
    """Test files and test infrastructure hashed before the run and compared after it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git_repo(repo, {"tests/test_a.py": "def test_a():\n    pass\n", "tests/test_c.py": "", "lib.py": ""})

    def protected(path: str) -> bool:
        return path.startswith("tests/test_") or repo_files.is_test_infrastructure(path)

    before = repo_files.file_digests(str(repo), repo_files.watched_files(str(repo), protected))
    assert repo_files.files_changed(str(repo), protected, before) == []
    (repo / "lib.py").write_text("changed")  # the code under test may change
    assert repo_files.files_changed(str(repo), protected, before) == []
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    assert True\n")
    (repo / "tests" / "test_c.py").unlink()
    (repo / "tests" / "conftest.py").write_text("")
    (repo / "Evil.PTH").write_text("")
    [changed] = repo_files.files_changed(str(repo), protected, before)
    for item in (
        "tests/test_a.py (rewritten)",
        "tests/test_c.py (deleted)",
        "tests/conftest.py (new)",
        "Evil.PTH (new)",
    ):
        assert item in changed, changed
