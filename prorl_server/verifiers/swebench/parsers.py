"""SWE-bench's log parsers for Python repositories, as swebench 5.0.2 defines them.

Each parser turns a test log into {test name: status}, the status one of
PASSED, FAILED, SKIPPED, ERROR, XFAIL. The code follows
`swebench/harness/log_parsers/python.py` of swebench 5.0.2 (MIT licence,
Copyright (c) 2023 Carlos E Jimenez, John Yang, Alexander Wettig, Shunyu Yao,
Kexin Pei, Ofir Press, Karthik R Narasimhan) line for line, without its
`test_spec` argument, which none of the Python parsers reads; the names are
those of swebench's PARSER_REGISTRY, which a 5.x instance names in its
`log_parser` field. tests/unit/verifiers/test_swebench_semantics.py runs them beside
swebench's own on the same logs.

A parser reads whatever the log says: a patch whose code prints
`test_x (app.tests.T) ... ok` or `PASSED tests/test_a.py::test_b` puts that
line in the log. The judge therefore never scores from a log alone (see
grading.py, `cross_check`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (FAILED, PASSED, SKIPPED, ERROR, XFAIL)  # swebench's TestStatus, in its order

StatusMap = dict[str, str]
Parser = Callable[[str], StatusMap]

_SKIP_SUMMARY_COUNT = re.compile(r"^\[\d+\]$")


def _is_skip_summary(status: str, name: str) -> bool:
    """pytest's `SKIPPED [N] path:line: reason` summary line, where [N] is not a test."""
    return status == SKIPPED and bool(_SKIP_SUMMARY_COUNT.match(name))


def parse_log_pytest(log: str) -> StatusMap:
    """pytest's -rA summary: `STATUS node_id[ - message]`."""
    status_map: StatusMap = {}
    for line in log.split("\n"):
        if any(line.startswith(status) for status in STATUSES):
            if line.startswith(FAILED):
                line = line.replace(" - ", " ")
            test_case = line.split()
            if len(test_case) <= 1:
                continue
            if _is_skip_summary(test_case[0], test_case[1]):
                continue
            status_map[test_case[1]] = test_case[0]
    return status_map


def parse_log_pytest_options(log: str) -> StatusMap:
    """As parse_log_pytest, with a parameter that is a path shortened to its last part."""
    option_pattern = re.compile(r"(.*?)\[(.*)\]")
    status_map: StatusMap = {}
    for line in log.split("\n"):
        if any(line.startswith(status) for status in STATUSES):
            if line.startswith(FAILED):
                line = line.replace(" - ", " ")
            test_case = line.split()
            if len(test_case) <= 1:
                continue
            if _is_skip_summary(test_case[0], test_case[1]):
                continue
            has_option = option_pattern.search(test_case[1])
            if has_option:
                main, option = has_option.groups()
                if option.startswith("/") and not option.startswith("//") and "*" not in option:
                    option = "/" + option.split("/")[-1]
                test_name = f"{main}[{option}]"
            else:
                test_name = test_case[1]
            status_map[test_name] = test_case[0]
    return status_map


_DJANGO_INTERRUPTED = (
    r"^(.*?)\s\.\.\.\sTesting\ against\ Django\ installed\ in\ ((?s:.*?))\ silenced\)\.\nok$",
    r"^(.*?)\s\.\.\.\sInternal\ Server\ Error:\ \/(.*)\/\nok$",
    r"^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$",
)


def parse_log_django(log: str) -> StatusMap:
    """Django's runtests.py at --verbosity 2: `description ... ok|FAIL|ERROR|skipped`, then
    the `FAIL: test (module.Class)` / `ERROR: ...` headers of the failure report."""
    status_map: StatusMap = {}
    prev_test = None
    for line in log.split("\n"):
        line = line.strip()
        if "--version is equivalent to version" in line:
            status_map["--version is equivalent to version"] = PASSED
        if " ... " in line:
            prev_test = line.split(" ... ")[0]
        for suffix in (" ... ok", " ... OK", " ...  OK"):
            if line.endswith(suffix):
                # swebench's own exception, for django__django-7188
                if line.strip().startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                    line = line.split("...", 1)[-1].strip()
                status_map[line.rsplit(suffix, 1)[0]] = PASSED
                break
        if " ... skipped" in line:
            status_map[line.split(" ... skipped")[0]] = SKIPPED
        if line.endswith(" ... FAIL"):
            status_map[line.split(" ... FAIL")[0]] = FAILED
        if line.startswith("FAIL:"):
            status_map[line.split()[1].strip()] = FAILED
        if line.endswith(" ... ERROR"):
            status_map[line.split(" ... ERROR")[0]] = ERROR
        if line.startswith("ERROR:"):
            status_map[line.split()[1].strip()] = ERROR
        if line.lstrip().startswith("ok") and prev_test is not None:
            # passed, with output between "..." and "ok"
            status_map[prev_test] = PASSED
    for pattern in _DJANGO_INTERRUPTED:
        for match in re.finditer(pattern, log, re.MULTILINE):
            status_map[match.group(1)] = PASSED
    return status_map


_ESCAPES = str.maketrans("", "", "".join(chr(char) for char in range(1, 32)))


def parse_log_pytest_v2(log: str) -> StatusMap:
    """pytest, colour codes removed; also `name STATUS` lines of older pytest versions."""
    status_map: StatusMap = {}
    for line in log.split("\n"):
        line = re.sub(r"\[(\d+)m", "", line)
        line = line.translate(_ESCAPES)
        if any(line.startswith(status) for status in STATUSES):
            if line.startswith(FAILED):
                line = line.split(" - ", 1)[0]
            test_case = line.split()
            if len(test_case) >= 2 and not _is_skip_summary(test_case[0], test_case[1]):
                status_map[" ".join(test_case[1:])] = test_case[0]
        elif any(line.endswith(status) for status in STATUSES):
            test_case = line.split()
            if len(test_case) >= 2:
                status_map[" ".join(test_case[:-1])] = test_case[-1]
    return status_map


def parse_log_seaborn(log: str) -> StatusMap:
    status_map: StatusMap = {}
    for line in log.split("\n"):
        parts = line.split()
        if len(parts) < 2:
            continue
        if line.startswith(FAILED):
            status_map[parts[1]] = FAILED
        elif f" {PASSED} " in line:
            if parts[1] == PASSED:
                status_map[parts[0]] = PASSED
        elif line.startswith(PASSED):
            status_map[parts[1]] = PASSED
    return status_map


def parse_log_sympy(log: str) -> StatusMap:
    """SymPy's bin/test --verbose: `test_name ok|F|E` per test, and the
    `___ path.py:test_name ___` headers of the failure report."""
    status_map: StatusMap = {}
    for match in re.findall(r"(_*) (.*)\.py:(.*) (_*)", log):
        status_map[f"{match[1]}.py:{match[2]}"] = FAILED
    for line in log.split("\n"):
        line = line.strip()
        if line.startswith("test_"):
            if line.endswith(" E"):
                status_map[line.split()[0]] = ERROR
            if line.endswith(" F"):
                status_map[line.split()[0]] = FAILED
            if line.endswith(" ok"):
                status_map[line.split()[0]] = PASSED
    return status_map


def parse_log_matplotlib(log: str) -> StatusMap:
    status_map: StatusMap = {}
    for line in log.split("\n"):
        line = line.replace("MouseButton.LEFT", "1")
        line = line.replace("MouseButton.RIGHT", "3")
        if any(line.startswith(status) for status in STATUSES):
            if line.startswith(FAILED):
                line = line.replace(" - ", " ")
            test_case = line.split()
            if len(test_case) <= 1:
                continue
            if _is_skip_summary(test_case[0], test_case[1]):
                continue
            status_map[test_case[1]] = test_case[0]
    return status_map


PARSERS: dict[str, Parser] = {
    "parse_log_pytest": parse_log_pytest,
    "parse_log_pytest_options": parse_log_pytest_options,
    "parse_log_django": parse_log_django,
    "parse_log_pytest_v2": parse_log_pytest_v2,
    "parse_log_seaborn": parse_log_seaborn,
    "parse_log_sympy": parse_log_sympy,
    "parse_log_matplotlib": parse_log_matplotlib,
    "parse_log_astroid": parse_log_pytest,
    "parse_log_flask": parse_log_pytest,
    "parse_log_marshmallow": parse_log_pytest,
    "parse_log_pvlib": parse_log_pytest,
    "parse_log_pyvista": parse_log_pytest,
    "parse_log_sqlfluff": parse_log_pytest,
    "parse_log_xarray": parse_log_pytest,
    "parse_log_pydicom": parse_log_pytest_options,
    "parse_log_requests": parse_log_pytest_options,
    "parse_log_pylint": parse_log_pytest_options,
    "parse_log_astropy": parse_log_pytest_v2,
    "parse_log_scikit": parse_log_pytest_v2,
    "parse_log_sphinx": parse_log_pytest_v2,
}
"""swebench 5.0.2's PARSER_REGISTRY, its Python part."""

REPO_PARSER: dict[str, str] = {
    "astropy/astropy": "parse_log_astropy",
    "django/django": "parse_log_django",
    "marshmallow-code/marshmallow": "parse_log_marshmallow",
    "matplotlib/matplotlib": "parse_log_matplotlib",
    "mwaskom/seaborn": "parse_log_seaborn",
    "pallets/flask": "parse_log_flask",
    "psf/requests": "parse_log_requests",
    "pvlib/pvlib-python": "parse_log_pvlib",
    "pydata/xarray": "parse_log_xarray",
    "pydicom/pydicom": "parse_log_pydicom",
    "pylint-dev/astroid": "parse_log_astroid",
    "pylint-dev/pylint": "parse_log_pylint",
    "pytest-dev/pytest": "parse_log_pytest",
    "pyvista/pyvista": "parse_log_pyvista",
    "scikit-learn/scikit-learn": "parse_log_scikit",
    "sqlfluff/sqlfluff": "parse_log_sqlfluff",
    "sphinx-doc/sphinx": "parse_log_sphinx",
    "sympy/sympy": "parse_log_sympy",
}
"""swebench 5.0.2's MAP_REPO_TO_PARSER_PY, by parser name: the parser of an
instance that does not name one (datasets published before swebench 5)."""
