"""The judging harness's command line (prorl_judge.py MODE ...): a judge mode (function,
stdio, swe, terminal), which writes one verdict to its verdict fd, or one of the
children the modes start (candidate, pytest, django, sympy). Importing this module
imports every module of the harness: all are loaded before any repository is on
sys.path, so none can be shadowed by a module of the code under test.
"""

import json
import os
import sys

from .candidate import candidate_worker
from .django_sympy_runners import django_runner, sympy_runner
from .judge_function import judge_function
from .judge_processes import harden, kill_descendants
from .judge_stdio import judge_stdio
from .judge_swe import judge_swe
from .judge_terminal import judge_terminal
from .pipe_frames import write_all
from .pytest_runner import pytest_runner

JUDGES = {"function": judge_function, "stdio": judge_stdio, "swe": judge_swe, "terminal": judge_terminal}


def serve_judge(mode, verdict_fd):
    """Harden, read the spec, judge, and write the verdict to the verdict fd."""
    os.set_inheritable(verdict_fd, False)
    harden(subreaper=True)
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    verdict = JUDGES[mode](spec)
    kill_descendants()
    write_all(verdict_fd, json.dumps(verdict).encode("utf-8"))
    os.close(verdict_fd)


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    mode, rest = argv[0], argv[1:]
    options, positional = {}, []
    while rest:
        item = rest.pop(0)
        if item == "--":
            positional += rest
            break
        if item.startswith("--") and rest:
            options.setdefault(item, []).append(rest.pop(0))
        else:
            positional.append(item)
    if mode in JUDGES:
        serve_judge(mode, int(options["--verdict-fd"][0]))
    elif mode == "candidate":
        candidate_worker(int(options["--fd-in"][0]), int(options["--fd-out"][0]))
    elif mode == "pytest":
        pytest_runner(
            int(options["--report-fd"][0]),
            options.get("--path", []),
            positional,
            (options.get("--pycache") or [""])[0],
            (options.get("--cwd-on-path") or ["yes"])[0] != "no",
        )
    elif mode == "django":
        django_runner(int(options["--report-fd"][0]), positional)
    elif mode == "sympy":
        sympy_runner(int(options["--report-fd"][0]), positional)
    else:
        print("unknown mode %r" % mode, file=sys.stderr)
        return 2
    return 0
