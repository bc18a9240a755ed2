"""Small variants of the SymPy and Django tasks, for test_swe_runners.py's attacks.

Why they exist: the judge runs the official runner (SymPy's bin/test, Django's
tests/runtests.py) over every test file the task's test_patch touches
(specs.test_directives). For the shipped tasks those are whole files:
sympy/matrices/tests/test_matrixbase.py is minutes of CPU per run, and the
trace-function attack on Django's tests/utils_tests/test_http.py loops in
test_max_url_length until the task's 300 s eval timeout (django_variant). A
test that checks that a forging patch scores 0 needs the same runner, the same
repository at the same base commit and the same fix, not the whole file. A
variant is the real task with a test_patch that adds one new, small test file
instead: the test the real test_patch changes (its new lines, taken from the
real test_patch, so they fail at the base commit and pass with the gold patch)
and one test that passes at base, with FAIL_TO_PASS and PASS_TO_PASS naming
them as the real lists do. The shipped task data is not touched; the grading
of the real tasks stays proved by the gold-resolves tests that run on them.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Any

SYMPY_FILE = "sympy/matrices/tests/test_prorl_creation.py"
DJANGO_FILE = "tests/utils_tests/test_prorl_http.py"
DJANGO_CLASS = "URLHasAllowedHostAndSchemeTests"
DJANGO_MODULE = "utils_tests.test_prorl_http"


def added_lines(patch: str) -> list[str]:
    """The lines `patch` adds (without their `+`), in order."""
    return [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]


def new_file_patch(path: str, text: str) -> str:
    """A git patch creating `path` with `text` (which ends with a newline)."""
    lines = text.splitlines()
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines)
    )


def sympy_variant(task: dict[str, Any]) -> dict[str, Any]:
    """The SymPy task judged on a new file: test_creation holds the assertions the real
    test_patch adds to test_matrixbase.py's test_creation (`Matrix([[]]) == Matrix(1, 0, [])`
    and `Matrix([[], []]) == Matrix(2, 0, [])` fail at base), test_nonempty_creation passes at base.
    test_end_of_file is in neither list: SymPy's runner ends the last test's line of a file with
    the file's `[OK]`, where SWE-bench's parse_log_sympy reads no outcome (the real lists leave
    out test_matrixbase.py's last test, test_issue_23276, too)."""
    asserts = [line.strip() for line in added_lines(task["test_patch"]) if line.strip().startswith("assert ")]
    if not any("Matrix([[]]) == Matrix(1, 0, [])" in line for line in asserts):
        raise ValueError("the SymPy task's test_patch no longer adds the 1x0 assertion the variant is built on")
    text = (
        "from sympy.matrices import Matrix\n\n\n"
        "def test_creation():\n" + "".join(f"    {line}\n" for line in asserts) + "\n\n"
        "def test_nonempty_creation():\n"
        "    assert Matrix([[1, 2], [3, 4]]).shape == (2, 2)\n"
        "    assert Matrix(2, 3, range(6))[1, 2] == 5\n\n\n"
        "def test_end_of_file():\n"
        "    assert Matrix(0, 3, []).shape == (0, 3)\n"
    )
    return {
        **task,
        "test_patch": new_file_patch(SYMPY_FILE, text),
        "FAIL_TO_PASS": ["test_creation"],
        "PASS_TO_PASS": ["test_nonempty_creation"],
    }


def django_name(method: str) -> str:
    """A test's name as Django's runner prints it and the task's lists hold it."""
    return f"{method} ({DJANGO_MODULE}.{DJANGO_CLASS}.{method})"


def django_variant(task: dict[str, Any]) -> dict[str, Any]:
    """The Django task judged on a new file: test_max_url_length, the method the real test_patch
    adds, and test_good_url, which passes at base. The method imports MAX_URL_LENGTH itself, so
    that the module imports at base, and its statements are one line each (ast.unparse): the real
    method's `self.assertIs(` spans lines, and a trace function that jumps from that line to the
    next lands inside the call, whose line event then comes again, and loops until the eval
    timeout (300 s of the real task's trace test, for an attack refused when the trace is set)."""
    lines = added_lines(task["test_patch"])
    start = lines.index("    def test_max_url_length(self):")
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith("     ")), len(lines))
    method = ast.parse(textwrap.dedent("\n".join(lines[start:end])))
    function = method.body[0]
    assert isinstance(function, ast.FunctionDef)
    function.body.insert(0, ast.parse("from django.utils.http import MAX_URL_LENGTH").body[0])
    text = (
        "import unittest\n\n"
        "from django.utils.http import url_has_allowed_host_and_scheme\n\n\n"
        f"class {DJANGO_CLASS}(unittest.TestCase):\n" + textwrap.indent(ast.unparse(method), "    ") + "\n\n"
        "    def test_good_url(self):\n"
        '        self.assertIs(url_has_allowed_host_and_scheme("/view/?a=1", allowed_hosts={"example.com"}), True)\n'
    )
    return {
        **task,
        "test_patch": new_file_patch(DJANGO_FILE, text),
        "FAIL_TO_PASS": [django_name("test_max_url_length")],
        "PASS_TO_PASS": [django_name("test_good_url")],
    }
