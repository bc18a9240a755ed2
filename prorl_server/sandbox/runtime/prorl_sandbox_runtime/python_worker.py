"""Stateful Python: one worker process per sandbox keeps the agent's names between calls.

The worker (`prorl_runtime.py python-worker`) runs code in one namespace; the runtime
talks to it over pipes with the same frames as everywhere (wire.py) and interrupts a
call that outlives its timeout, killing the worker only when it does not yield.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from . import RUNTIME_SCRIPT
from .capped import CappedBuffer
from .wire import HEADER, encode_frame

PYTHON_ACK_S = 10.0
"""How long the Python worker has to take a timed-out call's interrupt (its handler says so
on a pipe) before it is killed and its names are lost: on a busy machine the worker may not
run for seconds, and killing it loses the agent's state. The whole wait stays below the
server's grace for a call (socket_runtime.CALL_GRACE_S, 15 s), so code that ignores the
interrupt is killed as the policy's timeout, never taken for a lost runtime."""
PYTHON_UNWIND_S = 3.0
"""Once the worker has taken the interrupt: how long its code has to unwind and reply (code
that swallows KeyboardInterrupt is killed after this, within PYTHON_ACK_S in all)."""


def python_worker(fd_in, fd_out, fd_ack=None):
    """Child process: executes code in one persistent namespace.

    stdout and stderr (fds 1 and 2, so child processes too) go to a file per
    call, read back by the parent. A SIGINT is written back on `fd_ack` (so
    that the parent knows the interpreter took it, however busy the machine)
    and interrupts the call it was sent for: each request says how many
    interrupts the parent had sent before it, so one meant for an earlier
    call that arrives late is only acknowledged, and one that arrives before
    the code starts stops it from starting.
    """
    namespace = {"__name__": "__main__"}
    control_in = os.fdopen(fd_in, "rb", buffering=0)
    control_out = os.fdopen(fd_out, "wb", buffering=0)
    state = {"seen": 0, "before": 0, "executing": False}

    def on_interrupt(signum, frame):
        state["seen"] += 1
        if fd_ack is not None:
            try:
                os.write(fd_ack, b"!")
            except OSError:
                pass
        if state["executing"] and state["seen"] > state["before"]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    while True:
        header = control_in.read(HEADER.size)
        if not header or len(header) < HEADER.size:
            return
        (size,) = HEADER.unpack(header)
        request = json.loads(control_in.read(size).decode("utf-8"))
        state["before"] = int(request.get("interrupts", 0))
        is_error = False
        with open(request["output"], "wb") as sink:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                code = compile(request["code"], "<agent>", "exec")
                state["executing"] = True
                if state["seen"] > state["before"]:
                    raise KeyboardInterrupt  # interrupted before it started
                exec(code, namespace)
            except BaseException as exc:  # noqa: BLE001 - the agent's exception is its output
                state["executing"] = False
                is_error = True
                # Show the agent's frames only, not this worker's.
                traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
            finally:
                state["executing"] = False
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        control_out.write(encode_frame({"is_error": is_error}))


class PythonSession:
    def __init__(self, workdir):
        self.workdir = workdir
        self.process = None
        self.lock = threading.Lock()
        self.scratch = tempfile.mkdtemp(prefix="prorl-py-")

    def _start(self):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        acks_r, acks_w = os.pipe()
        self.process = subprocess.Popen(
            [
                sys.executable, "-u", RUNTIME_SCRIPT, "python-worker",
                "--fd-in", str(to_child_r), "--fd-out", str(from_child_w), "--fd-ack", str(acks_w),
            ],
            pass_fds=(to_child_r, from_child_w, acks_w),
            stdin=subprocess.DEVNULL,
            cwd=self.workdir if os.path.isdir(self.workdir) else None,
            start_new_session=True,
        )  # fmt: skip
        os.close(to_child_r)
        os.close(from_child_w)
        os.close(acks_w)
        os.set_blocking(acks_r, False)
        self.to_child = to_child_w
        self.from_child = from_child_r
        self.acks = acks_r
        self.interrupts = 0

    def _kill(self):
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
            self.process.wait()
            os.close(self.to_child)
            os.close(self.from_child)
            os.close(self.acks)
        self.process = None

    def _drain_acks(self):
        """Acknowledgements left from earlier interrupts; True if there were any."""
        taken = False
        while True:
            try:
                chunk = os.read(self.acks, 4096)
            except (BlockingIOError, InterruptedError):
                return taken
            if not chunk:
                return taken
            taken = True

    def _await_reply(self, timeout, unwind=None):
        """The worker's reply within `timeout` (None: none came). With `unwind`: once the
        worker acknowledges the interrupt, it has `unwind` more seconds at most."""
        deadline = time.monotonic() + timeout
        data = b""
        watched = [self.from_child] if unwind is None else [self.from_child, self.acks]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select(watched, [], [], remaining)
            if not ready:
                continue
            if self.acks in ready:
                self._drain_acks()
                watched = [self.from_child]
                deadline = min(deadline, time.monotonic() + unwind)
                continue
            chunk = os.read(self.from_child, 65536)
            if not chunk:
                raise EOFError("python worker exited")
            data += chunk
            if len(data) >= HEADER.size:
                (size,) = HEADER.unpack(data[: HEADER.size])
                if len(data) >= HEADER.size + size:
                    return json.loads(data[HEADER.size : HEADER.size + size].decode("utf-8"))

    def run(self, code, timeout, cap):
        with self.lock:
            if self.process is None:
                self._start()
            started = time.monotonic()
            output_path = os.path.join(self.scratch, "out")
            body = json.dumps({"code": code, "output": output_path, "interrupts": self.interrupts}).encode("utf-8")
            os.write(self.to_child, HEADER.pack(len(body)) + body)
            timed_out = lost = False
            try:
                reply = self._await_reply(timeout)
                if reply is None:
                    timed_out = True
                    self._drain_acks()
                    self.interrupts += 1
                    os.killpg(self.process.pid, signal.SIGINT)
                    reply = self._await_reply(PYTHON_ACK_S, unwind=PYTHON_UNWIND_S)
                    if reply is None:
                        self._kill()
                        lost = True
            except EOFError:
                self._kill()
                reply, lost = None, True
            buffer = CappedBuffer(cap)
            try:
                with open(output_path, "rb") as handle:
                    while True:
                        chunk = handle.read(1 << 20)
                        if not chunk:
                            break
                        buffer.write(chunk)
            except OSError:
                pass
            text = buffer.text()
            if timed_out:
                text += "\n[execution timed out after %gs and was interrupted]" % timeout
            if lost and timed_out:
                text += (
                    "\n[the Python process did not stop within %gs of the interrupt and was killed; "
                    "variables defined so far are lost]" % PYTHON_ACK_S
                )
            elif lost:
                text += "\n[the Python process was killed; variables defined so far are lost]"
            return {
                "output": text,
                "is_error": bool(lost or timed_out or (reply or {}).get("is_error")),
                "truncated": buffer.truncated,
                "timed_out": timed_out,
                "state_lost": lost,
                "duration_s": time.monotonic() - started,
            }
