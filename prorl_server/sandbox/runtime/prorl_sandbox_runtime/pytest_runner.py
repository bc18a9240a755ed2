"""The pytest runner, the child of swe and terminal mode where the code under test is
imported: pytest with a reporter plugin that sends each test's outcome over the keyed
pipe, and the checks that make in-process tampering visible (see prorl_judge.py,
"Residual risk"). The reporter and the functions it calls live in this package, which
the fingerprint covers.
"""

import json
import os
import sys

from .judge_processes import harden
from .repo_files import file_digest
from .runner_guards import (
    PRELOAD_STDLIB,
    Provenance,
    changed_keys,
    guard_tracing,
    nested_codes,
    own_modules,
    pytest_own,
    same_code,
    tracing_guarded,
)
from .wire import HEADER

_PRELOAD = ("pluggy", "iniconfig", "packaging.version", "tomllib", "tomli", "attr", "exceptiongroup", "py")
_WATCHED_MODULES = (
    "_pytest.runner", "_pytest.reports", "_pytest.main", "_pytest.python", "_pytest.skipping",
    "_pytest.unittest", "_pytest.nodes", "_pytest.outcomes", "_pytest.terminal", "_pytest.config",
    "_pytest.assertion.rewrite", "_pytest.fixtures", "_pytest.junitxml",
    "pluggy._callers", "pluggy._hooks", "pluggy._manager", "pluggy.callers", "pluggy.hooks", "pluggy.manager",
)  # fmt: skip


def _preload():
    """Import pytest and what it imports later, before the repository is on sys.path,
    so a module of the repository cannot stand in for them."""
    import importlib
    import pkgutil

    import _pytest
    import pytest  # noqa: F401

    for info in pkgutil.iter_modules(_pytest.__path__, "_pytest."):
        try:
            importlib.import_module(info.name)
        except Exception:
            pass
    for name in _PRELOAD + PRELOAD_STDLIB:
        try:
            importlib.import_module(name)
        except Exception:
            pass


def _fingerprint(extra):
    """The functions and classes of pytest's reporting path, by identity: pytest's, the
    reporter's (`extra`) and those of this package's modules, which the reporter calls."""
    items = {}

    def add(key, value):
        if isinstance(value, (type, classmethod, staticmethod, property)) or callable(value):
            function = getattr(value, "__func__", getattr(value, "fget", value))
            items[key] = (value, getattr(function, "__code__", None))

    watched = [(name, sys.modules.get(name)) for name in _WATCHED_MODULES]
    watched += [(module.__name__, module) for module in own_modules()]  # the reporter's own
    for name, module in watched:
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            add(name + "." + attr, value)
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for member, inner in list(vars(value).items()):
                    add("%s.%s.%s" % (name, attr, member), inner)
    for member, inner in list(vars(extra).items()):
        add("reporter." + member, inner)
    return items


def _hook_callers(manager):
    """{hook name: caller} of a pluggy plugin manager."""
    return dict((name, caller) for name, caller in list(vars(manager.hook).items()) if hasattr(caller, "get_hookimpls"))


def pytest_runner(report_fd, paths, args, pycache="", cwd_on_path=True):
    """The child that runs pytest; the code under test is imported here."""
    harden()
    os.set_inheritable(report_fd, False)
    key = sys.stdin.readline().strip()  # the run's key: only in this process's memory from here on
    try:
        briefing = json.loads(sys.stdin.readline() or "{}")
    except ValueError:
        briefing = {}
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if pycache:
        # Bytecode is read from (and would be written to) a fresh folder of the
        # harness's: no .pyc planted in the repository stands in for a test module.
        sys.pycache_prefix = pycache
    _preload()
    import _pytest.assertion.rewrite as rewrite
    import _pytest.config
    import pytest

    write, dumps, pack = os.write, json.dumps, HEADER.pack
    repo = os.getcwd()
    digests = dict((str(path), value) for path, value in dict(briefing.get("digests") or {}).items())
    provenance = Provenance(repo, digests)
    getframe = sys._getframe

    own_codes = frozenset(nested_codes(pytest_runner.__code__))

    def send(message):
        if getframe(1).f_code not in own_codes:  # called by the code under test
            caller = getframe(1).f_code
            message = {"kind": "tampered", "names": ["the reporter called from %s" % caller.co_filename[:300]]}
        message["key"] = key
        body = dumps(message).encode("utf-8")
        data = memoryview(pack(len(body)) + body)
        while data:
            data = data[write(report_fd, data) :]

    problems = set()

    def tampered(text):
        if text not in problems:
            problems.add(text)
            send({"kind": "tampered", "names": [text[:500]]})

    # A test module must be compiled from the file the harness put in place, read now
    # (not from a cached .pyc, not from a copy the code under test rewrote).
    compiled = {}
    original_rewrite = rewrite._rewrite_test

    def expected_digest(path):
        real = os.path.realpath(str(path))
        relative = os.path.relpath(real, os.path.realpath(repo))
        return relative, digests.get(relative)

    def checked_rewrite(fn, *rest, **options):
        relative, want = expected_digest(fn)
        first = file_digest(str(fn))
        result = original_rewrite(fn, *rest, **options)
        if want is not None and not (first == want and file_digest(str(fn)) == want):
            tampered("the test file %s was not the task's when pytest read it" % relative)
        try:
            compiled[os.path.realpath(str(fn))] = nested_codes(result[1])
        except Exception:
            pass
        return result

    rewrite._rewrite_test = checked_rewrite
    rewrite._read_pyc = lambda *args, **kwargs: None

    # Plugins and hooks: registered only by pytest, its plugins, or the files the
    # harness put in place, never by the code under test.
    manager_class = _pytest.config.PytestPluginManager
    original_register = manager_class.register
    known_impls = {}
    state = {"manager": None, "callers": {}, "hookexec": None}

    def learn(manager, plugin):
        for caller in _hook_callers(manager).values():
            for impl in caller.get_hookimpls():
                if plugin is None or impl.plugin is plugin:
                    known_impls[id(impl)] = (impl, impl.function)

    def register(self, plugin, name=None):
        culprit = provenance.initiator(getframe(1))
        if culprit is not None:
            tampered("a pytest plugin registered by the code under test (%s)" % culprit)
        result = original_register(self, plugin, name)
        if culprit is None:
            learn(self, plugin)
        return result

    register.__name__ = register.__qualname__ = "register"
    manager_class.register = register

    # Tracing can jump over a test's lines (its asserts): only for code outside the
    # code under test.
    guards = guard_tracing(provenance, tampered)

    def check_hooks():
        manager = state["manager"]
        if manager is None:
            return
        if getattr(manager, "_inner_hookexec", None) is not state["hookexec"]:
            tampered("pytest's hook calling replaced")
        for name, caller in _hook_callers(manager).items():
            seen = state["callers"].setdefault(name, caller)
            if seen is not caller:
                tampered("the %s hook replaced" % name)
            for impl in caller.get_hookimpls():
                entry = known_impls.get(id(impl))
                if entry is None or entry[0] is not impl:
                    tampered("a %s implementation added outside plugin registration (%s)" % (name, impl.plugin_name))
                    known_impls[id(impl)] = (impl, impl.function)
                elif entry[1] is not impl.function:
                    tampered("the %s implementation of %s replaced" % (name, impl.plugin_name))

    def code_problem(item):
        """Why a test function is not the test module's own (None: it is)."""
        holders = [getattr(item, "obj", None)]
        parent = getattr(getattr(item, "parent", None), "obj", None)
        name = getattr(item, "originalname", None) or str(getattr(item, "name", "")).split("[")[0]
        if isinstance(parent, type):
            holders.append(getattr(parent, name, None))
        for holder in holders:
            function = getattr(holder, "__func__", holder)
            code = getattr(function, "__code__", None)
            if code is None:
                continue
            kind = provenance.kind(code.co_filename)
            if kind in ("stdlib", "installed", "machinery"):
                continue  # a decorator's wrapper (unittest.mock.patch, ...)
            if kind != "trusted":
                return "%s runs code from %s" % (item.nodeid, code.co_filename)
            references = compiled.get(os.path.realpath(code.co_filename))
            if references is None:
                try:
                    with open(code.co_filename, "rb") as handle:
                        references = nested_codes(compile(handle.read(), code.co_filename, "exec", dont_inherit=True))
                except (OSError, SyntaxError, ValueError):
                    references = []
                compiled[os.path.realpath(code.co_filename)] = references
            if not any(code is ref or same_code(code, ref) for ref in references):
                return "%s is not the function its test file defines" % item.nodeid
        return None

    class Reporter(object):
        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(self, config):
            state["manager"] = config.pluginmanager
            state["hookexec"] = getattr(config.pluginmanager, "_inner_hookexec", None)
            state["callers"].update(_hook_callers(config.pluginmanager))
            check_hooks()  # every implementation so far came through `register`

        @pytest.hookimpl(trylast=True)
        def pytest_sessionstart(self, session):
            # Between the first fingerprint and this one, conftest.py files may have
            # imported the code under test, and pytest patched itself (legacypath):
            # only pytest's own replacements are accepted.
            now = _fingerprint(Reporter)
            foreign = [
                key for key in changed_keys(baseline, now)
                if key not in now or not (pytest_own(now[key][0]) or provenance.installed(now[key][0]))
            ]  # fmt: skip
            if foreign:
                send({"kind": "tampered", "names": foreign[:50]})
            baseline.clear()
            baseline.update(now)
            check_hooks()

        def pytest_collection_finish(self, session):
            check_hooks()
            for item in session.items:
                problem = code_problem(item)
                if problem:
                    tampered(problem)
            for path in sorted(set(str(getattr(item, "path", getattr(item, "fspath", ""))) for item in session.items)):
                relative, want = expected_digest(path)
                if want is not None and file_digest(path) != want:
                    tampered("the test file %s changed before its tests ran" % relative)
            send({"kind": "collected", "nodeids": [item.nodeid for item in session.items]})

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_call(self, item):
            problem = code_problem(item)
            if problem:
                tampered(problem)
            yield

        def pytest_runtest_logreport(self, report):
            send(
                {
                    "kind": "report",
                    "nodeid": report.nodeid,
                    "when": report.when,
                    "outcome": report.outcome,
                    "xfail": hasattr(report, "wasxfail"),
                    # a subtest's report (pytest 9, pytest-subtests): one test, many reports
                    "sub": type(report).__name__ != "TestReport",
                }
            )
            check()

        def pytest_sessionfinish(self, session, exitstatus):
            check()
            send({"kind": "finished", "exitstatus": int(exitstatus)})

    baseline = _fingerprint(Reporter)  # before pytest imports any conftest.py or test
    reported = set()

    def check():
        changed = changed_keys(baseline, _fingerprint(Reporter))
        if changed and tuple(changed) not in reported:
            reported.add(tuple(changed))
            send({"kind": "tampered", "names": changed[:50]})
        if not tracing_guarded(guards):
            tampered("the runner's guard on trace functions removed")
        check_hooks()

    # What `python -m pytest` with PYTHONPATH would see; terminal mode runs pytest as Harbor's
    # test.sh does (its console script), with no working directory on sys.path.
    sys.path[0:0] = ([repo] if cwd_on_path else []) + list(paths)
    sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py")] + list(args)
    code = int(pytest.main(["-rA", "-p", "no:cacheprovider"] + list(args), plugins=[Reporter()]))
    send({"kind": "exit", "code": code})
    os.close(report_fd)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(code)  # no atexit hooks, no finalizers of the code under test
