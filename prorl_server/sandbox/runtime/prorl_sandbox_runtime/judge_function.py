"""Function mode: check() runs here, against a proxy whose calls go to the candidate's
process (candidate.py) and whose results come back as plain data only (see
prorl_judge.py, "Modes").
"""

import builtins
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from . import JUDGE_SCRIPT
from .candidate import describe_exception
from .judge_processes import ERROR_CHARS, clean_env, kill_descendants, kill_group
from .pipe_frames import FrameReader, ProtocolError, Timeout, write_all
from .plain_data import NotPlainData, decode_plain, encode_plain
from .wire import encode_frame


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
        [sys.executable, "-I", "-B", "-u", JUDGE_SCRIPT, "candidate",
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
        verdict.update(reason="check() raised %s" % type(exc).__name__, error=describe_exception(exc))
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
