#!/usr/bin/env python3
"""prorl judging harness: verdicts that the code under test cannot write.

Runs inside a sandbox on the image's own python3 (3.8 and newer), stdlib only,
beside prorl_runtime.py (bind-mounted read-only). This file only starts it: the
harness is the package prorl_sandbox_runtime beside it, one module per mode and per
child (judge_function.py, judge_stdio.py, judge_swe.py, judge_terminal.py,
candidate.py, pytest_runner.py, django_sympy_runners.py, ...), all imported
(judge_main.py) before anything else, from this folder, put first on sys.path. The runtime's `judge`
operation starts it directly, never through a shell or a pty:

    python3 -I -B prorl_judge.py MODE --verdict-fd N     (the spec as JSON on stdin)

It writes one verdict, a JSON object, to fd N and exits 0. Anything else (it
was killed, it crashed, it wrote no JSON) means "no verdict", which the server
scores 0: an attack that stops the judging can only lose.

Trust boundaries
- This process is trusted. Before any untrusted code runs it makes itself
  non-dumpable (same-uid processes can then neither ptrace it, nor read its
  memory, nor open its fds through /proc) and a child subreaper (whatever the
  untrusted code leaves running is re-parented to it, so it can kill it all).
- Untrusted code runs in child processes that get no inherited fd but their
  own channels (close_fds); the verdict fd never leaves this process.
- The expected results stay where the untrusted code cannot read them: check()
  runs here, and stdio outputs are compared by the server.

Modes
- function: the candidate function runs in a child process (mode `candidate`).
  check() runs here against a proxy whose calls go to that child and whose
  results come back as plain data only (builtin types rebuilt on this side;
  anything else fails the submission). Pass means: check() returned normally
  here and the candidate never broke the protocol (died, exited, returned a
  foreign object, answered out of turn). Exiting early, atexit hooks,
  AlwaysEqual objects or monkey-patching in the candidate's process cannot
  reach check(). The price: arguments and results are copies (a test that
  expects its arguments changed in place cannot see it) and only plain data
  crosses (a test cannot hand the candidate a function); all 164 HumanEval
  problems fit.
- stdio: runs the program once per input; its stdout (its own pipe), exit
  status (from waitpid) and timing go back to the server, which compares.
- swe: applies the model's patch to the repository, restores test
  infrastructure the patch touched (see is_test_infrastructure, any case),
  the test files and whatever stands where they must go, applies the test
  patch (telling apart one the model's patch blocks from one that does not
  apply at the base commit either), and runs pytest in a child (mode `pytest`)
  with a reporter plugin that sends each test's outcome over a pipe to this
  process. For a Django or SymPy instance it runs the official command
  instead (modes `django`, `sympy`, below "Django's and SymPy's runners"),
  with hooks on unittest's results or SymPy's reporter on the same kind of
  pipe. Either way the child's printed log (stdout and stderr, to a file) goes
  back to the server, which parses it with SWE-bench's parser and
  cross-checks it with the outcomes from the pipe: the log alone decides
  nothing.
- terminal: unpacks the agent's working directory (an archive from its
  sandbox) into this fresh sandbox, puts the task's test files in place and
  runs them with the same pytest runner and reporter as swe mode (below
  "terminal mode").

Residual risk (swe): the code under test is imported into the pytest process
itself, so it can in principle do anything that process can: rewrite its
memory (the reporter, pytest, the test functions themselves), find the run
key there, or call os.write on the report pipe. Nothing inside one process
can prevent that (a stolen key and a whole passing stream written on the pipe
resolve: tests/adversarial/test_swe_verdicts.py,
test_a_stolen_run_key_still_forges_a_pass, a strict xfail). What raises the bar from "print a line" or "add a plugin"
to deliberate in-process tampering with this file's internals:
- the runner is non-dumpable, so the programs the tests start cannot attach
  to it, read its memory or open its pipe (a fork of it, made by code inside
  it, is that code again);
- the harness's own modules are imported from its read-only folder before
  the repository is on sys.path (no module of the repository stands in for
  them);
- pytest and its dependencies are imported before the repository is on
  sys.path (no module of the repository stands in for them);
- every frame carries a per-run key the harness gives the runner on its stdin
  before any test code is imported; frames without it (written by someone who
  knows only the protocol) are ignored and flagged;
- the stream is checked here: one report per phase of each collected test, a
  failure in any report wins, a final frame, pytest's exit status consistent
  with the reports and with the runner's real exit status;
- pytest's reporting machinery (and the reporter, and every module of this
  package, where the functions it calls live) is fingerprinted before any
  conftest.py or test is imported and compared at every report; between the
  two only pytest's own replacements of its functions (and installed
  plugins') are accepted;
- plugins and hooks: `register` checks who calls it (the first frame below
  pytest, pluggy and the standard library must be this runner, installed
  code, or a file the harness put in place: a conftest.py, a test file), and
  every hook implementation is compared at each report with the ones
  registration gave (added, replaced: `tampered`); so are trace functions
  (`sys.settrace` from the code under test could jump over asserts) and the
  report function itself (it sends only for this runner's own code);
- test modules: pytest's rewriter must read the bytes the harness put in
  place (their digests come on the runner's stdin after the key; no cached
  .pyc is read: `sys.pycache_prefix` is a fresh folder), and each collected
  test's function must be one its test file defines, checked again before it
  runs;
- after the run the harness compares every test file and piece of test
  infrastructure with what it put in place (rewritten, deleted or new: an
  anomaly, whatever the runner says).
"""

import os
import sys

if __package__:  # imported as part of the server's package
    from .prorl_sandbox_runtime.judge_main import main
else:  # run as a script under -I: the package beside this file, before anything else
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from prorl_sandbox_runtime.judge_main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
