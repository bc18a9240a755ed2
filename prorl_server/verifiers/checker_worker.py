"""A checker process: runs answer checks for the server, one at a time, under hard limits.

Each checker is a fork of the template process (`checker_zygote.py`), which has imported
and warmed up the checks (math-verify, sympy, pint) once, so that a replacement for a killed
checker is ready in milliseconds and their start-up never counts against a job's time. Right
after the fork (`run_forked`) a checker caps its address space (RLIMIT_AS: a check that needs
more gets MemoryError), asks the kernel to kill it when the template dies (which dies with
the server), and, before it reads any answer, lowers its priority (the server's event loop
and sandboxes come first). Then it answers requests on its own socket until the socket ends.

Frames are a 4-byte big-endian length and a JSON object. First, unasked, `{"ready": true,
"rss_mib": r, "template": pid}`. Request: `{"check": name, "args": {...}, "time_limit_s":
s}`; the checker acks each at once with `{"received": true}` (a checker that dies before the
receipt died idle, not of the answer), then replies `{"result": ...}`, `{"error": "memory"}`
(the process exits after it), `{"error": "recursion"}` or `{"error": "exception", "message":
...}` (a bug). Every reply carries `rss_mib`, so that the pool can retire a process a check
left large. The pool kills the process when a check runs past its time; RLIMIT_CPU, re-armed
before each check, is the backstop should the pool itself be unable to.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import socket
import struct
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

NICENESS = 10
_HEADER = struct.Struct(">I")
_PR_SET_PDEATHSIG = 1


def read_frame(stream: BinaryIO) -> Any | None:
    """The next frame's object; None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def frame(value: Any) -> bytes:
    body = json.dumps(value, default=str).encode()
    return _HEADER.pack(len(body)) + body


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent`, the process that started it, dies (Linux), even
    mid-check; exit at once if it is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: stdin's end still stops an idle process
        pass
    if os.getppid() != parent:  # it died before prctl took effect (we were re-parented)
        os._exit(1)


def _limit(memory_mib: int) -> None:
    limit = memory_mib << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _arm_cpu_backstop(time_limit_s: float) -> None:
    """SIGXCPU (which ends the process) once this check used twice its time in CPU."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(spent + 2 * time_limit_s) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _answer(checks: dict[str, Callable[..., Any]], request: dict[str, Any]) -> dict[str, Any]:
    _arm_cpu_backstop(float(request.get("time_limit_s", 60.0)))
    check = checks.get(request.get("check", ""))
    if check is None:
        return {"error": "exception", "message": f"no check named {request.get('check')!r}"}
    try:
        return {"result": check(**request.get("args", {}))}
    except MemoryError:
        return {"error": "memory"}
    except RecursionError:
        return {"error": "recursion"}
    except Exception as exc:
        return {"error": "exception", "message": "".join(traceback.format_exception_only(exc)).strip()}


def run_forked(channel: socket.socket, memory_mib: int, *, parent: int) -> int:
    """A freshly forked checker's life: its limits, then checks on `channel` until it ends.
    The exit status to leave with."""
    die_with_parent(parent)
    _limit(memory_mib)
    os.nice(NICENESS)  # every answer is checked below the server's priority
    from prorl_server.verifiers.checks import CHECKS  # the template has it loaded: no import runs

    requests = channel.makefile("rb")

    def write(value: dict[str, Any]) -> None:
        channel.sendall(frame(value))

    write({"ready": True, "rss_mib": _rss_mib(), "template": parent})
    while (request := read_frame(requests)) is not None:
        # The receipt tells the server the request arrived: a process that dies before it
        # died idle (not the answer's doing), one that dies after it died checking.
        write({"received": True})
        reply = _answer(CHECKS, request)
        try:
            reply["rss_mib"] = _rss_mib()
            write(reply)
        except MemoryError:
            write({"error": "memory"})
            return 1
        if reply.get("error") == "memory":
            return 1  # whatever the check left behind goes with the process
    return 0
