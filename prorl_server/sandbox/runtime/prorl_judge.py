#!/usr/bin/env python3
"""prorl judging harness: verdicts that the code under test cannot write.

Runs inside a sandbox on the image's own python3 (3.8 and newer), stdlib only,
beside prorl_runtime.py (bind-mounted read-only). The runtime's `judge`
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
- pytest and its dependencies are imported before the repository is on
  sys.path (no module of the repository stands in for them);
- every frame carries a per-run key the harness gives the runner on its stdin
  before any test code is imported; frames without it (written by someone who
  knows only the protocol) are ignored and flagged;
- the stream is checked here: one report per phase of each collected test, a
  failure in any report wins, a final frame, pytest's exit status consistent
  with the reports and with the runner's real exit status;
- pytest's reporting machinery (and the reporter) is fingerprinted before any
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

import base64
import builtins
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

if __package__:  # imported by the server's tests
    from .prorl_sandbox_runtime import wire
else:  # run as a script under -I: the package beside this file, before anything else
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from prorl_sandbox_runtime import wire

HEADER = wire.HEADER
MAX_FRAME = wire.MAX_PIPE
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
ERROR_CHARS = 4000


# --- hardening and processes ------------------------------------------------------


def prctl(option, value):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, "prctl(%d, %d): %s" % (option, value, os.strerror(error)))


def harden(subreaper=False):
    """Non-dumpable (and optionally a child subreaper) before untrusted code runs."""
    prctl(PR_SET_DUMPABLE, 0)
    if subreaper:
        prctl(PR_SET_CHILD_SUBREAPER, 1)


def clean_env(**extra):
    """The environment untrusted code starts with: nothing inherited but the basics. TMPDIR is
    kept when the runtime started with one: it names the sandbox's own temporary directory
    (unset in the images, so /tmp; a folder of the fake sandbox's on a test host, where the
    tests' pytest would otherwise share, and prune, the host's /tmp/pytest-of-<user>)."""
    env = {
        "PATH": os.environ.get("PATH") or DEFAULT_PATH,
        "HOME": os.environ.get("HOME") or "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if os.environ.get("TMPDIR"):
        env["TMPDIR"] = os.environ["TMPDIR"]
    env.update(extra)
    return env


def _process_table():
    """ppid -> [(pid, state)] for every visible process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table.setdefault(int(fields[1]), []).append((int(entry), fields[0]))
    return table


def descendants(root):
    """Living (not zombie) descendants of `root`."""
    table = _process_table()
    found, stack = [], [root]
    while stack:
        for pid, state in table.get(stack.pop(), ()):
            stack.append(pid)
            if state != b"Z":
                found.append(pid)
    return found


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants():
    """SIGKILL everything below this process (orphans come back to it as subreaper).

    Only call once the exit status of every subprocess.Popen still needed has
    been collected: it reaps any child."""
    me = os.getpid()
    for _ in range(200):
        pids = descendants(me)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
        reap()
    reap()


def kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.kill()
    except OSError:
        pass


# --- frames over pipes ------------------------------------------------------------


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed frame."""


encode_frame = wire.encode_frame


def write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameReader:
    """Length-prefixed JSON frames from a pipe, read with deadlines and a size cap."""

    def __init__(self, fd, max_frame=MAX_FRAME):
        self.fd = fd
        self.max_frame = max_frame
        self.buffer = bytearray()
        self.eof = False

    def pop(self):
        """A complete buffered frame, or None."""
        if len(self.buffer) < HEADER.size:
            return None
        (size,) = HEADER.unpack(bytes(self.buffer[: HEADER.size]))
        if size > self.max_frame:
            raise ProtocolError("a frame of %d bytes (the limit is %d)" % (size, self.max_frame))
        if len(self.buffer) < HEADER.size + size:
            return None
        body = bytes(self.buffer[HEADER.size : HEADER.size + size])
        del self.buffer[: HEADER.size + size]
        try:
            message = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError("a frame that is not JSON (%s)" % type(exc).__name__)
        if not isinstance(message, dict):
            raise ProtocolError("a frame that is not a JSON object")
        return message

    def fill(self, timeout):
        """Read what arrives within `timeout`; False once the pipe is at EOF."""
        if self.eof:
            return False
        ready, _, _ = select.select([self.fd], [], [], None if timeout is None else max(timeout, 0))
        if ready:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.eof = True
                return False
            self.buffer += chunk
        return True

    def read(self, deadline=None):
        """The next frame; None at EOF; raises Timeout at the deadline (None: wait)."""
        while True:
            message = self.pop()
            if message is not None:
                return message
            if self.eof:
                return None
            if deadline is None:
                self.fill(None)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout()
            self.fill(remaining)

    def drain(self, quiet_s, limit_s):
        """Read until EOF, until nothing arrives for quiet_s, or for at most limit_s."""
        deadline = time.monotonic() + limit_s
        while not self.eof and time.monotonic() < deadline and len(self.buffer) <= self.max_frame:
            ready, _, _ = select.select([self.fd], [], [], quiet_s)
            if not ready:
                return
            chunk = os.read(self.fd, 1 << 16)
            if chunk:
                self.buffer += chunk
            else:
                self.eof = True


class Timeout(BaseException):
    """The judging deadline passed (a BaseException: check() cannot swallow it)."""


# --- plain data ---------------------------------------------------------------------


class NotPlainData(Exception):
    """A value that is not made of builtin data types only."""


MAX_DEPTH = 100
MAX_ITEMS = 2000000
_SEQUENCES = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_REBUILD = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def type_name(value):
    kind = type(value)
    try:
        name = "%s.%s" % (kind.__module__, kind.__qualname__)
    except Exception:
        name = "an unnamed type"
    return name if isinstance(name, str) else "an unnamed type"


def encode_plain(value):
    """`value` as tagged JSON, if it is built from exact builtin types only.

    Exact means `type(x) is int`, never a subclass: a subclass can override
    __eq__ (the AlwaysEqual trick) or any other method. Floats and ints travel
    as hex (exact, NaN, infinities, -0.0, and no digit limits)."""
    budget = [MAX_ITEMS]

    def encode(item, depth):
        if depth > MAX_DEPTH:
            raise NotPlainData("nested deeper than %d levels" % MAX_DEPTH)
        budget[0] -= 1
        if budget[0] < 0:
            raise NotPlainData("more than %d values" % MAX_ITEMS)
        kind = type(item)
        if item is None:
            return ["none"]
        if kind is bool:
            return ["bool", item]
        if kind is int:
            return ["int", hex(item)]
        if kind is float:
            return ["float", item.hex()]
        if kind is complex:
            return ["complex", item.real.hex(), item.imag.hex()]
        if kind is str:
            return ["str", item]
        if kind is bytes or kind is bytearray:
            return ["bytes" if kind is bytes else "bytearray", base64.b64encode(bytes(item)).decode("ascii")]
        if kind in _SEQUENCES:
            return [_SEQUENCES[kind], [encode(member, depth + 1) for member in item]]
        if kind is dict:
            return ["dict", [[encode(key, depth + 1), encode(val, depth + 1)] for key, val in item.items()]]
        raise NotPlainData("a %s object" % type_name(item))

    return encode(value, 0)


def decode_plain(data):
    """Rebuild a value from encode_plain's form, trusting nothing about `data`."""
    budget = [MAX_ITEMS]

    def text(node, index):
        if len(node) <= index or type(node[index]) is not str:
            raise NotPlainData("a malformed %s" % node[0])
        return node[index]

    def decode(node, depth):
        if depth > MAX_DEPTH:
            raise NotPlainData("nested deeper than %d levels" % MAX_DEPTH)
        budget[0] -= 1
        if budget[0] < 0:
            raise NotPlainData("more than %d values" % MAX_ITEMS)
        if type(node) is not list or not node or type(node[0]) is not str:
            raise NotPlainData("a malformed value")
        tag = node[0]
        try:
            if tag == "none" and len(node) == 1:
                return None
            if tag == "bool" and len(node) == 2 and type(node[1]) is bool:
                return node[1]
            if tag == "int" and len(node) == 2:
                return int(text(node, 1), 16)
            if tag == "float" and len(node) == 2:
                return float.fromhex(text(node, 1))
            if tag == "complex" and len(node) == 3:
                return complex(float.fromhex(text(node, 1)), float.fromhex(text(node, 2)))
            if tag == "str" and len(node) == 2:
                return text(node, 1)
            if tag in ("bytes", "bytearray") and len(node) == 2:
                raw = base64.b64decode(text(node, 1).encode("ascii"), validate=True)
                return raw if tag == "bytes" else bytearray(raw)
            if tag in _REBUILD and len(node) == 2 and type(node[1]) is list:
                return _REBUILD[tag](decode(member, depth + 1) for member in node[1])
            if tag == "dict" and len(node) == 2 and type(node[1]) is list:
                result = {}
                for pair in node[1]:
                    if type(pair) is not list or len(pair) != 2:
                        raise NotPlainData("a malformed dict")
                    result[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
                return result
        except (ValueError, TypeError, OverflowError, UnicodeError) as exc:
            raise NotPlainData("a malformed %s (%s)" % (tag, type(exc).__name__))
        raise NotPlainData("a malformed or unknown value %r" % tag[:40])

    return decode(data, 0)


# --- function mode: check() here, the candidate in a child --------------------------


class CandidateBroken(BaseException):
    """The candidate broke the protocol: the submission fails whatever check() does.

    A BaseException, so that `except Exception` in a test cannot swallow it; a
    bare `except:` can, which is why the harness also remembers it."""


def candidate_sources(prompt, answer, entry_point):
    """What the candidate process executes, in order, as (label, code, required).

    The prompt first (its helper functions, e.g. HumanEval's `poly`), then the
    answer: a whole function replaces the prompt's stub, a body completes it."""
    if "def %s" % entry_point in answer:
        return [("<prompt>", prompt, False), ("<answer>", answer, True)]
    return [("<answer>", prompt + answer, True)]


def _builtin_exception(exc):
    """The nearest builtin Exception class of `exc`, by name (None if none is)."""
    for kind in type(exc).__mro__:
        name = getattr(kind, "__name__", None)
        if isinstance(name, str) and getattr(builtins, name, None) is kind and issubclass(kind, Exception):
            return name
    return None


def candidate_worker(fd_in, fd_out):
    """The untrusted side: load the candidate, then answer calls. Nothing here is trusted."""
    reader = FrameReader(fd_in)
    setup = reader.read()
    if setup is None:
        return
    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        for label, code, required in setup["sources"]:
            try:
                exec(compile(code, label, "exec"), namespace)
            except Exception:
                if required:
                    raise
        function = namespace.get(setup["entry_point"])
        if not callable(function):
            raise NameError("the submission defines no function %r" % setup["entry_point"])
    except BaseException as exc:
        write_all(fd_out, encode_frame({"load_error": _format_exception(exc)}))
        return
    write_all(fd_out, encode_frame({"ready": True}))
    while True:
        request = reader.read()
        if request is None:
            return
        seq = request.get("call")
        reply = {"seq": seq}
        try:
            args, kwargs = decode_plain(request["args"])
            result = function(*args, **kwargs)
        except Exception as exc:
            reply["raised"] = {
                "type": _builtin_exception(exc) or "Exception",
                "message": ("%s: %s" % (type(exc).__name__, exc))[:ERROR_CHARS],
            }
            try:
                reply["raised"]["args"] = encode_plain(list(exc.args))
            except NotPlainData:
                pass
        except BaseException as exc:
            reply["exit"] = ("%s: %s" % (type(exc).__name__, exc))[:ERROR_CHARS]
        else:
            try:
                reply["value"] = encode_plain(result)
            except NotPlainData as exc:
                reply["not_plain"] = str(exc)
        write_all(fd_out, encode_frame(reply))
        if "exit" in reply:
            return


def _format_exception(exc):
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text[-ERROR_CHARS:]


class CandidateProxy:
    """The checker's side of the candidate: calls go out as plain data, results
    come back as plain data, and any breach is remembered in `broken`."""

    def __init__(self, process, to_child, reader, deadline):
        self.process = process
        self.to_child = to_child
        self.reader = reader
        self.deadline = deadline
        self.broken = None
        self.calls = 0

    def fail(self, reason):
        if self.broken is None:
            self.broken = reason
        raise CandidateBroken(self.broken)

    def receive(self):
        try:
            message = self.reader.read(self.deadline)
        except ProtocolError as exc:
            self.fail("the candidate sent %s" % exc)
        if message is None:
            self.fail("the candidate's process ended (%s)" % _exit_description(self.process))
        return message

    def call(self, args, kwargs):
        if self.broken is not None:
            raise CandidateBroken(self.broken)
        self.calls += 1
        try:
            payload = encode_plain([list(args), dict(kwargs)])
        except NotPlainData as exc:
            raise TypeError("the judge passes plain data only; this test passes %s" % exc)
        try:
            write_all(self.to_child, encode_frame({"call": self.calls, "args": payload}))
        except OSError:
            self.fail("the candidate's process ended (%s)" % _exit_description(self.process))
        reply = self.receive()
        if reply.get("seq") != self.calls:
            self.fail("the candidate answered out of turn")
        if "value" in reply:
            try:
                return decode_plain(reply["value"])
            except NotPlainData as exc:
                self.fail("the candidate returned %s" % exc)
        if "not_plain" in reply:
            self.fail("the candidate returned %s, not plain data" % str(reply["not_plain"])[:300])
        if "exit" in reply:
            self.fail("the candidate raised %s" % str(reply["exit"])[:300])
        raised = reply.get("raised")
        if isinstance(raised, dict):
            raise _rebuild_exception(raised)
        self.fail("the candidate sent a malformed answer")


def _rebuild_exception(raised):
    """A builtin exception standing for the one the candidate raised."""
    message = str(raised.get("message", ""))[:ERROR_CHARS]
    kind = getattr(builtins, str(raised.get("type")), None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = Exception
    args = None
    if "args" in raised:
        try:
            args = decode_plain(raised["args"])
        except NotPlainData:
            args = None
    for attempt in (args, [message]):
        if isinstance(attempt, list):
            try:
                return kind(*attempt)
            except Exception:
                pass
    return RuntimeError(message)


def _exit_description(process):
    try:
        code = process.wait(timeout=1.0)  # its pipe closes a moment before it can be reaped
    except subprocess.TimeoutExpired:
        return "it closed its pipe"
    if code < 0:
        return "killed by signal %d" % -code
    return "exit status %d" % code


def _on_alarm(signum, frame):
    raise Timeout()


def make_proxy_function(proxy, entry_point):
    def candidate(*args, **kwargs):
        return proxy.call(args, kwargs)

    candidate.__name__ = candidate.__qualname__ = entry_point
    return candidate


def judge_function(spec):
    """Run the task's check() here against the candidate in its own process."""
    started = time.monotonic()
    deadline = started + float(spec["timeout_s"])
    entry_point = str(spec["entry_point"])
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    workdir = tempfile.mkdtemp(prefix="prorl-candidate-")
    process = subprocess.Popen(
        [sys.executable, "-I", "-B", "-u", os.path.abspath(__file__), "candidate",
         "--fd-in", str(to_child_r), "--fd-out", str(from_child_w)],
        pass_fds=(to_child_r, from_child_w),
        stdin=subprocess.DEVNULL,
        cwd=workdir,
        env=clean_env(),
        preexec_fn=os.setpgrp,
    )  # fmt: skip
    os.close(to_child_r)
    os.close(from_child_w)
    proxy = CandidateProxy(process, to_child_w, FrameReader(from_child_r), deadline)
    verdict = {"passed": False, "verdict": "fail"}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.001))
    try:
        sources = candidate_sources(str(spec["prompt"]), str(spec["answer"]), entry_point)
        write_all(to_child_w, encode_frame({"sources": sources, "entry_point": entry_point}))
        ready = proxy.receive()
        if "load_error" in ready:
            verdict.update(reason="the submission failed to load", error=str(ready["load_error"])[-ERROR_CHARS:])
        elif ready.get("ready") is not True:
            proxy.fail("the candidate sent a malformed greeting")
        else:
            function = make_proxy_function(proxy, entry_point)
            namespace = {"__name__": "__check__"}
            try:
                exec(compile(str(spec["prompt"]), "<prompt>", "exec"), namespace)
            except Exception:
                pass  # a prompt that is not a program on its own: its helpers are not needed
            namespace[entry_point] = function
            exec(compile(str(spec["test"]), "<test>", "exec"), namespace)
            check = namespace.get("check")
            if not callable(check):
                raise NameError("the task's test defines no check(candidate)")
            check(function)
            if proxy.broken is None:
                verdict.update(passed=True, verdict="pass", reason="check() returned normally")
            else:
                verdict.update(reason=proxy.broken)
    except Timeout:
        verdict.update(reason="the tests ran past %gs" % float(spec["timeout_s"]), timed_out=True)
    except CandidateBroken as exc:
        verdict.update(reason=str(exc))
    except BaseException as exc:
        verdict.update(reason="check() raised %s" % type(exc).__name__, error=_format_exception(exc))
        if proxy.broken is not None:
            verdict["reason"] = proxy.broken
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    kill_group(process)
    process.wait()
    kill_descendants()
    shutil.rmtree(workdir, ignore_errors=True)
    verdict.update(calls=proxy.calls, duration_s=time.monotonic() - started)
    return verdict


# --- stdio mode ---------------------------------------------------------------------


def _read_capped(process, fd, cap, deadline):
    """The process's stdout up to `cap` bytes; (data, truncated, timed_out).

    Reading stops at EOF, or shortly after the process exits (what it left
    running may hold the pipe open), or at the deadline."""
    chunks, size, exited_at = [], 0, None
    while True:
        now = time.monotonic()
        if now >= deadline:
            return b"".join(chunks), size > cap, process.poll() is None
        if exited_at is None and process.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.2:
            return b"".join(chunks), size > cap, False
        ready, _, _ = select.select([fd], [], [], min(deadline - now, 0.05))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), size > cap, False
        if size < cap:
            chunks.append(chunk[: cap - size])
        size += len(chunk)


def judge_stdio(spec):
    """Run the program on each input; report its own stdout and exit status per input."""
    timeout = float(spec["timeout_s"])
    caps = spec["max_stdout_bytes"]
    workdir = tempfile.mkdtemp(prefix="prorl-program-")
    results = []
    for index, data in enumerate(spec["inputs"]):
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as handle:
            handle.write(str(spec["program"]))
        stdin = tempfile.TemporaryFile()
        stdin.write(str(data).encode("utf-8"))
        stdin.seek(0)
        started = time.monotonic()
        read_end, write_end = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "solution.py"],
            stdin=stdin, stdout=write_end, cwd=workdir, env=clean_env(), preexec_fn=os.setpgrp,
        )  # fmt: skip
        os.close(write_end)
        stdin.close()
        out, truncated, timed_out = _read_capped(process, read_end, int(caps[index]), started + timeout)
        if timed_out:
            kill_group(process)
        try:
            code = process.wait(timeout=max(started + timeout - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            kill_group(process)
            code, timed_out = process.wait(), True
        os.close(read_end)
        kill_descendants()
        results.append(
            {
                "stdout": out.decode("utf-8", "replace"),
                "truncated": truncated,
                "exit_code": code,
                "timed_out": timed_out,
                "duration_s": time.monotonic() - started,
            }
        )
    shutil.rmtree(workdir, ignore_errors=True)
    return {"tests": results}


# --- swe mode: the repository, test infrastructure, pytest --------------------------

# Files pytest or Python load as configuration or plugins, wherever they sit. Matched
# without regard to case: importlib.metadata finds `X.DIST-INFO` folders, and a
# case-insensitive file system would load `CONFTEST.PY`.
INFRA_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "entry_points.txt",  # only read inside metadata folders, matched anywhere
        ".gitattributes",  # changes how git applies the test patch
    }
)
# Modules Python's site imports at start-up, in any form (a .py, a package, an extension).
INFRA_STEMS = frozenset({"sitecustomize", "usercustomize"})
INFRA_SUFFIXES = (".pth", ".pyc", ".pyo", ".egg-link", ".egg")
# Folders whose content is packaging metadata (entry points: pytest11 plugins) or bytecode.
INFRA_DIR_SUFFIXES = (".dist-info", ".egg-info", ".egg")
INFRA_DIRS = frozenset({"__pycache__", ".pytest_cache"})


def is_test_infrastructure(path):
    """Whether a repository path (posix, relative) is configuration or a plugin
    that Python or pytest would load: the model's patch may not change it. Case
    does not matter."""
    parts = [part.lower() for part in path.split("/") if part]
    if not parts:
        return False
    name = parts[-1]
    if name in INFRA_NAMES or name.endswith(INFRA_SUFFIXES) or name.split(".", 1)[0] in INFRA_STEMS:
        return True
    return any(part in INFRA_DIRS or part.endswith(INFRA_DIR_SUFFIXES) or part in INFRA_STEMS for part in parts)


def test_file_of(node_id):
    return node_id.split("::", 1)[0]


def git_env():
    return clean_env(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null", GIT_TERMINAL_PROMPT="0")


def git(repo, args, stdin=None, timeout=120):
    """(exit code, stdout, stderr) of a git command run without a shell."""
    try:
        done = subprocess.run(
            ["git"] + list(args),
            cwd=repo,
            input=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=git_env(),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return -1, b"", b"git %s timed out" % args[0].encode()
    return done.returncode, done.stdout, done.stderr


def nul_paths(data):
    return [os.fsdecode(item) for item in data.split(b"\0") if item]


def patch_paths(repo, patch_file):
    """Every path a patch touches (old and new names), exactly as git reads it."""
    code, out, err = git(repo, ["apply", "--numstat", "-z", patch_file])
    if code != 0:
        return []
    paths, tokens, index = [], out.split(b"\0"), 0
    while index < len(tokens):
        fields = tokens[index].split(b"\t", 2)
        index += 1
        if len(fields) < 3:
            continue
        if fields[2]:
            paths.append(os.fsdecode(fields[2]))
        elif index + 1 < len(tokens):  # a rename: old and new name follow
            paths += [os.fsdecode(tokens[index]), os.fsdecode(tokens[index + 1])]
            index += 2
    return paths


def changed_paths(repo, base, untracked_before):
    """(tracked paths that differ from base, files that are new) in the work tree."""
    _, tracked, _ = git(repo, ["diff", "-z", "--name-only", "--no-renames", base, "--"])
    _, others, _ = git(repo, ["ls-files", "-z", "--others"])
    return set(nul_paths(tracked)), set(nul_paths(others)) - untracked_before


def restore_protected(repo, base, protected, untracked_before):
    """Put every protected path the patch changed back as it is at base.

    Returns (restored, deleted, still_changed)."""
    tracked, new = changed_paths(repo, base, untracked_before)
    restore = sorted(path for path in tracked if protected(path))
    delete = sorted(path for path in new if protected(path))
    for path in delete:
        full = os.path.join(repo, path)
        try:
            os.unlink(full)
        except IsADirectoryError:
            shutil.rmtree(full, ignore_errors=True)
        except OSError:
            pass
        parent = os.path.dirname(full)
        while parent.startswith(repo.rstrip("/") + "/"):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)
    if restore:
        spec = b"\0".join(os.fsencode(path) for path in restore)
        git(
            repo,
            ["--literal-pathspecs", "checkout", base, "--pathspec-from-file=-", "--pathspec-file-nul"],
            stdin=spec,
        )
    tracked, new = changed_paths(repo, base, untracked_before)
    still = sorted(path for path in tracked | new if protected(path))
    return restore, delete, still


def apply_patch(repo, text, name, workdir):
    path = os.path.join(workdir, name)
    with open(path, "wb") as handle:
        handle.write(text.encode("utf-8", "surrogateescape"))
    code, out, err = git(repo, ["apply", "--verbose", "--whitespace=nowarn", path])
    log = (out + err).decode("utf-8", "replace")
    say("$ git apply %s\n%s" % (name, log))
    return code == 0, log[-ERROR_CHARS:], path


def say(text):
    """A line for the human-readable log (stdout), never part of the verdict."""
    try:
        write_all(1, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _capped_list(paths, limit=200):
    return paths[:limit] + (["... and %d more" % (len(paths) - limit)] if len(paths) > limit else [])


def judge_swe(spec):
    """Patch, restore test infrastructure, patch the tests, run them with the reporter."""
    workdir = tempfile.mkdtemp(prefix="prorl-judge-")
    try:
        return _judge_swe(spec, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _judge_swe(spec, workdir):
    repo = str(spec["repo_dir"])
    base = str(spec["base_commit"])
    tests = [str(test) for test in spec["tests"]]
    verdict = {"stage": "model_patch", "restored": [], "deleted": []}
    _, others, _ = git(repo, ["ls-files", "-z", "--others"])
    untracked_before = set(nul_paths(others))
    if spec.get("patch", "").strip():
        applied, log, _ = apply_patch(repo, spec["patch"], "model.patch", workdir)
        if not applied:
            verdict.update(ok=False, output=log)
            return verdict
    test_patch = str(spec.get("test_patch", ""))
    protected_files = set(test_file_of(test) for test in tests)
    protected_files.update(str(path) for path in spec.get("infrastructure") or [])
    # Every file under a tests/ folder is the tests' (helpers a test module imports
    # included): a fix has no business there. Off only when the spec says so.
    test_dirs = spec.get("protect_test_dirs", True) is not False
    test_patch_file = None
    if test_patch.strip():
        test_patch_file = os.path.join(workdir, "test.patch")
        with open(test_patch_file, "wb") as handle:
            handle.write(test_patch.encode("utf-8", "surrogateescape"))
        protected_files.update(patch_paths(repo, test_patch_file))
    protected_files.update(package_inits(set(test_file_of(test) for test in tests) | protected_files))
    ancestors = set()
    for path in protected_files:
        parts = path.split("/")
        ancestors.update("/".join(parts[:index]) for index in range(1, len(parts)))

    def protected(path):
        if test_dirs and "tests" in path.split("/")[:-1]:
            return True  # test packages (Django's tests/, SymPy's */tests/, a pytest suite's helpers)
        if path in protected_files or is_test_infrastructure(path):
            return True
        # Whatever stands where a protected file must go: a directory at a test file's
        # path (a file inside it), or a file or link where its folder must be.
        return path in ancestors or any(path.startswith(other + "/") for other in protected_files)

    verdict["stage"] = "restore"
    restored, deleted, still = restore_protected(repo, base, protected, untracked_before)
    verdict.update(restored=_capped_list(restored), deleted=_capped_list(deleted))
    if restored or deleted:
        say("restored to %s: %s\ndeleted: %s" % (base[:12], restored, deleted))
    if still:
        verdict.update(ok=False, output="cannot restore: %s" % _capped_list(still, 20))
        return verdict
    verdict["stage"] = "test_patch"
    if test_patch_file is not None:
        applied, log, _ = apply_patch(repo, test_patch, "test.patch", workdir)
        if not applied:
            # The task's fault only if it does not apply at the base commit either;
            # otherwise the model's patch (what is left of it) stands in its way.
            verdict.update(ok=False, output=log, applies_at_base=applies_at_base(repo, base, test_patch_file, workdir))
            return verdict
    verdict["stage"] = "tests"
    watched = watched_files(repo, protected)
    before = file_digests(repo, watched)
    verdict["watched_files"] = len(watched)
    if spec.get("runner", "pytest") == "pytest":
        verdict.update(ok=True, **run_pytest(repo, spec, tests, workdir, before))
    else:
        verdict.update(ok=True, **run_runner(repo, spec, workdir, before))
    verdict["anomalies"] = list(verdict.get("anomalies") or []) + files_changed(repo, protected, before)
    return verdict


def package_inits(paths):
    """The `__init__.py` of each test folder above each test file (from the first folder
    named test*, down): pytest imports a test module with its package and runs their
    code. The packages of the code under test are never among them."""
    found = set()
    for path in paths:
        parts = path.split("/")[:-1]
        first = next((index for index, part in enumerate(parts) if part.lower().startswith("test")), None)
        if first is None:
            continue
        for index in range(first + 1, len(parts) + 1):
            found.add("/".join(parts[:index] + ["__init__.py"]))
    return found


def applies_at_base(repo, base, patch_file, workdir):
    """Whether the patch applies to the base commit's tree (checked in a scratch index,
    the work tree untouched)."""
    env = dict(git_env(), GIT_INDEX_FILE=os.path.join(workdir, "base.index"))
    try:
        if subprocess.run(["git", "read-tree", base], cwd=repo, env=env, capture_output=True, timeout=120).returncode:
            return False
        done = subprocess.run(
            ["git", "apply", "--cached", "--check", patch_file], cwd=repo, env=env, capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def watched_files(repo, protected):
    """The protected paths present in the work tree (tracked or not, ignored included)."""
    _, listed, _ = git(repo, ["ls-files", "-z", "--cached", "--others"])
    return sorted(set(path for path in nul_paths(listed) if protected(path)))


def file_digest(path):
    """What a file is: a link's target, or the sha256 of its content; None when absent."""
    import hashlib

    try:
        if os.path.islink(path):
            return "link:" + os.readlink(path)
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def file_digests(repo, paths):
    return dict((path, file_digest(os.path.join(repo, path))) for path in paths)


def files_changed(repo, protected, before):
    """The run's changes to the task's test files and test infrastructure: a test file
    rewritten or deleted, a conftest.py, a .pth, bytecode written (an anomaly each)."""
    after = watched_files(repo, protected)
    changed = []
    for path in sorted(set(before) | set(after)):
        if path not in before:
            changed.append("%s (new)" % path)
        else:
            now = file_digest(os.path.join(repo, path))
            if now != before[path]:
                changed.append("%s (%s)" % (path, "deleted" if now is None else "rewritten"))
    if not changed:
        return []
    return ["the tests' files changed during the run: %s" % ", ".join(_capped_list(changed, 20))]


def collect_reports(process, report_r, started, timeout):
    """Read the runner child's report frames until it ends (or `timeout` runs out, or the
    stream breaks: then its process group is killed), then what it and any process its
    tests left behind wrote last. Returns (frames, problem, timed out, exit code); closes report_r."""
    reader = FrameReader(report_r)
    frames, problem, timed_out = [], None, False
    deadline = started + timeout
    while True:
        try:
            frame = reader.read(min(deadline, time.monotonic() + 0.2))
        except Timeout:
            if process.poll() is not None:
                break  # exited; something it started may hold the pipe
            if time.monotonic() >= deadline:
                timed_out = True
                break
            continue
        except ProtocolError as exc:
            problem = "the report stream broke: %s" % exc
            break
        if frame is None:
            break
        frames.append(frame)
    if timed_out or problem:
        kill_group(process)
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        kill_group(process)
        code = process.wait()
    # The rest of the stream: what the runner wrote last, and whatever processes the
    # tests left behind write there before they are killed (an anomaly, if anything).
    reader.drain(0.5, 2.0)
    kill_descendants()
    reader.drain(0.5, 2.0)
    try:
        while True:
            frame = reader.pop()
            if frame is None:
                break
            frames.append(frame)
    except ProtocolError as exc:
        problem = problem or "the report stream broke: %s" % exc
    os.close(report_r)
    return frames, problem, timed_out, code


# The most of a runner child's printed log that goes back to the server.
LOG_CAP = 8 << 20


def run_child(python, mode, options, args, repo, env, workdir, timeout, briefing=None):
    """Run this file in runner mode `mode` in a child: its printed stdout and stderr go to a
    file in `workdir`, the run's key to its stdin (then `briefing`, a line of JSON, if
    given), and its report frames are collected.

    Returns (key, frames, problem, timed out, exit code, the printed log (at most
    LOG_CAP bytes, as text), whether the log was longer)."""
    report_r, report_w = os.pipe()
    argv = list(python) + [os.path.abspath(__file__), mode, "--report-fd", str(report_w)] + list(options)
    log_path = os.path.join(workdir, "test.log")
    started = time.monotonic()
    key = os.urandom(16).hex()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv + ["--"] + list(args), pass_fds=(report_w,), stdin=subprocess.PIPE, stdout=log,
            stderr=subprocess.STDOUT, cwd=repo, env=env, preexec_fn=os.setpgrp,
        )  # fmt: skip
    os.close(report_w)
    try:
        process.stdin.write(key.encode() + b"\n")
        if briefing is not None:
            process.stdin.write(json.dumps(briefing).encode("utf-8") + b"\n")
        process.stdin.close()
    except OSError:
        pass
    frames, problem, timed_out, code = collect_reports(process, report_r, started, timeout)
    with open(log_path, "rb") as handle:
        raw = handle.read(LOG_CAP + 1)
    return key, frames, problem, timed_out, code, raw[:LOG_CAP].decode("utf-8", "replace"), len(raw) > LOG_CAP


def run_pytest(repo, spec, tests, workdir, digests):
    """Run the selected tests in a runner child; its reporter's frames are the outcome.

    The runner is told the digest of every protected file (`digests`: the test files
    and test infrastructure as the harness put them in place): the files it may
    trust, and what pytest must read when it imports a test module."""
    started = time.monotonic()
    paths = [os.path.join(repo, entry) for entry in str(spec.get("pythonpath") or "").split(":") if entry]
    options = []
    for path in paths:
        options += ["--path", path]
    env = clean_env()
    if paths:
        env["PYTHONPATH"] = ":".join(paths)  # for the processes the tests start
    pycache = tempfile.mkdtemp(prefix="pycache-", dir=workdir)
    options += ["--pycache", pycache]
    if spec.get("cwd_on_path", True) is False:
        options += ["--cwd-on-path", "no"]
    key, frames, problem, timed_out, code, log, truncated = run_child(
        [sys.executable, "-I", "-B", "-u"], "pytest", options, tests, repo, env, workdir, float(spec["timeout_s"]),
        briefing={"digests": digests},
    )  # fmt: skip
    if os.listdir(pycache):
        problem = problem or "bytecode was written where pytest would read it back (%s)" % pycache
    outcome = aggregate_reports(frames, tests, key)
    if problem:
        outcome["anomalies"].append(problem)
    if outcome["complete"] and outcome["exit_code"] != code:
        outcome["anomalies"].append(
            "the runner exited with %s, not pytest's exit code %s" % (code, outcome["exit_code"])
        )
    outcome.update(
        timed_out=timed_out, runner_exit=code, duration_s=time.monotonic() - started, log=log, log_truncated=truncated
    )
    return outcome


def phase_status(phases):
    """One test's status, as pytest's -rA summary names it, from its reports.

    A failure anywhere wins: an extra "passed" report cannot hide a real failure."""
    if not phases:
        return "MISSING"
    if any(when != "call" and outcome == "failed" for when, outcome, _, _ in phases):
        return "ERROR"
    if any(outcome == "failed" for _, outcome, _, _ in phases):
        return "FAILED"
    for when, outcome, xfail, sub in phases:
        if when == "call" and not sub:
            if outcome == "passed":
                return "XPASS" if xfail else "PASSED"
            return "XFAIL" if xfail else "SKIPPED"
    for when, outcome, xfail, _ in phases:
        if when == "setup" and outcome == "skipped":
            return "XFAIL" if xfail else "SKIPPED"
    return "MISSING"


def aggregate_reports(frames, tests, key):
    """Per-test statuses from the reporter's frames, and whatever does not add up.

    Expected: `collected`, then one `report` per phase of each collected test,
    then `finished` (pytest's exit status) and `exit` (the code the runner
    exits with), each carrying the run's key (given to the runner on its stdin
    before any test code was imported). A frame without the key (ignored), a
    duplicate, a report of an uncollected test, a frame after `exit`, or an
    exit status that contradicts the reports is an anomaly; a stream without
    `exit` is incomplete (the runner died or was made to exit)."""
    anomalies, phases, seen = [], {}, set()
    collected, finished, exit_code, after_exit = None, None, None, False
    foreign = 0
    for frame in frames:
        if frame.get("key") != key:
            foreign += 1
            continue
        kind = frame.get("kind")
        if exit_code is not None:
            after_exit = True
        if kind == "collected" and collected is None and isinstance(frame.get("nodeids"), list):
            collected = set(str(node) for node in frame["nodeids"])
        elif kind == "report" and finished is None:
            phase = (str(frame.get("nodeid")), str(frame.get("when")))
            sub = frame.get("sub") is True
            if phase in seen and not sub:
                anomalies.append("two %s reports for %s" % (phase[1], phase[0]))
            if not sub:
                seen.add(phase)
            if collected is not None and phase[0] not in collected:
                anomalies.append("a report for %s, which was not collected" % phase[0])
            outcome = (phase[1], str(frame.get("outcome")), frame.get("xfail") is True, sub)
            phases.setdefault(phase[0], []).append(outcome)
        elif kind == "tampered":
            anomalies.append("the test run was tampered with: %s" % str(frame.get("names"))[:500])
        elif kind == "finished" and finished is None:
            finished = frame.get("exitstatus")
        elif kind == "exit" and exit_code is None and finished is not None:
            exit_code = frame.get("code")
        else:
            anomalies.append("an unexpected %s frame" % str(kind)[:40])
    if after_exit:
        anomalies.append("frames after the runner's last one")
    if foreign:
        anomalies.append("%d frames that did not come from the reporter (no run key)" % foreign)
    failed = any(report[1] == "failed" for reports in phases.values() for report in reports)
    if finished == 0 and failed:
        anomalies.append("pytest reported success, but a test failed")
    if finished == 1 and not failed:
        anomalies.append("pytest reported failed tests, but none failed")
    statuses = dict((test, phase_status(phases.get(test, ()))) for test in tests)
    return {
        "statuses": statuses,
        "anomalies": anomalies,
        "exitstatus": finished,
        "exit_code": exit_code,
        "complete": exit_code is not None and type(exit_code) is int,
        # Every collected test's status (terminal mode runs whole test files, not named tests).
        "collected": dict((test, phase_status(phases.get(test, ()))) for test in sorted(collected or ())),
    }


# --- terminal mode (Harbor / Terminal-Bench tasks) ------------------------------------
#
# The agent's work is its working directory, as a tar archive taken from the
# agent's sandbox; this sandbox is a fresh one of the same image. The harness
# empties the working directory and unpacks the archive into it (never through
# a link, no device, no hard link, nothing outside it), puts the task's test
# files in the tests folder (whatever stood there removed first), and runs the
# test files with the pytest runner above from the working directory, as
# Harbor's test.sh does (its pytest command puts no working directory on
# sys.path, so neither does the runner here). The outcome is the reporter's; the tests folder is
# compared after the run with what was put there.


def clear_dir(path):
    """Remove what `path` holds (not `path` itself); returns what could not be removed."""
    left = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        try:
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        except OSError:
            left.append(name)
    return left


def safe_parts(name):
    """The path components of an archive member or a test file name; None if it leaves its root."""
    if name.startswith("/"):
        return None
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if any(part == ".." for part in parts):
        return None
    return parts


def unpack_state(archive, root):
    """Unpack the agent's archive into `root`: (members written, members skipped with why)."""
    import tarfile

    real_root = os.path.realpath(root)
    written, skipped = 0, []
    with tarfile.open(archive, "r:") as tar:
        for member in tar:
            parts = safe_parts(member.name)
            if parts is None:
                skipped.append("%s (outside the working directory)" % member.name[:200])
                continue
            if not parts:
                continue
            target = os.path.join(real_root, *parts)
            if os.path.realpath(os.path.dirname(target)) != os.path.join(real_root, *parts[:-1]):
                skipped.append("%s (through a link)" % member.name[:200])
                continue
            if os.path.lexists(target) and not (member.isdir() and os.path.isdir(target)):
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
            if member.isdir():
                if not os.path.isdir(target):
                    os.mkdir(target)
                os.chmod(target, (member.mode & 0o777) | 0o700)
            elif member.isfile():
                source = tar.extractfile(member)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as handle:
                    shutil.copyfileobj(source, handle)
                os.chmod(target, (member.mode & 0o777) | 0o600)
            elif member.issym():
                os.symlink(member.linkname, target)
            else:
                skipped.append("%s (not a file, folder or symbolic link)" % member.name[:200])
                continue
            written += 1
    return written, skipped


def tree_digests(root):
    """{path: digest} of every file and link under `root` (folders by their content)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path = os.path.join(folder, name)
            found[path] = file_digest(path)
    return found


def judge_terminal(spec):
    workdir = tempfile.mkdtemp(prefix="prorl-judge-")
    try:
        return _judge_terminal(spec, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _judge_terminal(spec, scratch):
    app = os.path.realpath(str(spec["workdir"]))
    tests_dir = os.path.abspath(str(spec["tests_dir"]))
    verdict = {"stage": "state", "skipped": []}
    real_tests = os.path.realpath(tests_dir)
    for one, other in ((app, real_tests), (real_tests, app)):
        if one == other or one.startswith(other.rstrip("/") + "/"):
            verdict.update(stage="tests_in_place", ok=False, output="the working directory and the tests overlap")
            return verdict
    archive = str(spec.get("state") or "")
    try:
        if not os.path.isdir(app):
            os.makedirs(app)
        left = clear_dir(app)
        if left:
            say("could not empty the working directory: %s" % _capped_list(left, 20))
        if archive:
            written, skipped = unpack_state(archive, app)
            verdict["skipped"] = _capped_list(skipped, 50)
            say("unpacked %d entries of the agent's working directory into %s" % (written, app))
            os.unlink(archive)
    except Exception as exc:  # a broken archive is the agent's doing (it made the files)
        verdict.update(ok=False, output="%s: %s" % (type(exc).__name__, str(exc)[:ERROR_CHARS]))
        return verdict
    verdict["stage"] = "tests_in_place"
    digests, paths = {}, []
    try:
        if os.path.islink(tests_dir) or (os.path.lexists(tests_dir) and not os.path.isdir(tests_dir)):
            os.unlink(tests_dir)
        if os.path.isdir(tests_dir):
            left = clear_dir(tests_dir)
            if left:
                raise OSError("cannot empty %s: %s" % (tests_dir, _capped_list(left, 20)))
        else:
            os.makedirs(tests_dir)
        for name, encoded in sorted(dict(spec.get("tests") or {}).items()):
            parts = safe_parts(str(name))
            if not parts:
                raise OSError("a test file named %r" % name)
            target = os.path.join(tests_dir, *parts)
            if not os.path.isdir(os.path.dirname(target)):
                os.makedirs(os.path.dirname(target))
            with open(target, "wb") as handle:
                handle.write(base64.b64decode(encoded))
            os.chmod(target, 0o755 if name.endswith(".sh") else 0o644)
        for name in spec.get("logs_dirs") or []:
            if os.path.isdir(name) and not os.path.islink(name):
                clear_dir(name)
            elif not os.path.lexists(name):
                try:
                    os.makedirs(name)
                except OSError:
                    pass
    except Exception as exc:  # nothing of the agent's here: the image's or the task's doing
        verdict.update(ok=False, output="%s: %s" % (type(exc).__name__, str(exc)[:ERROR_CHARS]))
        return verdict
    before = tree_digests(tests_dir)
    for path, digest in before.items():
        digests[os.path.relpath(os.path.realpath(path), app)] = digest
    for name in spec["run"]:
        paths.append(os.path.join(tests_dir, *safe_parts(str(name))))
    verdict["stage"] = "tests"
    run_spec = {"timeout_s": spec["timeout_s"], "cwd_on_path": False}
    verdict.update(ok=True, **run_pytest(app, run_spec, paths, scratch, digests))
    after = tree_digests(tests_dir)
    changed = [
        "%s (%s)" % (path, "new" if path not in before else "deleted" if path not in after else "rewritten")
        for path in sorted(set(before) | set(after))
        if before.get(path) != after.get(path)
    ]
    if changed:
        verdict["anomalies"] = list(verdict.get("anomalies") or []) + [
            "the tests' files changed during the run: %s" % ", ".join(_capped_list(changed, 20))
        ]
    return verdict


# --- the pytest runner (the child of swe mode) ---------------------------------------

_PRELOAD = ("pluggy", "iniconfig", "packaging.version", "tomllib", "tomli", "attr", "exceptiongroup", "py")
_PRELOAD_STDLIB = ("doctest", "pdb", "unittest", "faulthandler", "inspect", "warnings", "tempfile", "shutil")
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
    for name in _PRELOAD + _PRELOAD_STDLIB:
        try:
            importlib.import_module(name)
        except Exception:
            pass


def _fingerprint(extra):
    """The functions and classes of pytest's reporting path, by identity."""
    items = {}

    def add(key, value):
        if isinstance(value, (type, classmethod, staticmethod, property)) or callable(value):
            function = getattr(value, "__func__", getattr(value, "fget", value))
            items[key] = (value, getattr(function, "__code__", None))

    for name in _WATCHED_MODULES:
        module = sys.modules.get(name)
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


def _changed(before, after):
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


def _pytest_own(value):
    return _origin(value).split(".")[0] in ("_pytest", "pytest", "pluggy")


class _Provenance(object):
    """Where code comes from, as the runner sees it: pytest's and pluggy's own, the
    standard library's, a file of the repository the harness put in place (a test
    file, a conftest.py: `trusted`), or the repository's other files (the code under
    test). Anything outside the repository (site-packages) counts as installed."""

    def __init__(self, repo, trusted):
        import sysconfig

        self.repo = os.path.realpath(repo).rstrip("/") + "/"
        self.trusted = set(os.path.realpath(os.path.join(repo, path)) for path in trusted)
        self.own = os.path.realpath(os.path.abspath(__file__))
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
        if real == self.own:
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


def _hook_callers(manager):
    """{hook name: caller} of a pluggy plugin manager."""
    return dict((name, caller) for name, caller in list(vars(manager.hook).items()) if hasattr(caller, "get_hookimpls"))


def _codes(code):
    """Every code object in a compiled module."""
    found, stack = [], [code]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(const for const in current.co_consts if hasattr(const, "co_code"))
    return found


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
    provenance = _Provenance(repo, digests)
    getframe = sys._getframe

    own_codes = frozenset(_codes(pytest_runner.__code__))

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
            compiled[os.path.realpath(str(fn))] = _codes(result[1])
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
                        references = _codes(compile(handle.read(), code.co_filename, "exec", dont_inherit=True))
                except (OSError, SyntaxError, ValueError):
                    references = []
                compiled[os.path.realpath(code.co_filename)] = references
            if not any(code is ref or _same_code(code, ref) for ref in references):
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
                key for key in _changed(baseline, now)
                if key not in now or not (_pytest_own(now[key][0]) or provenance.installed(now[key][0]))
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
        changed = _changed(baseline, _fingerprint(Reporter))
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


# --- Django's and SymPy's runners (children of swe mode) ------------------------------
#
# The official command runs in a runner child with the environment the image's
# `testbed` activation gives (SWE-bench's `source /opt/miniconda3/bin/activate;
# conda activate testbed`). Its printed log (stdout and stderr, to a file)
# comes back for the server to parse with SWE-bench's parser; each test's
# outcome comes over the keyed report pipe from hooks installed before any
# code of the repository is imported:
# - django: on the standard library's unittest.TestResult (which Django's
#   result classes extend), accepted only when unittest's own TestCase.run
#   (the code object captured at start) of that very test is on the stack, or
#   unittest's suite code for a class- or module-level error;
# - sympy: on PyTestReporter of sympy/testing/runtests.py (restored to the base
#   commit, and checked against a compile of that file when it loads), accepted
#   only when called directly from SymPyTests.test_file.
# Everything of unittest (or of the reporter) is fingerprinted after the hooks
# are in and compared at every report and at the end: a patch that replaces a
# method there makes the run `tampered`.

ACTIVATE = "/opt/miniconda3/bin/activate"
_UNITTEST_MODULES = (
    "unittest.case", "unittest.result", "unittest.suite", "unittest.runner", "unittest.loader",
    "unittest.main", "unittest.util", "unittest.signals",
)  # fmt: skip
_SYMPY_WATCHED = ("PyTestReporter", "Reporter", "SymPyTests")
_SYMPY_HOOKS = ("entering_test", "test_pass", "test_fail", "test_exception", "test_skip", "test_xfail", "test_xpass")


def activated_env(spec):
    """The environment of the image's testbed activation (SWE-bench's eval script's
    first two lines) plus the version's exports; the harness's own when the image
    has no /opt/miniconda3."""
    env = clean_env()
    env_name = str(spec.get("conda_env") or "testbed")
    if os.path.exists(ACTIVATE):
        script = "source %s && conda activate %s && env -0" % (ACTIVATE, env_name)
        try:
            done = subprocess.run(
                ["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=60, cwd="/"
            )
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0:
            for item in done.stdout.split(b"\0"):
                name, sep, value = item.decode("utf-8", "replace").partition("=")
                if sep and name in ("PATH", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "CONDA_SHLVL"):
                    env[name] = value
    for name, value in dict(spec.get("env") or {}).items():
        env[str(name)] = str(value)
    return env


def runner_python(env):
    found = shutil.which("python", path=env.get("PATH")) or shutil.which("python3", path=env.get("PATH"))
    return found or sys.executable


def run_runner(repo, spec, workdir, digests):
    """Run the official command of a Django or SymPy instance; outcomes from the report pipe
    (`digests`: the protected files, which the runner may trust)."""
    args = [str(arg) for arg in spec.get("test_args") or []]
    env = activated_env(spec)
    env["PYTHONHASHSEED"] = str(int.from_bytes(os.urandom(4), "big"))  # random, as the official run
    started = time.monotonic()
    key, frames, problem, timed_out, code, log, truncated = run_child(
        [runner_python(env), "-s", "-B", "-u"], str(spec["runner"]), [], args, repo, env, workdir,
        float(spec["timeout_s"]), briefing={"digests": digests},
    )  # fmt: skip
    outcome = aggregate_results(frames, key)
    if problem:
        outcome["anomalies"].append(problem)
    if outcome["complete"] and outcome["exit_code"] != code:
        outcome["anomalies"].append(
            "the runner exited with %s, not the test command's %s" % (code, outcome["exit_code"])
        )
    outcome.update(
        timed_out=timed_out, runner_exit=code, exitstatus=outcome["exit_code"], duration_s=time.monotonic() - started,
        log=log, log_truncated=truncated,
    )  # fmt: skip
    return outcome


_STATUS_RANK = {"PASSED": 0, "XFAIL": 0, "SKIPPED": 1, "FAILED": 2, "ERROR": 2}


def aggregate_results(frames, key):
    """Per-test statuses (by the official parser's test names) from a unittest-style runner's frames.

    Expected: `report` frames (a test's final outcome, once per test id, or a
    subtest's failure), then `exit` with the test command's exit code. A frame
    without the run key, a second final report of one test, a report from
    outside the runner's own code (`foreign`), a changed fingerprint
    (`tampered`), a frame after `exit`, or an exit code 0 after a failure is an
    anomaly; without `exit` the run is incomplete."""
    anomalies, statuses, finals = [], {}, set()
    sub_failed = {}
    exit_code, after_exit, foreign_frames = None, False, 0
    failed = False
    for frame in frames:
        if frame.get("key") != key:
            foreign_frames += 1
            continue
        kind = frame.get("kind")
        if exit_code is not None:
            after_exit = True
        if kind == "report":
            name, status = str(frame.get("name")), str(frame.get("status"))
            if status not in _STATUS_RANK:
                anomalies.append("a report with status %r" % status[:20])
                continue
            failed = failed or status in ("FAILED", "ERROR")
            if frame.get("sub") is True:
                sub_failed[name] = status
                continue
            test_id = str(frame.get("id"))
            if test_id in finals:
                anomalies.append("two reports for %s" % test_id[:200])
            finals.add(test_id)
            statuses[name] = status
        elif kind == "foreign":
            anomalies.append("a test outcome reported from outside the test runner: %s" % str(frame.get("what"))[:300])
        elif kind == "tampered":
            anomalies.append("the test run was tampered with: %s" % str(frame.get("names"))[:500])
        elif kind == "exit" and exit_code is None:
            exit_code = frame.get("code")
        elif kind != "started":
            anomalies.append("an unexpected %s frame" % str(kind)[:40])
    for name, status in sub_failed.items():
        if _STATUS_RANK.get(statuses.get(name, "PASSED"), 0) < _STATUS_RANK[status]:
            statuses[name] = status
    if after_exit:
        anomalies.append("frames after the runner's last one")
    if foreign_frames:
        anomalies.append("%d frames that did not come from the reporter (no run key)" % foreign_frames)
    if exit_code == 0 and failed:
        anomalies.append("the test command reported success, but a test failed")
    return {
        "statuses": statuses,
        "anomalies": anomalies,
        "exit_code": exit_code,
        "complete": exit_code is not None and type(exit_code) is int,
    }


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

    for name in _PRELOAD_STDLIB + ("unittest.mock", "runpy", "argparse", "multiprocessing"):
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
    modules = [sys.modules[name] for name in _UNITTEST_MODULES if name in sys.modules]
    baseline = _identity_fingerprint([], modules)
    reported = set()
    guards = guard_tracing(_Provenance(os.getcwd(), channel.briefing.get("digests") or {}), channel.tampered)

    def check():
        changed = _changed(baseline, _identity_fingerprint([], modules))
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


def _same_code(a, b):
    return a.co_code == b.co_code and a.co_names == b.co_names and a.co_varnames == b.co_varnames


def sympy_runner(report_fd, args):
    """`bin/test -C --verbose FILES` with SymPy's reporter reporting over the pipe."""
    harden()
    channel = _Channel(report_fd)
    send = channel.send
    import runpy

    compile_ = builtins.compile
    getframe = sys._getframe
    state = {"baseline": None, "test_file": None, "current": None, "classes": []}
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
                    if want is None or not _same_code(code, want):
                        differ.append("%s.%s" % (cls.__name__, member))
        if differ:
            send({"kind": "tampered", "names": differ[:50]})
        reporter = module.PyTestReporter
        state["test_file"] = module.SymPyTests.test_file.__code__
        for method in _SYMPY_HOOKS:
            hook(reporter, method)
        state["classes"] = classes
        state["baseline"] = _identity_fingerprint(classes, [])

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
    guards = guard_tracing(_Provenance(repo, channel.briefing.get("digests") or {}), channel.tampered)

    def check():
        if not tracing_guarded(guards):
            channel.tampered("the runner's guard on trace functions removed")
        if state["baseline"] is None:
            return
        changed = _changed(state["baseline"], _identity_fingerprint(state["classes"], []))
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


# --- entry point ----------------------------------------------------------------------

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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
