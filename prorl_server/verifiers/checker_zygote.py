"""The template every checker process is forked from: the checks are imported once, here.

Importing math-verify, sympy and pint takes seconds of CPU (far more on a busy machine), and
every checker killed at its time limit needs a replacement. So `CheckerPool` starts this
process once (`python -m prorl_server.verifiers.checker_zygote FD SERVER_PID`); it imports and warms up
the checks at the server's priority, freezes what it loaded out of the garbage collector's
reach (a fork then shares those pages instead of copying them), and from then on only
forks: a replacement is a `fork()`, ready in milliseconds, with everything already loaded.

Each fork becomes one checker (`checker_worker.run_forked`): it caps its own address space,
lowers its own priority, dies with this process, and answers checks on a socket of its own.
This process holds no answer and runs no check; it dies with the server (PR_SET_PDEATHSIG),
and its checkers die with it.

The control channel is the SOCK_SEQPACKET socket FD, one JSON object a message:
- from here, once: `{"ready": true}` after the warm-up, or `{"ready": false, "error": ...}`;
- to here: `{"fork": n, "memory_mib": m}`;
- from here: `{"forked": n, "pid": p}` carrying two descriptors, the server's end of the
  checker's socket and a pidfd of the checker (the server kills through it: no pid reuse
  can make it kill another process); `{"failed": n, "error": ...}` if fork() failed;
- from here: `{"exited": p, "status": s}` once a checker has ended and been reaped (`s` as
  `Popen.returncode`: the exit status, or minus the signal that ended it).
The end of the control socket (the server closed it or died) ends this process and its
checkers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import traceback
import warnings
from typing import Any

from prorl_server.verifiers.checker_worker import die_with_parent, run_forked

_MAX_MESSAGE = 65536


def _send(control: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(control, [data], fds)
    else:
        control.send(data)


class _Zygote:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, None)
        self.children: dict[int, int] = {}  # pidfd -> pid

    def serve(self) -> int:
        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    if not self._on_request():
                        self._stop()
                        return 0
                else:
                    self._reap(key.fd)

    def _on_request(self) -> bool:
        """False at the control channel's end."""
        try:
            data = self.control.recv(_MAX_MESSAGE)
        except ConnectionError:
            return False
        if not data:
            return False
        request = json.loads(data)
        self._fork(int(request["fork"]), int(request["memory_mib"]))
        return True

    def _fork(self, number: int, memory_mib: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        template = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            ours.close()
            theirs.close()
            _send(self.control, {"failed": number, "error": str(exc)})
            return
        if pid == 0:  # the checker: nothing of the template's channels goes with it
            code = 1
            try:
                theirs.close()
                self.control.close()
                self.selector.close()
                for pidfd in self.children:
                    os.close(pidfd)
                code = run_forked(ours, memory_mib, parent=template)
            finally:
                os._exit(code)
        ours.close()
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        try:
            _send(self.control, {"forked": number, "pid": pid}, [theirs.fileno(), pidfd])
        finally:
            theirs.close()

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            _send(self.control, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})

    def _stop(self) -> None:
        for pidfd in list(self.children):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        for pidfd in list(self.children):
            self._reap(pidfd)


def main(argv: list[str]) -> int:
    die_with_parent(int(argv[2]))
    control = socket.socket(fileno=int(argv[1]))
    logging.disable(logging.WARNING)  # math-verify logs every answer it cannot parse
    warnings.simplefilter("ignore")
    try:
        from prorl_server.verifiers.checks import warm_up

        warm_up()
    except BaseException as exc:  # the server says why no checker could start
        _send(control, {"ready": False, "error": "".join(traceback.format_exception_only(exc)).strip()})
        return 1
    gc.collect()
    gc.freeze()  # what is loaded stays shared with every fork (no collector pass touches it)
    _send(control, {"ready": True})
    return _Zygote(control).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
