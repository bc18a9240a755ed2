"""What every runner child guards itself with (pytest's, Django's, SymPy's): where code
comes from (Provenance), trace functions set by the code under test, comparing
fingerprints of functions by identity and code, and this package's own modules, which
every fingerprint covers.
"""

import os
import sys

PRELOAD_STDLIB = ("doctest", "pdb", "unittest", "faulthandler", "inspect", "warnings", "tempfile", "shutil")


def changed_keys(before, after):
    changed = []
    for key, (value, code) in before.items():
        now = after.get(key)
        if now is None or now[0] is not value or now[1] is not code:
            changed.append(key)
    return changed


def _origin(value):
    """The module a function, class, property or method wrapper was written in."""
    function = getattr(value, "__func__", getattr(value, "fget", value))
    module = getattr(function, "__module__", None)
    return module if isinstance(module, str) else ""


def pytest_own(value):
    return _origin(value).split(".")[0] in ("_pytest", "pytest", "pluggy")


class Provenance(object):
    """Where code comes from, as the runner sees it: pytest's and pluggy's own, the
    standard library's, a file of the repository the harness put in place (a test
    file, a conftest.py: `trusted`), or the repository's other files (the code under
    test). Anything outside the repository (site-packages) counts as installed."""

    def __init__(self, repo, trusted):
        import sysconfig

        self.repo = os.path.realpath(repo).rstrip("/") + "/"
        self.trusted = set(os.path.realpath(os.path.join(repo, path)) for path in trusted)
        self.own = os.path.dirname(os.path.realpath(os.path.abspath(__file__))) + "/"  # this package
        machinery = []
        for name in ("_pytest", "pluggy", "pytest"):
            module = sys.modules.get(name)
            if getattr(module, "__file__", None):
                machinery.append(os.path.dirname(os.path.realpath(module.__file__)) + "/")
        self.machinery = tuple(machinery)
        stdlib = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
        self.stdlib = os.path.realpath(stdlib).rstrip("/") + "/"
        self.cache = {}

    def kind(self, filename):
        """'machinery', 'stdlib', 'runner', 'trusted', 'untrusted' or 'installed'."""
        found = self.cache.get(filename)
        if found is None:
            found = self.cache[filename] = self._kind(filename)
        return found

    def _kind(self, filename):
        if filename.startswith("<frozen") or filename.startswith("<pytest"):
            return "machinery"
        if filename.startswith("<"):
            return "untrusted"  # exec'd or compiled text: only the code under test writes that
        real = os.path.realpath(filename)
        if real.startswith(self.own):
            return "runner"
        if real.startswith(self.machinery):
            return "machinery"
        if real.startswith(self.repo):
            return "trusted" if real in self.trusted else "untrusted"
        if real.startswith(self.stdlib) and "-packages/" not in real:
            return "stdlib"
        return "installed" if os.path.exists(real) else "untrusted"

    def installed(self, value):
        """Whether a function or class was written outside the repository (an installed
        plugin such as hypothesis's may patch pytest as it loads)."""
        module = sys.modules.get(_origin(value))
        filename = getattr(module, "__file__", None)
        return isinstance(filename, str) and self.kind(filename) in ("installed", "machinery", "stdlib")

    def initiator(self, frame):
        """The first frame below pytest, pluggy and the standard library: None if it is the
        runner, a trusted file or installed code; else where it is (the code under test,
        or a thread's bottom: nothing of the runner's own stack)."""
        while frame is not None:
            kind = self.kind(frame.f_code.co_filename)
            if kind in ("runner", "trusted", "installed"):
                return None
            if kind == "untrusted":
                return "%s:%d" % (frame.f_code.co_filename, frame.f_lineno)
            frame = frame.f_back
        return "a stack with no caller of the runner's (another thread)"


def guard_tracing(provenance, report):
    """Replace sys.settrace and threading.settrace with versions that `report` a trace
    function set by the code under test (a trace function can jump over a test's
    asserts). Returns the guards, to check they stay in place."""
    import threading

    getframe = sys._getframe

    def guarded(original, what):
        def settrace(function):
            if function is not None:
                culprit = provenance.initiator(getframe(1))
                if culprit is not None:
                    report("%s by the code under test (%s)" % (what, culprit))
            return original(function)

        settrace.__name__ = settrace.__qualname__ = original.__name__
        return settrace

    sys.settrace = guarded(sys.settrace, "a trace function set")
    threading.settrace = guarded(threading.settrace, "a trace function set for threads")
    return sys.settrace, threading.settrace


def tracing_guarded(guards):
    import threading

    return sys.settrace is guards[0] and threading.settrace is guards[1]


def nested_codes(code):
    """Every code object in a compiled module."""
    found, stack = [], [code]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(const for const in current.co_consts if hasattr(const, "co_code"))
    return found


def same_code(a, b):
    return a.co_code == b.co_code and a.co_names == b.co_names and a.co_varnames == b.co_varnames


def own_modules():
    """This package's modules that are loaded (judge_main.py imports every one the harness
    runs before any code under test): each runner's fingerprint covers them, so the code under
    test cannot replace a function the reporter calls (file_digest, the comparisons here)
    without the run being `tampered`."""
    package = __name__.rpartition(".")[0]
    return [
        module
        for name, module in sorted(sys.modules.items())
        if module is not None and (name == package or name.startswith(package + "."))
    ]
