"""SWE-bench's own evaluation semantics: per repository and version the set-up
steps and test command (specs.py), the log parsers (parsers.py) and the
grading of a log into per-test outcomes and a resolution (grading.py), taken
from the official `swebench` package (5.0.2 for parsers and grading; 4.1.0,
its last release that defines the per-version specs in code, for those;
swebench 5 rows carry their own `eval_script`, `log_parser` and `eval_type`).

Nothing here imports swebench: the server does not depend on it (its
dependencies pull docker, modal and datasets). tests/unit/verifiers/test_swebench_semantics.py
compares every function with swebench's own, installed for the tests with
`pip install --no-deps swebench==5.0.2 unidiff`.

How the judge uses it for runners other than pytest (verifiers/swe.py and
prorl_judge.py's `django` and `sympy` runner modes; docs/handlers.md):
- the official test command (`specs.test_command`: Django's
  `./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1
  <modules>`, SymPy's `bin/test -C --verbose <files>`, or the line between a
  5.x eval_script's markers) runs in a runner child of the judging harness,
  in the image's conda `testbed` environment as the eval script activates
  it, with the version's `export` lines (the `install` step is not run: the
  image already has the repository installed, and the sandbox no network);
- `EvalSpec.infrastructure` (tests/runtests.py, bin/test, SymPy's
  runtests.py) and every file under a tests/ folder are restored with the
  other test infrastructure before it runs;
- each test's outcome comes from a reporter on the harness's keyed pipe: for
  Django, hooks on the standard library's unittest result, accepted only from
  inside unittest's own TestCase.run of that test, named as the official
  parser names them (the last line of the test's description); for SymPy,
  hooks on its reporter, checked against a compile of the restored file and
  accepted only when SymPyTests.test_file calls them; both fingerprinted;
- the printed log is parsed with the instance's official parser and
  `grading.cross_check`ed against those outcomes: an honest run grades
  exactly as swebench grades its log, a forged line makes it `tampered`.
"""
