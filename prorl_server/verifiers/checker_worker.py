"""The checker process: runs answer checks for the server, one at a time, under hard limits.

Started by `CheckerPool` as `python -m prorl_server.verifiers.checker_worker MEMORY_MIB`. It
caps its address space (RLIMIT_AS: a check that needs more gets MemoryError), asks the
kernel to kill it when the server dies, imports and warms up the checks (math-verify, sympy,
pint) at the server's priority, so that their start-up never counts against a job's time
and a replacement is ready soon, and then, before it reads any answer, lowers its priority
(the server's event loop and sandboxes come first). Then it answers requests on
stdin/stdout until stdin ends.

Frames are a 4-byte big-endian length and a JSON object. Request: `{"check": name, "args":
{...}, "time_limit_s": s}`; reply: `{"result": ...}`, `{"error": "memory"}` (the process exits
after it), `{"error": "recursion"}` or `{"error": "exception", "message": ...}` (a bug).
Every reply carries `rss_mib`, so that the pool can retire a process a check left large.
The pool kills the process when a check runs past its time; RLIMIT_CPU, re-armed before
each check, is the backstop should the pool itself be unable to.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import signal
import struct
import sys
import traceback
import warnings
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


def _die_with_parent() -> None:
    """SIGKILL this process when the server that started it dies (Linux), even mid-check."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: stdin's end still stops an idle process
        pass
    if os.getppid() == 1:  # the server died before prctl took effect
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


def main(argv: list[str]) -> int:
    _die_with_parent()
    _limit(int(argv[1]))
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's print never corrupts a frame

    logging.disable(logging.WARNING)  # math-verify logs every answer it cannot parse
    warnings.simplefilter("ignore")
    try:
        from prorl_server.verifiers.checks import CHECKS, warm_up

        warm_up()
    except BaseException as exc:  # the server says why no checker could start
        replies.write(frame({"ready": False, "error": "".join(traceback.format_exception_only(exc)).strip()}))
        return 1
    # Started at the server's priority (a replacement is ready sooner on a busy machine);
    # every answer is checked at a lower one.
    os.nice(NICENESS)
    replies.write(frame({"ready": True, "rss_mib": _rss_mib()}))
    while (request := read_frame(requests)) is not None:
        # The receipt tells the server the request arrived: a process that dies before it
        # died idle (not the answer's doing), one that dies after it died checking.
        replies.write(frame({"received": True}))
        reply = _answer(CHECKS, request)
        try:
            reply["rss_mib"] = _rss_mib()
            replies.write(frame(reply))
        except MemoryError:
            replies.write(frame({"error": "memory"}))
            return 1
        if reply.get("error") == "memory":
            return 1  # whatever the check left behind goes with the process
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
