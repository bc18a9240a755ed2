"""The runtime's socket: connections, their requests dispatched by `op` (wire.py's
names) to the shell, Python, the editor, files, reset and judging, and the runtime as
the container's PID 1 (serve_as_init).
"""

import base64
import errno
import fcntl
import os
import signal
import socket
import sys
import threading
import time

from . import wire
from .bash import BashSession
from .capped import DEFAULT_CAP, CappedBuffer, capped
from .editor import Editor, ToolError, resolve_path
from .http_relay import serve_relay
from .judge_launcher import run_judge
from .python_worker import PythonSession
from .reset import reset_runtime
from .wire import encode_frame, errno_of, recv_frame


class Runtime:
    """One sandbox's tools, and what each operation (wire.OP_*) does with a request."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.bash = BashSession(workdir)
        self.python = PythonSession(workdir)
        self.editor = Editor(workdir)
        self.started = time.time()
        self.operations = {
            wire.OP_HEALTH: self.health,
            wire.OP_BASH: self.run_bash,
            wire.OP_PYTHON: self.run_python,
            wire.OP_EDIT: self.edit,
            wire.OP_READ_FILE: self.read_file,
            wire.OP_WRITE_FILE: self.write_file,
            wire.OP_LIST_DIR: self.list_dir,
            wire.OP_RESET: self.reset,
            wire.OP_JUDGE: self.judge,
        }

    def dispatch(self, request):
        """The result of one request (its fields, without id and ok); raises when it cannot be served."""
        op = request.get(wire.OP)
        cap = int(request.get(wire.MAX_OUTPUT_BYTES) or DEFAULT_CAP)
        timeout = float(request.get(wire.TIMEOUT_S) or 30.0)
        operation = self.operations.get(op) if isinstance(op, str) else None
        if operation is None:
            raise ValueError("unknown op %r" % (op,))
        return operation(request, timeout, cap)

    def health(self, request, timeout, cap):
        return {"pid": os.getpid(), "python": sys.version.split()[0], "uptime_s": time.time() - self.started}

    def run_bash(self, request, timeout, cap):
        return self.bash.run(request["command"], timeout, cap)

    def run_python(self, request, timeout, cap):
        return self.python.run(request["code"], timeout, cap)

    def edit(self, request, timeout, cap):
        try:
            result, is_error = self.editor.handle(request), False
        except (ToolError, OSError) as exc:
            result, is_error = "Error: %s" % exc, True
        buffer = result if isinstance(result, CappedBuffer) else capped(result, cap)
        return {"output": buffer.text(), "is_error": is_error, "truncated": buffer.truncated}

    def read_file(self, request, timeout, cap):
        path = resolve_path(request.get("path", ""), self.workdir)
        with open(path, "rb") as handle:
            data = handle.read(int(request.get("max_bytes") or (1 << 30)) + 1)
        limit = int(request.get("max_bytes") or (1 << 30))
        return {"content_b64": base64.b64encode(data[:limit]).decode(), "truncated": len(data) > limit}

    def write_file(self, request, timeout, cap):
        path = resolve_path(request.get("path", ""), self.workdir)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(request["content_b64"]))
        if request.get("mode") is not None:
            os.chmod(path, int(request["mode"]))
        return {"path": path}

    def list_dir(self, request, timeout, cap):
        path = resolve_path(request.get("path", "."), self.workdir)
        entries = []
        for name in sorted(os.listdir(path)):
            info = os.lstat(os.path.join(path, name))
            kind = "dir" if os.path.isdir(os.path.join(path, name)) else "file"
            entries.append({"name": name, "type": kind, "size": info.st_size})
        return {"path": path, "entries": entries}

    def reset(self, request, timeout, cap):
        return reset_runtime(self, request)

    def judge(self, request, timeout, cap):
        return run_judge(request["mode"], request.get("spec") or {}, timeout, cap)


def serve_connection(runtime, conn):
    send_lock = threading.Lock()

    def answer(request):
        try:
            result = runtime.dispatch(request)
            reply = dict(result)
            reply.update({wire.ID: request.get(wire.ID), wire.OK: True})
        except Exception as exc:  # noqa: BLE001 - reported to the server, never fatal here
            reply = {
                wire.ID: request.get(wire.ID),
                wire.OK: False,
                wire.ERROR: "%s: %s" % (type(exc).__name__, exc),
                wire.ERRNO: errno_of(exc),
            }
        data = encode_frame(reply)
        with send_lock:
            try:
                conn.sendall(data)
            except OSError:
                pass

    try:
        while True:
            request = recv_frame(conn)
            if request is None:
                return
            if request.get(wire.OP) == wire.OP_RELAY:  # the connection becomes a relay channel
                if serve_relay(conn, send_lock, request):
                    return
                continue
            try:
                threading.Thread(target=answer, args=(request,), daemon=True).start()
            except RuntimeError:
                answer(request)  # no thread to be had (process limit reached): answer inline
    except (OSError, ValueError):
        return
    finally:
        conn.close()


def serve(socket_path, workdir):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    runtime = Runtime(workdir)
    try:
        os.unlink(socket_path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)
    server.bind(socket_path + ".tmp")
    os.umask(old_umask)
    server.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # the path appears only once it accepts
    fcntl.fcntl(server.fileno(), fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    while True:
        conn, _ = server.accept()
        try:
            threading.Thread(target=serve_connection, args=(runtime, conn), daemon=True).start()
        except RuntimeError:
            conn.close()


def serve_as_init(socket_path, workdir):
    """Be the container's PID 1 and serve from a child process.

    The kernel delivers no signal to a PID namespace's init from inside the
    namespace unless init handles it, so nothing the agent runs can kill or
    stop this process; SIGTERM is waited for and honoured only when it comes
    from outside the container (its sender's pid is then 0). The container
    therefore keeps running when the agent kills or stops the runtime (the
    child), which is how the server tells that apart from a container stopped
    or killed from outside. As init it also reaps orphaned processes.
    """
    watched = {signal.SIGCHLD, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    if os.fork() == 0:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
            serve(socket_path, workdir)
        finally:
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    while True:
        info = signal.sigwaitinfo(watched)
        if info.si_signo == signal.SIGTERM and info.si_pid == 0:
            os._exit(0)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
