"""prorl_server.verifiers.swebench against the official swebench package.

The same test logs (tests/data/swebench_logs: Django's runtests.py, SymPy's
bin/test, pytest -rA, pytest -vv classic, each as the official evaluation
script prints it) go through swebench 5.0.2's own parsers and grading
functions and through ours: the status maps, per-test outcomes and
resolutions must be equal. Then the reward hack a policy would write: a patch
whose code prints `... ok` lines for the failing tests and exits 0 fools
swebench's log grading, and `cross_check` against the judge's trusted
outcomes catches it.

swebench 5.0.2 is installed without its dependencies (docker, modal,
datasets, ...): `pip install --no-deps swebench==5.0.2 unidiff`. Its
`swebench.harness` package imports docker and modal eagerly, so the modules
used here (constants, log_parsers, grading: standard library and unidiff only)
are loaded below it without running that `__init__`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prorl_server.verifiers.swebench import grading, parsers, specs

LOGS = Path(__file__).resolve().parents[2] / "data" / "swebench_logs"
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "swe_datasets"


@dataclass
class Official:
    parsers: Any
    grading: Any
    TestSpec: Any


@pytest.fixture(scope="module")
def official() -> Iterator[Official]:
    found = importlib.util.find_spec("swebench")
    if found is None or not found.submodule_search_locations:
        pytest.skip("swebench is not installed (pip install --no-deps swebench==5.0.2 unidiff)")
    assert importlib.import_module("swebench").__version__ == "5.0.2"
    saved = {name: module for name, module in sys.modules.items() if name.startswith("swebench.")}
    harness = types.ModuleType("swebench.harness")
    harness.__path__ = [str(Path(found.submodule_search_locations[0]) / "harness")]
    sys.modules["swebench.harness"] = harness
    try:
        log_parsers = importlib.import_module("swebench.harness.log_parsers")
        official_grading = importlib.import_module("swebench.harness.grading")
        test_spec = importlib.import_module("swebench.types").TestSpec
        yield Official(log_parsers, official_grading, test_spec)
    finally:
        for name in [name for name in sys.modules if name.startswith("swebench.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def spec_of(official: Official, parser: str, f2p: list[str], p2p: list[str], eval_type: str = "pass_and_fail") -> Any:
    return official.TestSpec(
        instance_id="x__y-1",
        image="img",
        eval_script_list=[],
        repo="x/y",
        version="1.0",
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        log_parser=parser,
        eval_type=eval_type,
    )


DJANGO = "utils_tests.test_dateformat.DateFormatTests"
CASES = {
    "django.log": (
        "parse_log_django",
        [f"test_year_before_1000 ({DJANGO})", f"test_invalid_time_format_specifiers ({DJANGO})"],
        [
            f"test_am_pm ({DJANGO})",
            "Naive datetimes are formatted in the local time zone.",
            f"test_r_format_with_non_en_locale ({DJANGO})",
            f"test_naive_ambiguous_datetime ({DJANGO})",
        ],
    ),
    "sympy.log": (
        "parse_log_sympy",
        ["test_latex_symbols", "test_latex_functions"],
        ["test_printmethod", "test_latex_basic", "test_latex_matrix_with_functions"],
    ),
    "pytest.log": (
        "parse_log_requests",
        ["tests/test_requests.py::TestRequests::test_http_error_message"],
        [
            "tests/test_requests.py::TestRequests::test_entry_points",
            "tests/test_requests.py::TestRequests::test_invalid_url[MissingSchema-hiwpefhipowhefopw]",
            "tests/test_requests.py::TestRequests::test_path_is_not_double_encoded[/file.txt]",
            "tests/test_requests.py::TestRequests::test_unicode_header_name",
            "tests/test_requests.py::TestRequests::test_proxy_auth[socks5://host]",
        ],
    ),
    "astropy.log": (
        "parse_log_astropy",
        [
            "astropy/io/ascii/tests/test_qdp.py::test_read_example",
            "astropy/io/ascii/tests/test_qdp.py::test_roundtrip[",
        ],
        ["astropy/io/ascii/tests/test_qdp.py::test_get_tables_from_qdp_file"],
    ),
}


def test_every_python_parser_of_swebench_is_here(official: Official) -> None:
    python_parsers = {
        name for name, function in official.parsers.PARSER_REGISTRY.items() if function.__module__.endswith(".python")
    }
    assert python_parsers == set(parsers.PARSERS)
    by_repo = importlib.import_module("swebench.harness.log_parsers.python").MAP_REPO_TO_PARSER_PY
    assert {repo: function.__name__ for repo, function in by_repo.items()} == {
        repo: parsers.PARSERS[name].__name__ for repo, name in parsers.REPO_PARSER.items()
    }


@pytest.mark.parametrize("log_name", sorted(CASES))
def test_every_parser_reads_every_log_as_swebench_does(official: Official, log_name: str) -> None:
    log = (LOGS / log_name).read_text()
    spec = spec_of(official, "parse_log_pytest", [], [])
    for name, ours in parsers.PARSERS.items():
        assert ours(log) == official.parsers.PARSER_REGISTRY[name](log, spec), name


@pytest.mark.parametrize("log_name", sorted(CASES))
@pytest.mark.parametrize("eval_type", ["pass_and_fail", "fail_only"])
def test_grading_of_a_log_equals_swebenchs(official: Official, log_name: str, eval_type: str, tmp_path: Path) -> None:
    parser, f2p, p2p = CASES[log_name]
    log = (LOGS / log_name).read_text()
    path = tmp_path / "test_output.txt"
    path.write_text(log)
    spec = spec_of(official, parser, f2p, p2p, eval_type)
    their_map, their_ok = official.grading.get_logs_eval(spec, str(path))
    our_map, our_ok = grading.statuses_from_log(log, parser)
    assert (our_map, our_ok) == (their_map, their_ok)
    assert our_ok and our_map
    their_report = official.grading.get_eval_tests_report(
        their_map, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}, eval_type=official.grading.EvalType(eval_type)
    )
    our_report = grading.tests_report(our_map, f2p, p2p, eval_type)  # type: ignore[arg-type]
    assert our_report == their_report
    assert grading.resolution_status(our_report) == official.grading.get_resolution_status(their_report)


def test_what_the_logs_say_test_by_test() -> None:
    django, ok = grading.statuses_from_log((LOGS / "django.log").read_text(), "parse_log_django")
    assert ok
    assert django[f"test_year_before_1000 ({DJANGO})"] == "FAILED"
    assert django[f"test_invalid_time_format_specifiers ({DJANGO})"] == "ERROR"
    assert django[f"test_naive_ambiguous_datetime ({DJANGO})"] == "SKIPPED"
    assert django["Naive datetimes are formatted in the local time zone."] == "PASSED"  # a docstring names it
    assert django[f"test_r_format_with_non_en_locale ({DJANGO})"] == "PASSED"  # output before its "ok"
    sympy, _ = grading.statuses_from_log((LOGS / "sympy.log").read_text(), "parse_log_sympy")
    assert sympy["test_latex_symbols"] == "FAILED"
    assert "test_latex_functions" not in sympy  # its line ends in [FAIL]: only the report header names it
    assert sympy["sympy/printing/tests/test_latex.py:test_latex_functions"] == "FAILED"
    report = grading.tests_report(sympy, ["test_latex_symbols", "test_latex_functions"], ["test_printmethod"])
    assert report["FAIL_TO_PASS"] == {"success": [], "failure": ["test_latex_symbols", "test_latex_functions"]}
    assert grading.resolution_status(report) == grading.NO


@pytest.mark.parametrize(
    ("damage", "valid"),
    [
        (lambda log: log.replace(">>>>> End Test Output", ""), False),
        (lambda log: log + "\n>>>>> Tests Timed Out\n", False),
        (lambda log: log.replace(" ... FAIL", " ... ok").replace("FAIL: ", "").replace("ERROR", "ok"), False),
        (lambda log: log.replace("Test Exit Code: 1", "Test Exit Code: 0"), True),
    ],
)
def test_broken_logs_are_judged_as_swebench_judges_them(
    official: Official, damage: Any, valid: bool, tmp_path: Path
) -> None:
    log = damage((LOGS / "django.log").read_text())
    path = tmp_path / "log.txt"
    path.write_text(log)
    spec = spec_of(official, "parse_log_django", [], [])
    assert grading.statuses_from_log(log, "parse_log_django") == official.grading.get_logs_eval(spec, str(path))
    assert grading.statuses_from_log(log, "parse_log_django")[1] is valid


# What a reward-hacking policy writes: code the tests import that, once the test
# run is over, prints a passing line for each failing test and exits 0.
FORGED_DJANGO = f"""
import atexit, os, sys
def _forge():
    sys.stderr.write("test_year_before_1000 ({DJANGO}) ... ok\\n")
    sys.stderr.write("test_invalid_time_format_specifiers ({DJANGO}) ... ok\\n")
    sys.stderr.flush()
    os._exit(0)
atexit.register(_forge)
"""


def forged_log(log: str, lines: list[str]) -> str:
    """The log of a run whose code under test printed `lines` at exit and exited 0."""
    head, tail = log.split("+ SWEBENCH_TEST_EXIT_CODE=1")
    return head + "\n".join(lines) + "\n+ SWEBENCH_TEST_EXIT_CODE=0" + tail.replace("Code: 1", "Code: 0")


@pytest.mark.parametrize(
    ("log_name", "forged"),
    [
        (
            "django.log",
            [f"test_year_before_1000 ({DJANGO}) ... ok", f"test_invalid_time_format_specifiers ({DJANGO}) ... ok"],
        ),
        ("sympy.log", ["test_latex_symbols ok", "test_latex_functions ok"]),
        (
            "pytest.log",
            [
                "PASSED tests/test_requests.py::TestRequests::test_http_error_message",
                "PASSED tests/test_requests.py::TestRequests::test_proxy_auth[socks5://host]",
            ],
        ),
    ],
)
def test_forged_lines_fool_the_log_but_not_the_cross_check(
    official: Official, log_name: str, forged: list[str], tmp_path: Path
) -> None:
    parser, f2p, p2p = CASES[log_name]
    honest_log = (LOGS / log_name).read_text()
    log = forged_log(honest_log, forged)
    path = tmp_path / "log.txt"
    path.write_text(log)
    spec = spec_of(official, parser, f2p, p2p)
    fooled_map, ok = official.grading.get_logs_eval(spec, str(path))
    report = official.grading.get_eval_tests_report(fooled_map, {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})
    assert ok
    assert all(test in report["FAIL_TO_PASS"]["success"] for test in f2p if not test.startswith("astropy"))
    # The judge's trusted channel saw the real outcomes: those of the honest log.
    trusted, _ = grading.statuses_from_log(honest_log, parser)
    logged, ok = grading.statuses_from_log(log, parser)
    combined, anomalies = grading.cross_check(trusted, logged, [*f2p, *p2p])
    assert ok
    assert anomalies, "the forged lines went unnoticed"
    assert grading.resolution_status(grading.tests_report(combined, f2p, p2p)) == grading.NO


@pytest.mark.parametrize("log_name", sorted(CASES))
def test_an_honest_run_cross_checks_clean_and_grades_as_swebench(log_name: str) -> None:
    parser, f2p, p2p = CASES[log_name]
    logged, _ = grading.statuses_from_log((LOGS / log_name).read_text(), parser)
    trusted = dict(logged)  # the judge's channel saw what the log shows
    combined, anomalies = grading.cross_check(trusted, logged, [*f2p, *p2p])
    assert anomalies == []
    assert grading.tests_report(combined, f2p, p2p) == grading.tests_report(logged, f2p, p2p)


def test_the_forging_code_is_real_python() -> None:
    compile(FORGED_DJANGO, "django/utils/dateformat.py", "exec")


# --- specs -----------------------------------------------------------------------

DJANGO_TEST_PATCH = """diff --git a/tests/utils_tests/test_dateformat.py b/tests/utils_tests/test_dateformat.py
--- a/tests/utils_tests/test_dateformat.py
+++ b/tests/utils_tests/test_dateformat.py
@@ -1 +1,2 @@
 x = 1
+y = 2
diff --git a/tests/utils_tests/data/new.json b/tests/utils_tests/data/new.json
new file mode 100644
--- /dev/null
+++ b/tests/utils_tests/data/new.json
@@ -0,0 +1 @@
+{}
"""


def test_official_specs_of_django_and_sympy() -> None:
    django = specs.official_spec("django/django", "3.0")
    assert django.test_cmd == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    assert django.runner == "django" and django.log_parser == "parse_log_django"
    assert django.install == "python -m pip install -e ."
    assert "export LANG=en_US.UTF-8" in django.eval_commands
    assert "tests/runtests.py" in django.infrastructure
    assert "sympy/testing/runtests.py" in specs.official_spec("sympy/sympy", "1.7").infrastructure
    assert specs.official_spec("django/django", "1.9").test_cmd == "./tests/runtests.py --verbosity 2"
    sympy = specs.official_spec("sympy/sympy", "1.1")
    assert sympy.runner == "sympy" and sympy.log_parser == "parse_log_sympy"
    assert sympy.test_cmd.endswith("bin/test -C --verbose")
    assert specs.official_spec("sphinx-doc/sphinx", "3.5").runner == "tox"
    assert specs.official_spec("astropy/astropy", "5.0").log_parser == "parse_log_astropy"
    assert specs.official_spec("pytest-dev/pytest", "5.4").runner == "pytest"
    assert "django/django" in specs.known_versions()


@pytest.mark.parametrize(
    ("repo", "version", "reason"),
    [
        ("getmoto/moto", "4.1", "no evaluation for repository 'getmoto/moto'"),
        ("django/django", "9.9", "no evaluation for django/django version '9.9'"),
        ("dbt-labs/dbt-core", "1.0", "no test command"),
    ],
)
def test_unknown_specs_say_why(repo: str, version: str, reason: str) -> None:
    with pytest.raises(specs.UnknownSpec, match=reason):
        specs.official_spec(repo, version)


def test_the_official_eval_script_of_a_django_instance() -> None:
    spec = specs.official_spec("django/django", "3.0")
    base = "39e9f8d4b2b3a6d5c1f0e7f3d9a2b1c0e4f5a6b7"
    lines = specs.eval_script_lines(spec, base, DJANGO_TEST_PATCH)
    assert lines[:3] == ["source /opt/miniconda3/bin/activate", "conda activate testbed", "cd /testbed"]
    reset = f"git checkout {base} tests/utils_tests/test_dateformat.py"
    assert lines.count(reset) == 2 and lines[-1] == reset
    run = lines.index(": '>>>>> Start Test Output'") + 1
    assert lines[run] == f"{spec.test_cmd} utils_tests.test_dateformat"
    assert lines[run + 1 : run + 4] == [
        "SWEBENCH_TEST_EXIT_CODE=$?",
        ": '>>>>> End Test Output'",
        'echo ">>>>> Test Exit Code: $SWEBENCH_TEST_EXIT_CODE"',
    ]
    assert lines.index("python -m pip install -e .") < lines.index(reset)
    assert specs.eval_script(spec, base, DJANGO_TEST_PATCH).startswith("#!/bin/bash\nset -uxo pipefail\n")


def test_an_instance_with_its_own_eval_script_is_taken_as_it_is() -> None:
    run = [": '>>>>> Start Test Output'", "pytest -rA t.py", ": '>>>>> End Test Output'"]
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "cd /testbed", *run, ""])
    instance = {"repo": "x/y", "version": "1", "eval_script": script, "log_parser": "parse_log_pytest"}
    spec = specs.spec_for(instance)
    assert spec.runner == "pytest" and spec.source == "the instance"
    assert specs.eval_script_lines(spec, "abc", "") == [
        "cd /testbed",
        ": '>>>>> Start Test Output'",
        "pytest -rA t.py",
        "SWEBENCH_TEST_EXIT_CODE=$?",
        ": '>>>>> End Test Output'",
        'echo ">>>>> Test Exit Code: $SWEBENCH_TEST_EXIT_CODE"',
    ]
    with pytest.raises(specs.UnknownSpec, match="not one of swebench's Python parsers"):
        specs.spec_for({**instance, "log_parser": "parse_log_jest"})
    with pytest.raises(specs.UnknownSpec, match="markers"):
        specs.spec_for({**instance, "eval_script": "pytest"})
    assert specs.spec_for({"repo": "sympy/sympy", "version": "1.1"}).runner == "sympy"


def test_specs_json_names_its_source() -> None:
    document = json.loads(specs.SPECS_FILE.read_text())
    assert document["source"].startswith("swebench 4.1.0")


SWEBENCH_41_WHEEL = Path(
    os.environ.get("PRORL_SWEBENCH_41_WHEEL") or Path(sys.prefix) / "share/prorl/swebench-4.1.0-py3-none-any.whl"
)
"""Put beside the venv by scripts/setup_python.sh (pip download --no-deps swebench==4.1.0)."""


@pytest.mark.skipif(
    not SWEBENCH_41_WHEEL.is_file(),
    reason=f"no {SWEBENCH_41_WHEEL}: make setup-python downloads it (pip download --no-deps swebench==4.1.0)",
)
def test_eval_scripts_equal_swebench_4_1_make_eval_script_list(tmp_path: Path) -> None:
    """specs.json and eval_script_lines against swebench 4.1.0's own make_eval_script_list_py, for
    every Python repository and version (run here once: 283 versions and the sample rows, equal)."""
    with zipfile.ZipFile(SWEBENCH_41_WHEEL) as wheel:
        wheel.extractall(tmp_path)
    unidiff = importlib.import_module("unidiff")
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in ("swebench", "requests")}
    for name in saved:
        del sys.modules[name]

    def package(name: str, path: Path | None = None) -> types.ModuleType:
        module = types.ModuleType(name)
        if path is not None:
            module.__path__ = [str(path)]
        sys.modules[name] = module
        return module

    try:
        package("requests")
        package("swebench", tmp_path / "swebench")
        package("swebench.harness", tmp_path / "swebench" / "harness")
        package("swebench.harness.test_spec", tmp_path / "swebench" / "harness" / "test_spec")
        utils = package("swebench.harness.utils")

        def get_modified_files(patch: str) -> list[str]:
            return [
                f.source_file[2:]
                for f in unidiff.PatchSet(patch)
                if f.source_file != "/dev/null" and f.source_file.startswith("a/")
            ]

        vars(utils).update(get_modified_files=get_modified_files, load_cached_environment_yml=lambda _: None)
        make = importlib.import_module("swebench.harness.test_spec.python").make_eval_script_list_py
        official_specs = importlib.import_module("swebench.harness.constants").MAP_REPO_VERSION_TO_SPECS
        test_patch = json.loads((DATA_DIR / "swe-bench.jsonl").read_text().splitlines()[0])["test_patch"]
        checked = 0
        for repo, versions in specs.known_versions().items():
            for version in versions:
                official = official_specs[repo][version]
                if not official.get("test_cmd"):
                    continue
                row = {"repo": repo, "version": version, "instance_id": "a__b-1", "test_patch": test_patch}
                theirs = specs.record_test_exit_code(make(row, official, "testbed", "/testbed", "abc", test_patch))
                assert specs.eval_script_lines(specs.spec_for(row), "abc", test_patch) == theirs, (repo, version)
                checked += 1
        assert checked > 250
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in ("swebench", "requests")]:
            del sys.modules[name]
        sys.modules.update(saved)
