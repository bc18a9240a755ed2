"""Django's and SymPy's runners (children of swe mode).

The official command runs in a runner child with the environment the image's
`testbed` activation gives (SWE-bench's `source /opt/miniconda3/bin/activate;
conda activate testbed`). Its printed log (stdout and stderr, to a file)
comes back for the server to parse with SWE-bench's parser; each test's
outcome comes over the keyed report pipe from hooks installed before any
code of the repository is imported:
- django: on the standard library's unittest.TestResult (which Django's
  result classes extend), accepted only when unittest's own TestCase.run
  (the code object captured at start) of that very test is on the stack, or
  unittest's suite code for a class- or module-level error;
- sympy: on PyTestReporter of sympy/testing/runtests.py (restored to the base
  commit, and checked against a compile of that file when it loads), accepted
  only when called directly from SymPyTests.test_file.
Everything of unittest (or of the reporter) is fingerprinted after the hooks
are in and compared at every report and at the end: a patch that replaces a
method there makes the run `tampered`.
"""

import builtins
import json
import os
import sys
import traceback

from .judge_processes import harden
from .runner_guards import (
    PRELOAD_STDLIB,
    Provenance,
    changed_keys,
    guard_tracing,
    own_modules,
    same_code,
    tracing_guarded,
)
from .wire import HEADER

_UNITTEST_MODULES = (
    "unittest.case", "unittest.result", "unittest.suite", "unittest.runner", "unittest.loader",
    "unittest.main", "unittest.util", "unittest.signals",
)  # fmt: skip
_SYMPY_WATCHED = ("PyTestReporter", "Reporter", "SymPyTests")
_SYMPY_HOOKS = ("entering_test", "test_pass", "test_fail", "test_exception", "test_skip", "test_xfail", "test_xpass")


def _identity_fingerprint(classes, modules):
    """Functions and classes of `modules` and members of `classes`, by identity and code."""
    items = {}

    def add(key, value):
        if isinstance(value, (type, classmethod, staticmethod, property)) or callable(value):
            function = getattr(value, "__func__", getattr(value, "fget", value))
            items[key] = (value, getattr(function, "__code__", None))

    for module in modules:
        for attr, value in list(vars(module).items()):
            add(module.__name__ + "." + attr, value)
            if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
                for member, inner in list(vars(value).items()):
                    add("%s.%s.%s" % (module.__name__, attr, member), inner)
    for cls in classes:
        for member, inner in list(vars(cls).items()):
            add("%s.%s" % (cls.__qualname__, member), inner)
    return items


class _Channel(object):
    """The runner's end of the report pipe; the key stays in this object's closure."""

    def __init__(self, report_fd):
        os.set_inheritable(report_fd, False)
        key = sys.stdin.readline().strip()
        try:
            self.briefing = json.loads(sys.stdin.readline() or "{}")
        except ValueError:
            self.briefing = {}
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        write, dumps, pack = os.write, json.dumps, HEADER.pack

        def send(message):
            message["key"] = key
            body = dumps(message).encode("utf-8")
            data = memoryview(pack(len(body)) + body)
            while data:
                data = data[write(report_fd, data) :]

        self.send = send
        self.fd = report_fd
        sent = set()

        def tampered(text):
            if text not in sent:
                sent.add(text)
                send({"kind": "tampered", "names": [text[:500]]})

        self.tampered = tampered


def _finish(channel, code):
    channel.send({"kind": "exit", "code": code})
    os.close(channel.fd)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(code)


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def django_runner(report_fd, args):
    """`./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 MODULES` with
    unittest's results reported over the pipe."""
    harden()
    channel = _Channel(report_fd)
    send = channel.send
    import runpy
    import unittest
    import unittest.case
    import unittest.result
    import unittest.suite

    for name in PRELOAD_STDLIB + ("unittest.mock", "runpy", "argparse", "multiprocessing"):
        try:
            __import__(name)
        except Exception:
            pass
    run_code = unittest.case.TestCase.run.__code__
    suite_codes = set()
    for value in vars(unittest.suite).values():
        for member in list(vars(value).values()) if isinstance(value, type) else [value]:
            code = getattr(member, "__code__", None)
            if code is not None:
                suite_codes.add(code)
    getframe = sys._getframe
    result_class = unittest.result.TestResult
    originals = dict((name, getattr(result_class, name)) for name in (
        "addSuccess", "addFailure", "addError", "addSkip", "addExpectedFailure", "addUnexpectedSuccess", "addSubTest",
    ))  # fmt: skip

    def name_of(test):
        """The test's name in the log: the last line of unittest's description of it."""
        try:
            doc = test.shortDescription()
            return str(doc) if doc else str(test)
        except Exception:
            return "<unnamed test>"

    def inside_run(test):
        """Whether unittest's own TestCase.run of `test` (or its suite code, for a
        class- or module-level error) is on the stack."""
        frame = getframe(2)
        while frame is not None:
            code = frame.f_code
            if code is run_code and frame.f_locals.get("self") is test:
                return True
            if code in suite_codes and not isinstance(test, unittest.case.TestCase):
                return True
            frame = frame.f_back
        return False

    def hook(method, status_of):
        original = originals[method]

        def reporting(self, test, *rest):
            check()
            status, sub = status_of(test, *rest)
            # A failure counts from anywhere (Django's own _setup_and_call reports a failed
            # _pre_setup outside TestCase.run): only a pass or a skip needs the test to have run.
            if status in ("FAILED", "ERROR") or (status is not None and inside_run(test)):
                send({"kind": "report", "id": "%s@%x" % (type(test).__name__, id(test)) if not sub else "",
                      "name": name_of(test), "status": status, "sub": sub})  # fmt: skip
            elif status is not None:
                send({"kind": "foreign", "what": "%s(%s)" % (method, name_of(test))})
            return original(self, test, *rest)

        reporting.__name__ = reporting.__qualname__ = method
        setattr(result_class, method, reporting)

    def failure_kind(test, err):
        try:
            return "FAILED" if issubclass(err[0], test.failureException) else "ERROR"
        except Exception:
            return "ERROR"

    hook("addSuccess", lambda test: ("PASSED", False))
    hook("addFailure", lambda test, err: ("FAILED", False))
    hook("addError", lambda test, err: ("ERROR", False))
    hook("addSkip", lambda test, reason: ("SKIPPED", False))
    hook("addExpectedFailure", lambda test, err: ("XFAIL", False))
    hook("addUnexpectedSuccess", lambda test: ("FAILED", False))
    hook("addSubTest", lambda test, sub, err: (None if err is None else failure_kind(test, err), True))
    modules = [sys.modules[name] for name in _UNITTEST_MODULES if name in sys.modules] + own_modules()
    baseline = _identity_fingerprint([], modules)
    reported = set()
    guards = guard_tracing(Provenance(os.getcwd(), channel.briefing.get("digests") or {}), channel.tampered)

    def check():
        changed = changed_keys(baseline, _identity_fingerprint([], modules))
        if changed and tuple(changed) not in reported:
            reported.add(tuple(changed))
            send({"kind": "tampered", "names": changed[:50]})
        if not tracing_guarded(guards):
            channel.tampered("the runner's guard on trace functions removed")

    send({"kind": "started"})
    script = os.path.join(os.getcwd(), "tests", "runtests.py")
    sys.argv = ["./tests/runtests.py"] + list(args)
    sys.path[0:0] = [os.path.dirname(script)]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    check()
    _finish(channel, code)


class _RunnerFinder(object):
    """Installs `install(module)` right after `name` is executed (a post-import hook)."""

    def __init__(self, name, install):
        self.name, self.install = name, install

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, install = spec.loader, self.install
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            install(module)

        loader.exec_module = exec_module
        return spec


def _code_objects(code, prefix=""):
    """{qualified name: code} of every function in a compiled module."""
    found = {}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            name = prefix + const.co_name
            found[name] = const
            found.update(_code_objects(const, name + "."))
    return found


def sympy_runner(report_fd, args):
    """`bin/test -C --verbose FILES` with SymPy's reporter reporting over the pipe."""
    harden()
    channel = _Channel(report_fd)
    send = channel.send
    import runpy

    compile_ = builtins.compile
    getframe = sys._getframe
    state = {"baseline": None, "test_file": None, "current": None, "classes": [], "modules": []}
    repo = os.getcwd()
    expected_file = os.path.join(repo, "sympy", "testing", "runtests.py")

    def install(module):
        if os.path.realpath(str(getattr(module, "__file__", ""))) != os.path.realpath(expected_file):
            send({"kind": "tampered", "names": ["sympy.testing.runtests loaded from %s" % module.__file__]})
            return
        with open(expected_file, "rb") as handle:
            reference = _code_objects(compile_(handle.read(), module.__file__, "exec", dont_inherit=True))
        classes = [getattr(module, name, None) for name in _SYMPY_WATCHED]
        if not all(isinstance(cls, type) for cls in classes):
            send({"kind": "tampered", "names": ["sympy's reporter classes are missing"]})
            return
        differ = []
        for cls in classes:
            for member, value in vars(cls).items():
                code = getattr(value, "__code__", None)
                if code is not None:
                    want = reference.get("%s.%s" % (cls.__name__, member))
                    if want is None or not same_code(code, want):
                        differ.append("%s.%s" % (cls.__name__, member))
        if differ:
            send({"kind": "tampered", "names": differ[:50]})
        reporter = module.PyTestReporter
        state["test_file"] = module.SymPyTests.test_file.__code__
        for method in _SYMPY_HOOKS:
            hook(reporter, method)
        state["classes"] = classes
        state["modules"] = own_modules()
        state["baseline"] = _identity_fingerprint(classes, state["modules"])

    status_of = {
        "test_pass": "PASSED", "test_fail": "FAILED", "test_exception": "ERROR", "test_skip": "SKIPPED",
        "test_xfail": "XFAIL", "test_xpass": "FAILED",
    }  # fmt: skip

    def hook(reporter, method):
        original = vars(reporter)[method]

        def reporting(self, *rest, **options):
            check()
            caller = getframe(1).f_code
            if caller is not state["test_file"] and method not in ("test_fail", "test_exception"):
                send({"kind": "foreign", "what": "%s from %s" % (method, caller.co_name)})
            elif method == "entering_test":
                function = rest[0] if rest else options.get("f")
                state["current"] = (getattr(function, "__name__", "?"), id(function))
            elif state["current"] is not None:
                name, ident = state["current"]
                state["current"] = None
                send({"kind": "report", "id": "%s@%x" % (name, ident), "name": name, "status": status_of[method]})
            return original(self, *rest, **options)

        reporting.__name__ = reporting.__qualname__ = method
        setattr(reporter, method, reporting)

    reported = set()
    guards = guard_tracing(Provenance(repo, channel.briefing.get("digests") or {}), channel.tampered)

    def check():
        if not tracing_guarded(guards):
            channel.tampered("the runner's guard on trace functions removed")
        if state["baseline"] is None:
            return
        changed = changed_keys(state["baseline"], _identity_fingerprint(state["classes"], state["modules"]))
        if changed and tuple(changed) not in reported:
            reported.add(tuple(changed))
            send({"kind": "tampered", "names": changed[:50]})

    sys.meta_path.insert(0, _RunnerFinder("sympy.testing.runtests", install))
    send({"kind": "started"})
    script = os.path.join(repo, "bin", "test")
    sys.argv = ["bin/test"] + list(args)
    sys.path[0:0] = [os.path.dirname(script)]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    if state["baseline"] is None:
        send({"kind": "tampered", "names": ["sympy's test runner was never loaded from the repository"]})
    check()
    _finish(channel, code)
