#!/usr/bin/env python3
"""prorl in-sandbox runtime: bash, Python and files behind a Unix socket.

Runs inside a sandbox container on the image's own python3 (3.8 and newer),
stdlib only. The server connects to the socket and sends requests; each
connection may carry several requests at once (answers are matched by id).

Wire format, both directions: a frame is an 8-byte big-endian length and that
many bytes of UTF-8 JSON. A request is {"id": int, "op": str, ...}; the answer
is {"id": int, "ok": true, ...result} or {"id": int, "ok": false, "error": str}
when the request itself could not be served. A tool that ran but failed (a
command's non-zero exit, an editor mistake) is ok: true with is_error set.

`judge` starts the judging harness (prorl_judge.py, beside this file) and
returns the verdict it wrote on a pipe of its own (see run_judge). The runtime
makes itself non-dumpable before serving: what the agent or the judged code
runs (the same uid) cannot ptrace it, read its memory or open its fds.

`gateway`, sent on a connection of its own, makes the runtime listen for HTTP on
the sandbox's own loopback (127.0.0.1, and [::1] when there is IPv6) and relay
each request to the server over that connection (see Gateway), so a program
inside reaches the server's endpoint while the sandbox has no network.
"""

import argparse
import base64
import codecs
import collections
import errno
import fcntl
import http
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time
import traceback
import tty

if __package__:  # imported by the server (its tests, the HTTP adapter's header list)
    from .prorl_sandbox_runtime import wire
else:  # run as a script: the package beside this file comes first, whatever else is on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from prorl_sandbox_runtime import wire

HEADER = wire.HEADER
DEFAULT_CAP = 64 * 1024
INTERRUPT_GRACE_S = 1.0
BASH_START_S = 120.0
"""How long a new bash has to read its set-up line (seconds on a loaded machine)."""
PYTHON_ACK_S = 10.0
"""How long the Python worker has to take a timed-out call's interrupt (its handler says so
on a pipe) before it is killed and its names are lost: on a busy machine the worker may not
run for seconds, and killing it loses the agent's state. The whole wait stays below the
server's grace for a call (socket_runtime.CALL_GRACE_S, 15 s), so code that ignores the
interrupt is killed as the policy's timeout, never taken for a lost runtime."""
PYTHON_UNWIND_S = 3.0
"""Once the worker has taken the interrupt: how long its code has to unwind and reply (code
that swallows KeyboardInterrupt is killed after this, within PYTHON_ACK_S in all)."""


# --- framing -----------------------------------------------------------------


read_frame = wire.recv_frame
encode_frame = wire.encode_frame


# --- output capping ------------------------------------------------------------


class CappedBuffer:
    """Keeps the head and a rolling tail of a stream, never all of it."""

    def __init__(self, limit):
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def write(self, data):
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 4 * self.half:
                del self.tail[: len(self.tail) - self.half]

    @property
    def truncated(self):
        return self.total > 2 * self.half

    def text(self):
        head = bytes(self.head).decode("utf-8", "replace")
        if not self.truncated:
            return head + bytes(self.tail).decode("utf-8", "replace")
        tail = bytes(self.tail[-self.half :])
        omitted = self.total - len(self.head) - len(tail)
        return "%s\n[... %d bytes of output truncated ...]\n%s" % (
            head,
            omitted,
            tail.decode("utf-8", "ignore"),
        )


def capped(text, limit):
    """A CappedBuffer holding `text` (any str, lone surrogates of odd file names included)."""
    buffer = CappedBuffer(limit)
    buffer.write(text.encode("utf-8", "surrogateescape"))
    return buffer


# --- bash on a pty -----------------------------------------------------------------


class BashSession:
    """One interactive bash on a pty: cwd, environment and jobs persist.

    Each command is written to a file and sourced, followed by a sentinel
    that carries its exit status. On timeout the terminal's foreground process
    group gets SIGINT, then SIGKILL; bash itself survives.
    """

    def __init__(self, workdir):
        self.workdir = workdir
        self.pid = None
        self.pid_reaped = False
        self.exit_status = -1
        self.fd = None
        self.counter = 0
        self.lock = threading.Lock()
        self.scratch = tempfile.mkdtemp(prefix="prorl-bash-")

    def start(self):
        environment = dict(os.environ, TERM="dumb")
        environment.pop("PROMPT_COMMAND", None)
        pid, fd = pty.fork()
        if pid == 0:  # the child: become bash, and never run the runtime's code
            try:
                try:
                    os.chdir(self.workdir)
                except OSError:
                    pass
                os.execvpe("bash", ["bash", "--noprofile", "--norc", "--noediting"], environment)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        tty.setraw(fd)
        attrs = termios.tcgetattr(fd)
        attrs[3] &= ~termios.ECHO
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
        token = self._token()
        self._write(
            "stty -echo 2>/dev/null; set -m; PS1=''; PS2=''; PS0=''; unset HISTFILE; printf '\\n%s 0\\n'\n" % token
        )
        # Bash may not run for many seconds on a busy machine; a shell that never
        # answers is an error, never a command started before its set-up was read.
        if self._read_until(token, BASH_START_S, CappedBuffer(DEFAULT_CAP)) is None:
            self.close()
            raise RuntimeError("bash did not start within %gs" % BASH_START_S)

    def _token(self):
        self.counter += 1
        return "__PRORL_%d_%d__" % (os.getpid(), self.counter)

    @property
    def _sentinel_prefix(self):
        return ("\n__PRORL_%d_" % os.getpid()).encode()

    def _without_stale_sentinels(self, pending, token):
        """Drop the sentinel lines of earlier waits that gave up (a set-up or resync
        answered after its patience ran out): they are the runtime's, not the agent's
        output, and must not show up in the next command's."""
        stale = re.compile(rb"\n__PRORL_%d_(\d+)__ -?\d*\n" % os.getpid())
        current = token.encode()
        return stale.sub(lambda m: m.group(0) if current in m.group(0) else b"", pending)

    def _write(self, text):
        data = text.encode("utf-8")
        while data:
            written = os.write(self.fd, data)
            data = data[written:]

    def _read_until(self, token, timeout, buffer):
        """Read until the line `<token> <status>`; returns status, or None on timeout/EOF."""
        marker = ("\n%s " % token).encode()
        deadline = time.monotonic() + timeout
        pending = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                buffer.write(pending)
                return None
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 0.2))
            if not ready:
                # Background jobs may hold the pty open after bash exits: no EOF then.
                if self._exited():
                    buffer.write(pending)
                    raise EOFError("bash exited")
                continue
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                buffer.write(pending)
                raise EOFError("bash exited")
            pending = self._without_stale_sentinels(pending + chunk, token)
            index = pending.find(marker)
            if index >= 0:
                end = pending.find(b"\n", index + len(marker))
                while end < 0:
                    more = os.read(self.fd, 1 << 16)
                    if not more:
                        raise EOFError("bash exited")
                    pending += more
                    end = pending.find(b"\n", index + len(marker))
                buffer.write(pending[:index])
                try:
                    return int(pending[index + len(marker) : end].strip() or b"0")
                except ValueError:
                    return -1
            # Keep back what could be the start of a sentinel line; flush the rest.
            cut = len(pending) - (len(marker) + 16)
            partial = pending.rfind(self._sentinel_prefix)
            if 0 <= partial < cut and pending.find(b"\n", partial + 1) < 0:
                cut = partial
            if cut > 0:
                buffer.write(pending[:cut])
                pending = pending[cut:]

    def _exited(self):
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid:
            self.pid_reaped = True
            self.exit_status = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        return bool(pid)

    def _wait_exited(self, patience):
        """Collect bash's exit status: it closes the terminal a moment before it can be reaped."""
        deadline = time.monotonic() + patience
        while not self._exited() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _interrupt(self):
        try:
            group = os.tcgetpgrp(self.fd)
        except OSError:
            return
        if group <= 0 or group == os.getpgrp():
            return  # no foreground job: nothing to interrupt
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                if group == self.pid:
                    os.kill(self.pid, signal.SIGINT)  # a builtin loop: interrupt bash itself
                else:
                    os.killpg(group, sig)
            except OSError:
                return
            status = self._read_until(self._resync(), INTERRUPT_GRACE_S, CappedBuffer(1024))
            if status is not None:
                return

    def _resync(self):
        token = self._token()
        self._write("\nprintf '\\n%s %%s\\n' \"$?\"\n" % token)
        return token

    def run(self, command, timeout, cap):
        with self.lock:
            if self.pid is None:
                self.start()
            started = time.monotonic()
            buffer = CappedBuffer(cap)
            path = os.path.join(self.scratch, "cmd.sh")
            with open(path, "w") as handle:
                handle.write(command)
                handle.write("\n")
            token = self._token()
            restarted = False
            try:
                self._write(". %s\nprintf '\\n%s %%s\\n' \"$?\"\n" % (path, token))
                status = self._read_until(token, timeout, buffer)
                timed_out = status is None
                if timed_out:
                    self._interrupt()
                    status = 124
            except EOFError:
                # The command ended the shell (e.g. `exit`): start a new one.
                self._wait_exited(1.0)
                status = self.exit_status
                self.close()
                restarted, timed_out = True, False
            text = buffer.text().replace("\r\n", "\n")
            if timed_out:
                text += "\n[command timed out after %gs; its process group was interrupted and killed]" % timeout
            if restarted:
                text += "\n[the shell exited; a new shell will start with the next command]"
            return {
                "output": text,
                "exit_code": status,
                "truncated": buffer.truncated,
                "timed_out": timed_out,
                "duration_s": time.monotonic() - started,
            }

    def close(self):
        if self.pid is not None:
            _kill_session(self.pid)
            if not self.pid_reaped:
                try:
                    os.waitpid(self.pid, 0)
                except OSError:
                    pass
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.pid = self.fd = None
        self.pid_reaped = False


def _kill_session(session_id):
    """SIGKILL every process of a session (bash and the jobs it left running)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


# --- stateful Python -----------------------------------------------------------------


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
                sys.executable, "-u", os.path.abspath(__file__), "python-worker",
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


# --- files and the editor -------------------------------------------------------------


class ToolError(Exception):
    """A mistake the agent can fix; the message tells it how."""


def _resolve(path, workdir):
    if not path:
        raise ToolError("path is empty: give a file path such as /workspace/main.py")
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(workdir, path))


def _read_text(path):
    if not os.path.exists(path):
        raise ToolError("%s does not exist; check the path (use view on a directory to list it)" % path)
    if os.path.isdir(path):
        raise ToolError("%s is a directory; give a file path" % path)
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError("%s is not a UTF-8 text file" % path)


def _write_text(path, text):
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _view_lines(path, first, last, buffer):
    """Write lines first..last (-1: to the end) of a UTF-8 file, numbered as `_numbered` does,
    into `buffer`; return the file's line count. The file is streamed, never held whole, so
    viewing a file of any size costs the buffer's cap in memory and the output is capped."""
    if not os.path.exists(path):
        raise ToolError("%s does not exist; check the path (use view on a directory to list it)" % path)
    if os.path.isdir(path):
        raise ToolError("%s is a directory; give a file path" % path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    state = {"number": 1, "started": False, "held": None, "any": False}

    def start_line(number):
        buffer.write(("%s%6d\t" % ("\n" if state["any"] else "", number)).encode("utf-8"))
        state["any"] = True

    def feed(part, ends_line):
        number = state["number"]
        if first <= number and (last == -1 or number <= last):
            if part or (ends_line and state["started"]):
                if state["held"] is not None:  # an empty line that turned out not to be the last
                    start_line(state["held"])
                    state["held"] = None
                if not state["started"]:
                    start_line(number)
                    state["started"] = True
                buffer.write(part.encode("utf-8", "surrogateescape"))
            elif ends_line:
                if state["held"] is not None:
                    start_line(state["held"])
                state["held"] = number  # shown only if a line follows it in the range
        if ends_line:
            state["number"] += 1
            state["started"] = False

    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(1 << 16)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError:
                raise ToolError("%s is not a UTF-8 text file" % path)
            parts = text.split("\n")
            for part in parts[:-1]:
                feed(part, True)
            if not chunk:
                feed(parts[-1], True)
                return state["number"] - 1
            feed(parts[-1], False)


def _numbered(text, start=1):
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join("%6d\t%s" % (number, line) for number, line in enumerate(lines, start))


def _snippet(text, line, context=4):
    lines = text.split("\n")
    first = max(line - context, 0)
    last = min(line + context + 1, len(lines))
    return _numbered("\n".join(lines[first:last]), first + 1)


class Editor:
    """A str_replace-style file editor with per-file undo."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.history = {}

    def _remember(self, path, previous):
        self.history.setdefault(path, []).append(previous)

    def handle(self, request):
        command = request.get("command")
        path = _resolve(request.get("path", ""), self.workdir)
        handler = getattr(self, "cmd_" + str(command), None)
        if handler is None:
            raise ToolError(
                "unknown editor command %r; use one of: view, create, str_replace, insert, undo" % (command,)
            )
        return handler(path, request)

    def cmd_view(self, path, request):
        if os.path.isdir(path):
            entries = []
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                entries.append(name + ("/" if os.path.isdir(full) else ""))
            return "Contents of %s:\n%s" % (path, "\n".join(entries) or "(empty)")
        first, last = 1, -1
        view_range = request.get("view_range")
        if view_range:
            try:
                first, last = int(view_range[0]), int(view_range[1])
            except (TypeError, ValueError, IndexError):
                raise ToolError("view_range must be two line numbers [first, last]; use -1 as last for the end")
        buffer = CappedBuffer(int(request.get("max_output_bytes") or DEFAULT_CAP))
        count = _view_lines(path, first, last, buffer)
        if not 1 <= first <= (count if last == -1 else last) <= count:
            raise ToolError("view_range %r is outside the file's lines 1-%d" % (view_range, count))
        return buffer

    def cmd_create(self, path, request):
        if "file_text" not in request:
            raise ToolError("create needs file_text: the whole content of the new file")
        if os.path.exists(path):
            raise ToolError("%s already exists; use str_replace to change it, or view to read it" % path)
        _write_text(path, request["file_text"])
        self._remember(path, None)
        return "Created %s" % path

    def cmd_str_replace(self, path, request):
        old = request.get("old_str")
        new = request.get("new_str", "")
        if not old:
            raise ToolError("str_replace needs old_str: the exact text to replace (copy it from view)")
        text = _read_text(path)
        count = text.count(old)
        if count == 0:
            raise ToolError(
                "old_str was not found in %s; it must match exactly, including whitespace and indentation "
                "(view the file to copy it)" % path
            )
        if count > 1:
            lines = [text[:m].count("\n") + 1 for m in _find_all(text, old)]
            raise ToolError(
                "old_str occurs %d times in %s (lines %s); include more surrounding lines so it is unique"
                % (count, path, ", ".join(map(str, lines)))
            )
        self._remember(path, text)
        updated = text.replace(old, new, 1)
        _write_text(path, updated)
        line = updated[: updated.find(new)].count("\n") if new else text[: text.find(old)].count("\n")
        return "Edited %s. The changed region:\n%s" % (path, _snippet(updated, line))

    def cmd_insert(self, path, request):
        if "new_str" not in request:
            raise ToolError("insert needs new_str: the text to insert")
        try:
            after = int(request.get("insert_line"))
        except (TypeError, ValueError):
            raise ToolError("insert needs insert_line: the line number after which to insert (0 for the top)")
        text = _read_text(path)
        lines = text.split("\n")
        if not 0 <= after <= len(lines):
            raise ToolError("insert_line %d is outside 0-%d" % (after, len(lines)))
        self._remember(path, text)
        new_lines = request["new_str"].split("\n")
        updated = "\n".join(lines[:after] + new_lines + lines[after:])
        _write_text(path, updated)
        return "Inserted %d line(s) into %s after line %d:\n%s" % (
            len(new_lines),
            path,
            after,
            _snippet(updated, after),
        )

    def cmd_undo(self, path, request):
        history = self.history.get(path)
        if not history:
            raise ToolError("there is no edit of %s to undo" % path)
        previous = history.pop()
        if previous is None:
            os.remove(path)
            return "Undid the creation of %s (removed it)" % path
        _write_text(path, previous)
        return "Undid the last edit of %s" % path


def _find_all(text, needle):
    start = text.find(needle)
    while start >= 0:
        yield start
        start = text.find(needle, start + 1)


# --- the server -----------------------------------------------------------------------


# --- judging ------------------------------------------------------------------------

JUDGE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prorl_judge.py")
JUDGE_MODES = ("function", "stdio", "swe", "terminal")
MAX_VERDICT = 32 << 20
PR_SET_DUMPABLE = 4


def make_non_dumpable():
    """prctl(PR_SET_DUMPABLE, 0): processes of the same uid (everything the agent and
    the tested code run) can then neither ptrace this one, read its memory, nor open
    its fds (the server's socket, the judge's verdict pipe) through /proc."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except Exception:  # no ctypes or no prctl: keep serving, less protected
        return False


def judge_env():
    """The judge's environment: the basics, and the sandbox's own temporary directory when the
    runtime was given one."""
    env = {
        "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME") or "/tmp",
        "LANG": "C.UTF-8",
    }
    if os.environ.get("TMPDIR"):
        env["TMPDIR"] = os.environ["TMPDIR"]
    return env


def run_judge(mode, spec, timeout, cap):
    """Run the judging harness (prorl_judge.py, trusted, beside this file) on `spec`.

    Started directly: argv with no shell and no pty, isolated Python (-I), its
    own session, a clean environment, the spec on a stdin pipe, its log on a
    stdout pipe (capped), and a dedicated pipe for the verdict that no other
    process gets (close_fds; the harness never passes it on). When `timeout`
    passes, its whole session is killed. The verdict is returned as the text
    the harness wrote there, or None; the server decides what it is worth."""
    if mode not in JUDGE_MODES:
        raise ValueError("unknown judge mode %r" % (mode,))
    started = time.monotonic()
    verdict_r, verdict_w = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", JUDGE_FILE, mode, "--verdict-fd", str(verdict_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(verdict_w,),
            cwd="/",
            env=judge_env(),
            start_new_session=True,
        )
    except BaseException:
        os.close(verdict_r)
        raise
    finally:
        os.close(verdict_w)
    body = json.dumps(spec).encode("utf-8")

    def feed():
        try:
            process.stdin.write(body)
        except OSError:
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    output = CappedBuffer(cap)
    verdict = bytearray()
    verdict_truncated = False
    log_fd = process.stdout.fileno()
    open_fds = [log_fd, verdict_r]
    deadline = started + timeout
    exited_at = None
    timed_out = False
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            timed_out = process.poll() is None
            break
        if exited_at is None and process.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 1.0:
            break  # what the harness left behind may hold the log pipe open
        ready, _, _ = select.select(open_fds, [], [], min(deadline - now, 0.2))
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
            elif fd == log_fd:
                output.write(chunk)
            elif len(verdict) + len(chunk) > MAX_VERDICT:
                verdict_truncated = True
            else:
                verdict += chunk
    _kill_session(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    exit_code = process.wait()
    writer.join(5)
    process.stdout.close()
    os.close(verdict_r)
    text = output.text()
    if timed_out:
        text += "\n[judging timed out after %gs; its processes were killed]" % timeout
    return {
        "output": text,
        "truncated": output.truncated,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "verdict": None if verdict_truncated or not verdict else bytes(verdict).decode("utf-8", "replace"),
        "verdict_truncated": verdict_truncated,
        "duration_s": time.monotonic() - started,
    }


# --- reset between jobs ---------------------------------------------------------------
#
# `reset` makes a used sandbox fit for the next job without a new container. It
# runs in this (trusted) process: every other process but the container's init is
# killed first, so nothing the previous job started can undo what follows; then
# its IPC objects, keyrings and POSIX message queues are removed, and each writable
# path the server names is emptied and refilled from the image's read-only copy
# ("lower"), its mode and extended attributes restored. The shell, the Python
# worker and the editor start afresh, so environment, cwd, names and undo history
# are the new job's. The answer reports what is left; the server checks the rest
# from outside (sandbox/podman/reset_check.py) and retires a sandbox it cannot
# prove clean.

SYSVIPC = {"msg": "msgctl", "sem": "semctl", "shm": "shmctl"}
IPC_RMID = 0
KEYCTL_CLEAR = 7
KEY_SPEC_USER_KEYRING = -4
KEY_SPEC_USER_SESSION_KEYRING = -5
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 311, "s390x": 280}


def _other_pids():
    """Pids in this PID namespace other than init (1) and this process, with their state."""
    me = os.getpid()
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, me):
            try:
                with open("/proc/%s/stat" % entry) as handle:
                    found[int(entry)] = handle.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                pass  # gone meanwhile
    return found


def _reap_children():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _descendants():
    """Pids of this process's descendants (by /proc parent links), with their state."""
    parents, states = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
            states[int(entry)] = fields[0]
    found, todo = {}, [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found[child] = states[child]
                todo.append(child)
    return found


def reset_kill_all(deadline, in_own_namespace=True):
    """SIGKILL every process but init and this one (kill(-1) spares exactly those, and
    reaches nested PID namespaces too) until none is left; forks racing the kill are
    caught by the next round. Outside a sandbox's own namespace (`in_own_namespace`
    False: a child subreaper on a test host) only this process's descendants are
    killed. Returns the pids still there at the deadline."""
    while True:
        if in_own_namespace:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass  # ESRCH: nothing left to signal
        else:
            for pid in _descendants():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        _reap_children()
        left = _other_pids() if in_own_namespace else _descendants()
        if not left or time.monotonic() > deadline:
            return sorted(left)
        time.sleep(0.002 if all(state == "Z" for state in left.values()) else 0.0005)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def reset_sysv_ipc():
    """Remove every SysV message queue, semaphore set and shared memory segment of this
    IPC namespace; returns those that remain, as "kind:id"."""
    libc = _libc()
    left = []
    for kind, call in sorted(SYSVIPC.items()):
        for ident in _sysv_ids(kind):
            if kind == "sem":
                libc.semctl(ident, 0, IPC_RMID)
            else:
                getattr(libc, call)(ident, IPC_RMID, None)
        left += ["%s:%d" % (kind, ident) for ident in _sysv_ids(kind)]
    return left


def _sysv_ids(kind):
    try:
        with open("/proc/sysvipc/%s" % kind) as handle:
            lines = handle.read().splitlines()[1:]
    except OSError:
        return []
    return [int(line.split()[1]) for line in lines if line.split()]


def reset_keyrings():
    """Clear the user's keyrings (shared by every process of the uid); returns the keys
    still visible in /proc/keys other than those two, now empty."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is not None:
        libc = _libc()
        for keyring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
            libc.syscall(number, KEYCTL_CLEAR, keyring)
    try:
        with open("/proc/keys") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    return [line for line in lines if not re.search(r" _uid(_ses)?\.\d+: empty$", line)]


def _make_removable(top):
    """Give the owner write and search rights on every directory below `top` (the job may
    have taken them away), so that its entries can be deleted."""
    for root, dirs, _ in os.walk(top):
        for name in dirs:
            path = os.path.join(root, name)
            try:
                if not os.path.islink(path):
                    os.chmod(path, 0o700)
            except OSError:
                pass


def _clear_xattrs(path):
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return
    for name in names:
        try:
            os.removexattr(path, name, follow_symlinks=False)
        except OSError:
            pass


def reset_tree(path, lower, mode):
    """Empty the mount `path` and refill it from `lower` (None: leave it empty), then give
    its top the mode `mode` and no extended attributes. Raises OSError when it cannot."""
    owned = os.lstat(path).st_uid == os.geteuid()  # a top owned by root: the job could not change it either
    if owned:
        os.chmod(path, 0o700)
        _clear_xattrs(path)
    _make_removable(path)
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)
    if lower is not None and os.path.isdir(lower):
        for name in os.listdir(lower):
            source, target = os.path.join(lower, name), os.path.join(path, name)
            if os.path.isdir(source) and not os.path.islink(source):
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy2(source, target, follow_symlinks=False)
    if owned:
        os.chmod(path, mode)


def _serving_under_own_init():
    """Whether this process is the runtime forked by `serve --init` as its PID namespace's
    init: kill(-1) anywhere else would reach far more than one sandbox."""
    try:
        with open("/proc/1/cmdline", "rb") as handle:
            init = handle.read().split(b"\0")
    except OSError:
        return False
    return (
        os.getppid() == 1
        and b"serve" in init
        and b"--init" in init
        and any(part.endswith(os.path.basename(__file__).encode()) for part in init)
    )


def _is_subreaper():
    """PR_GET_CHILD_SUBREAPER: every descendant stays in this process's tree."""
    import ctypes

    value = ctypes.c_int(0)
    return _libc().prctl(37, ctypes.byref(value), 0, 0, 0) == 0 and value.value == 1


def reset_runtime(runtime, request):
    """The `reset` op (see the section's comment). Request: "paths", a list of
    {"path", "lower" (or null), "mode"}; "timeout_s". Answer: "processes" (pids left),
    "ipc" (SysV objects left), "keys" (keys left), "failed" ({path: error})."""
    own = _serving_under_own_init()
    if not own and not _is_subreaper():
        raise RuntimeError("reset runs only in a sandbox whose init is this runtime (serve --init)")
    deadline = time.monotonic() + float(request.get("timeout_s") or 30.0)
    left = reset_kill_all(deadline, own)  # ends any call still running, so its lock comes free
    scratch = [runtime.bash.scratch, runtime.python.scratch]
    with runtime.bash.lock, runtime.python.lock:
        runtime.bash.close()
        runtime.python._kill()
        left = reset_kill_all(deadline, own)
        bash, python = BashSession(runtime.workdir), PythonSession(runtime.workdir)
        for session, path in zip((bash, python), scratch):
            os.rmdir(session.scratch)
            session.scratch = path
        runtime.bash, runtime.python, runtime.editor = bash, python, Editor(runtime.workdir)
    failed = {}
    if not left:  # with a process left, nothing below could be trusted to stay done
        for item in request.get("paths") or []:
            try:
                reset_tree(item["path"], item.get("lower"), int(item["mode"]))
            except (OSError, shutil.Error) as exc:
                failed[item["path"]] = "%s: %s" % (type(exc).__name__, exc)
        for path in scratch:
            try:
                os.mkdir(path, 0o700)
            except OSError as exc:
                failed[path] = "%s: %s" % (type(exc).__name__, exc)
    # IPC objects and keys are the namespace's, or on a test host everyone's: left alone there.
    return {
        "processes": left,
        "ipc": reset_sysv_ipc() if own else [],
        "keys": reset_keyrings() if own else [],
        "failed": failed,
    }


class Runtime:
    def __init__(self, workdir):
        self.workdir = workdir
        self.bash = BashSession(workdir)
        self.python = PythonSession(workdir)
        self.editor = Editor(workdir)
        self.started = time.time()

    def dispatch(self, request):
        op = request.get("op")
        cap = int(request.get("max_output_bytes") or DEFAULT_CAP)
        timeout = float(request.get("timeout_s") or 30.0)
        if op == "health":
            return {"pid": os.getpid(), "python": sys.version.split()[0], "uptime_s": time.time() - self.started}
        if op == "bash":
            return self.bash.run(request["command"], timeout, cap)
        if op == "python":
            return self.python.run(request["code"], timeout, cap)
        if op == "edit":
            try:
                result, is_error = self.editor.handle(request), False
            except (ToolError, OSError) as exc:
                result, is_error = "Error: %s" % exc, True
            buffer = result if isinstance(result, CappedBuffer) else capped(result, cap)
            return {"output": buffer.text(), "is_error": is_error, "truncated": buffer.truncated}
        if op == "read_file":
            path = _resolve(request.get("path", ""), self.workdir)
            with open(path, "rb") as handle:
                data = handle.read(int(request.get("max_bytes") or (1 << 30)) + 1)
            limit = int(request.get("max_bytes") or (1 << 30))
            return {"content_b64": base64.b64encode(data[:limit]).decode(), "truncated": len(data) > limit}
        if op == "write_file":
            path = _resolve(request.get("path", ""), self.workdir)
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(base64.b64decode(request["content_b64"]))
            if request.get("mode") is not None:
                os.chmod(path, int(request["mode"]))
            return {"path": path}
        if op == "reset":
            return reset_runtime(self, request)
        if op == "judge":
            return run_judge(request["mode"], request.get("spec") or {}, timeout, cap)
        if op == "list_dir":
            path = _resolve(request.get("path", "."), self.workdir)
            entries = []
            for name in sorted(os.listdir(path)):
                info = os.lstat(os.path.join(path, name))
                kind = "dir" if os.path.isdir(os.path.join(path, name)) else "file"
                entries.append({"name": name, "type": kind, "size": info.st_size})
            return {"path": path, "entries": entries}
        raise ValueError("unknown op %r" % (op,))


# --- the HTTP gateway -------------------------------------------------------------------
#
# `gateway` (on a connection of its own) makes the runtime listen for HTTP on the
# sandbox's own loopback and relay each request to the server on that connection,
# which becomes a relay channel: frames {"gw": k, "type": ...} both ways, k naming one
# exchange (one HTTP request and its response).
#   runtime -> server: "request" (method, path, headers [[name, value], ...], body_b64);
#                      "cancel" (the program went away before the response ended).
#   server -> runtime: "response" (status, headers), any number of "chunk" (data_b64),
#                      then "end" ("error" set: the body broke off, the program's
#                      connection is cut instead of ending the body properly).
# Either side closing the connection closes the listener (then the connection) and
# every connection the program had open to it.

GATEWAY_HOSTS = ("127.0.0.1", "::1")
GATEWAY_MAX_BODY = 64 << 20
"""A larger request body is refused with 413 (the server may ask for less: `max_body`), from its
declared length before any of it is read, or as soon as a chunked body grows past it."""
GATEWAY_MAX_LINE = 65536
GATEWAY_MAX_HEADERS = 100
GATEWAY_MAX_HEADER_BYTES = 256 << 10
GATEWAY_MAX_BUFFERED = 64 << 20
"""Response bytes (base64) received for one exchange and not yet written to the program:
a program that reads slower than the server sends past this has its exchange cut."""
GATEWAY_IDLE_S = 300.0
GATEWAY_POLL_S = 0.25
"""While a response is awaited, the program's connection is looked at this often (EOF: cancel)."""
GATEWAY_FLUSH_BYTES = 1 << 20
"""Response bytes gathered before a write even when more have arrived."""
GATEWAY_BODY_SLICE = 3 << 20  # a multiple of 3: base64 of the slices joined is that of the whole
HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length"]
)
# Matched with fullmatch (`$` would let a trailing newline through).
HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
HTTP_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
DIGITS = re.compile(r"[0-9]{1,18}")
UNSAFE_TEXT = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class HttpError(Exception):
    """A request the gateway refuses: answered with `status`, then the connection is closed;
    in the error format of the request's API (`api`: see _api_of)."""

    def __init__(self, status, message, api="openai"):
        Exception.__init__(self, message)
        self.status = status
        self.message = message
        self.api = api


ANTHROPIC_PATHS = ("/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens")
# As the server's Gemini routes (gateway/google_generate.py ROUTE and LIST).
GOOGLE_PATH = re.compile(r"/(?:v1beta|v1alpha|v1)?/?models/[^/:]+:[A-Za-z]+|/(?:v1beta|v1alpha)/models(?:/[^/:]+)?")


def _api_of(path):
    """Whose error format a request's path speaks: "anthropic", "google" or "openai"."""
    path = (path or "").split("?", 1)[0].rstrip("/")
    if path in ANTHROPIC_PATHS:
        return "anthropic"
    if GOOGLE_PATH.fullmatch(path):
        return "google"
    return "openai"


def _too_large(max_body, path):
    message = (
        "the request body is larger than %d bytes, the most this gateway takes per call "
        "(setting gateway.max_request_bytes): send a shorter conversation" % max_body
    )
    return HttpError(413, message, _api_of(path))


def _cloexec(fd):
    fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)


def _reason(status):
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _readable(fd, timeout_ms):
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def _peer_gone(sock):
    """Whether the program closed (or reset) its end of `sock`; data it sent is left unread."""
    try:
        if not _readable(sock.fileno(), 0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _error_body(status, message, api):
    """The refusal in the error format of the request's API, as the server's gateway writes it."""
    if api == "anthropic":
        kind = "request_too_large" if status == 413 else "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api == "google":
        name = "UNAVAILABLE" if status == 503 else "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"
        return {"error": {"code": status, "message": message, "status": name}}
    if status == 413:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        return {"error": error}
    return {"error": {"message": message, "type": "gateway_error"}}


def _send_error(sock, status, message, api="openai"):
    body = json.dumps(_error_body(status, message, api)).encode("utf-8")
    head = "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (
        status,
        _reason(status),
        len(body),
    )
    try:
        sock.sendall(head.encode("latin-1") + body)
    except OSError:
        pass


def _read_line(reader, what):
    line = reader.readline(GATEWAY_MAX_LINE + 1)
    if len(line) > GATEWAY_MAX_LINE:
        raise HttpError(431 if what == "header" else 414 if what == "request line" else 400, "%s too long" % what)
    if not line.endswith(b"\n"):
        raise HttpError(400, "incomplete %s" % what)
    return line


def _read_chunked(reader, max_body, path):
    body = bytearray()
    while True:
        line = _read_line(reader, "chunk size")
        size_text = line.split(b";", 1)[0].strip()
        if not HEX_SIZE.fullmatch(size_text):
            raise HttpError(400, "malformed chunk size")
        size = int(size_text, 16)
        if size == 0:
            break
        if len(body) + size > max_body:
            raise _too_large(max_body, path)
        data = reader.read(size)
        if data is None or len(data) < size:
            raise HttpError(400, "incomplete chunked body")
        body += data
        if _read_line(reader, "chunk") not in (b"\r\n", b"\n"):
            raise HttpError(400, "malformed chunk")
    for _ in range(GATEWAY_MAX_HEADERS + 1):  # trailers: read and dropped
        if _read_line(reader, "trailer") in (b"\r\n", b"\n"):
            return body
    raise HttpError(431, "too many trailers")


def _request_target(target):
    if not target or UNSAFE_TEXT.search(target) or " " in target or "\t" in target:
        raise HttpError(400, "malformed request target")
    if target.startswith("/") or target == "*":
        return target
    scheme, sep, rest = target.partition("://")
    if sep and scheme.lower() in ("http", "https"):  # absolute form: keep the path and query
        cut = min([i for i in (rest.find("/"), rest.find("?")) if i >= 0] or [len(rest)])
        path = rest[cut:]
        return path if path.startswith("/") else "/" + path
    raise HttpError(400, "malformed request target")


def read_http_request(reader, sock, max_body=GATEWAY_MAX_BODY):
    """One HTTP/1.x request from `reader` (the program's connection `sock`): (method, target,
    version, headers [[name, value], ...], body, keep_alive), or None at a clean EOF. A
    chunked body is returned whole, its headers then saying Content-Length instead. A body
    over `max_body` is refused (413) before it is read."""
    line = reader.readline(GATEWAY_MAX_LINE + 1)
    for _ in range(8):  # empty lines before a request are tolerated
        if line not in (b"\r\n", b"\n"):
            break
        line = reader.readline(GATEWAY_MAX_LINE + 1)
    if not line:
        return None
    if len(line) > GATEWAY_MAX_LINE:
        raise HttpError(414, "request line too long")
    if not line.endswith(b"\n"):
        raise HttpError(400, "incomplete request line")
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not HTTP_TOKEN.fullmatch(method):
        raise HttpError(400, "malformed method")
    if not HTTP_VERSION.fullmatch(version):
        raise HttpError(400, "malformed HTTP version")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    path = _request_target(target)
    try:
        return _read_rest(reader, sock, max_body, method, path, version)
    except HttpError as exc:  # refused in the format of the API the path names
        exc.api = _api_of(path)
        raise


def _read_rest(reader, sock, max_body, method, path, version):
    """The headers and body of a request whose request line was read (see read_http_request)."""
    headers = []
    total = 0
    while True:
        line = _read_line(reader, "header")
        total += len(line)
        if total > GATEWAY_MAX_HEADER_BYTES:
            raise HttpError(431, "headers too large")
        if line in (b"\r\n", b"\n"):
            break
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "folded header lines are not accepted")
        name, sep, value = line.decode("latin-1").rstrip("\r\n").partition(":")
        value = value.strip(" \t")
        if not sep or not HTTP_TOKEN.fullmatch(name) or UNSAFE_TEXT.search(value):
            raise HttpError(400, "malformed header")
        headers.append([name, value])
        if len(headers) > GATEWAY_MAX_HEADERS:
            raise HttpError(431, "too many headers")

    def values(wanted):
        return [v.strip().lower() for n, vs in headers if n.lower() == wanted for v in vs.split(",") if v.strip()]

    keep = version == "HTTP/1.1" and "close" not in values("connection")
    codings = values("transfer-encoding")
    if codings and codings != ["chunked"]:
        raise HttpError(501, "only the chunked transfer-encoding is served")
    length = 0
    if not codings and values("content-length"):
        lengths = set(values("content-length"))
        if len(lengths) != 1 or not DIGITS.fullmatch(next(iter(lengths))):
            raise HttpError(400, "malformed content-length")
        length = int(next(iter(lengths)))
        if length > max_body:
            raise _too_large(max_body, path)
    expect = values("expect")
    if expect:
        if expect != ["100-continue"]:
            raise HttpError(417, "only Expect: 100-continue is served")
        if version == "HTTP/1.1":
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if codings:
        body = _read_chunked(reader, max_body, path)
        headers = [h for h in headers if h[0].lower() not in ("transfer-encoding", "content-length")]
        headers.append(["Content-Length", str(len(body))])
    else:
        body = reader.read(length) if length else b""
        if body is None or len(body) < length:
            raise HttpError(400, "incomplete body")
    return method, path, version, headers, body, keep


class GatewayExchange:
    """The frames the server sent for one exchange, waiting for its program's connection."""

    def __init__(self):
        self.cond = threading.Condition()
        self.frames = collections.deque()
        self.buffered = 0

    def put(self, frame, size=0):
        """Queue `frame`; False (and the exchange cut) when too much is waiting."""
        with self.cond:
            self.buffered += size
            if self.buffered > GATEWAY_MAX_BUFFERED:
                self.frames.clear()
                self.frames.append(({"type": "overflow"}, 0))
                self.cond.notify()
                return False
            self.frames.append((frame, size))
            self.cond.notify()
            return True

    def get(self, timeout):
        with self.cond:
            if not self.frames:
                self.cond.wait(timeout)
            if not self.frames:
                return None
            frame, size = self.frames.popleft()
            self.buffered -= size
            return frame


class Gateway:
    """A loopback HTTP listener relaying to the server over `conn` (see above).

    Threads: the connection's own (read_loop: frames from the server), one accepting,
    one per program connection. Every fd it opens is close-on-exec, so nothing the
    agent starts inherits them."""

    def __init__(self, conn, send_lock, max_body=GATEWAY_MAX_BODY):
        self.conn = conn
        self.send_lock = send_lock
        self.max_body = max_body
        self.lock = threading.Lock()
        self.exchanges = {}
        self.counter = 0
        self.clients = set()
        self.listeners = []
        self.closed = False
        self.acceptor = None
        self.wake_r, self.wake_w = os.pipe()
        _cloexec(self.wake_r)
        _cloexec(self.wake_w)

    # --- listening

    def bind(self, port):
        """Listen on 127.0.0.1:port (0: any free port), and on [::1] at the same port when
        there is IPv6; returns (port, hosts)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((GATEWAY_HOSTS[0], port))
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        self.listeners.append(listener)
        bound = listener.getsockname()[1]
        hosts = [GATEWAY_HOSTS[0]]
        try:
            listener6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            try:
                listener6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                listener6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener6.bind((GATEWAY_HOSTS[1], bound))
                listener6.listen(128)
            except BaseException:
                listener6.close()
                raise
            self.listeners.append(listener6)
            hosts.append(GATEWAY_HOSTS[1])
        except (OSError, AttributeError):
            pass  # no IPv6 here, or its port is taken: IPv4 only
        for item in self.listeners:
            _cloexec(item.fileno())
            item.setblocking(False)  # accept never blocks the loop that also waits for close
        return bound, hosts

    def accept_loop(self):
        poller = select.poll()
        for item in self.listeners + [self.wake_r]:
            poller.register(item, select.POLLIN)
        by_fd = dict((item.fileno(), item) for item in self.listeners)
        try:
            while True:
                try:
                    events = poller.poll()
                except InterruptedError:
                    continue
                for fd, _ in events:
                    if fd == self.wake_r:
                        return
                    try:
                        client, _ = by_fd[fd].accept()
                    except BlockingIOError:  # aborted before it was accepted
                        continue
                    except OSError:  # out of fds: breathe, go on
                        time.sleep(0.05)
                        continue
                    _cloexec(client.fileno())
                    try:
                        threading.Thread(target=self.serve_client, args=(client,), daemon=True).start()
                    except RuntimeError:  # no thread to be had: refuse this connection
                        client.close()
        finally:
            for item in self.listeners:
                item.close()

    # --- frames to the server

    def send(self, message, body=None):
        """One frame; with `body`, it is base64-encoded into the frame's body_b64 in slices,
        never all at once in memory. Nothing is sent once the gateway is closed."""
        if body is None:
            data, parts = encode_frame(message), ()
        else:
            text = json.dumps(message)
            head = (text[:-1] + (", " if len(text) > 2 else "") + '"body_b64": "').encode("utf-8")
            size = len(head) + 4 * ((len(body) + 2) // 3) + 2
            data = HEADER.pack(size) + head
            parts = range(0, len(body), GATEWAY_BODY_SLICE)
        with self.send_lock:
            if self.closed:
                return
            try:
                self.conn.sendall(data)
                if body is not None:
                    view = memoryview(body)
                    for start in parts:
                        self.conn.sendall(base64.b64encode(view[start : start + GATEWAY_BODY_SLICE]))
                    self.conn.sendall(b'"}')
            except OSError:
                pass

    def cancel(self, number):
        self.forget(number)
        self.send({"gw": number, "type": "cancel"})

    def forget(self, number):
        with self.lock:
            self.exchanges.pop(number, None)

    # --- frames from the server

    def read_loop(self):
        """Route the server's frames to their exchanges until it closes the connection."""
        try:
            while True:
                frame = read_frame(self.conn)
                if frame is None:
                    return
                if not isinstance(frame, dict):
                    continue
                number = frame.get("gw")
                with self.lock:
                    exchange = self.exchanges.get(number)
                if exchange is None:
                    continue  # cancelled, or long over
                data = frame.get("data_b64")
                if not exchange.put(frame, len(data) if isinstance(data, str) else 0):
                    self.cancel(number)
        except (OSError, ValueError):
            return

    def close(self):
        """Stop listening (joined: the port is free once this returns), cut every program
        connection and exchange, send nothing more."""
        with self.send_lock:
            with self.lock:
                self.closed = True
                exchanges = list(self.exchanges.values())
                self.exchanges.clear()
                clients = list(self.clients)
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass
        if self.acceptor is not None:
            self.acceptor.join()
        else:
            for item in self.listeners:
                item.close()
        for exchange in exchanges:
            exchange.put({"type": "closed"})
        for client in clients:
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        os.close(self.wake_r)
        os.close(self.wake_w)

    # --- the program's connections

    def serve_client(self, sock):
        with self.lock:
            if self.closed:
                sock.close()
                return
            self.clients.add(sock)
        reader = None
        try:
            sock.settimeout(GATEWAY_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each write goes out at once
            reader = sock.makefile("rb")
            while self.serve_request(sock, reader):
                pass
            if not self.closed:  # let what the program still sends drain, so it reads our answer
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(1.0)
                for _ in range(64):
                    if not sock.recv(1 << 16):
                        break
        except Exception:  # noqa: BLE001 - a program's connection never takes the runtime down
            pass
        finally:
            with self.lock:
                self.clients.discard(sock)
            try:
                if reader is not None:
                    reader.close()
            except Exception:
                pass
            sock.close()

    def serve_request(self, sock, reader):
        """Serve one request; whether the connection stays open for the next."""
        try:
            request = read_http_request(reader, sock, self.max_body)
        except HttpError as exc:
            _send_error(sock, exc.status, exc.message, exc.api)
            return False
        except (OSError, ValueError):  # reset, timed out, closed under it
            return False
        if request is None:
            return False
        method, path, version, headers, body, keep = request
        with self.lock:
            if self.closed:
                exchange = None
            else:
                self.counter += 1
                number = self.counter
                exchange = self.exchanges[number] = GatewayExchange()
        if exchange is None:
            _send_error(sock, 503, "the gateway is closed", _api_of(path))
            return False
        try:
            message = {"gw": number, "type": "request", "method": method, "path": path, "headers": headers}
            self.send(message, body)
            del request, body
            return self.relay_response(sock, exchange, number, method, version, keep, _api_of(path))
        finally:
            self.forget(number)

    def next_frame(self, sock, exchange, number):
        """The server's next frame for this exchange; None (and the server told to cancel)
        once the program has gone."""
        while True:
            frame = exchange.get(GATEWAY_POLL_S)
            if frame is not None:
                return frame
            if _peer_gone(sock):
                self.cancel(number)
                return None

    def relay_response(self, sock, exchange, number, method, version, keep, api="openai"):
        frame = self.next_frame(sock, exchange, number)
        if frame is None:
            return False
        kind = frame.get("type")
        status = frame.get("status")
        if kind != "response" or not isinstance(status, int) or not 200 <= status <= 599:
            if kind == "response" or kind not in ("closed", "overflow"):
                self.cancel(number)
                _send_error(sock, 502, "the server sent a malformed response", api)
            return False
        lines = []
        lengths = set()
        for pair in frame.get("headers") or []:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                continue
            name, value = str(pair[0]), str(pair[1])
            if not HTTP_TOKEN.fullmatch(name):
                continue
            if name.lower() == "content-length":
                lengths.add(value.strip())
            if name.lower() not in HOP_BY_HOP:
                lines.append("%s: %s\r\n" % (name, UNSAFE_TEXT.sub(" ", value)))
        length = int(next(iter(lengths))) if len(lengths) == 1 and DIGITS.fullmatch(next(iter(lengths))) else None
        if method == "HEAD" or status in (204, 304):
            mode = "none"
        elif length is not None:
            mode = "length"
        elif version == "HTTP/1.1":
            mode = "chunked"
        else:
            mode, keep = "close", False
        if length is not None and mode in ("length", "none") and status not in (204, 304):
            lines.append("Content-Length: %d\r\n" % length)
        if mode == "chunked":
            lines.append("Transfer-Encoding: chunked\r\n")
        if not keep:
            lines.append("Connection: close\r\n")
        head = "HTTP/1.1 %d %s\r\n%s\r\n" % (status, _reason(status), "".join(lines))
        ended = False
        # What is written is gathered while more of it has already arrived, and sent as soon
        # as nothing more is there: a piece never waits for the next one, and a whole
        # response that came at once goes out in one write.
        pending = [head.encode("latin-1", "replace")]
        try:
            if mode == "none":  # no body to send: the server need not produce it
                sock.sendall(pending[0])
                self.cancel(number)
                return keep
            written = 0
            while True:
                frame = exchange.get(0) if pending else None
                if frame is None:
                    if pending:
                        sock.sendall(b"".join(pending))
                        pending = []
                    frame = self.next_frame(sock, exchange, number)
                    if frame is None:
                        return False
                kind = frame.get("type")
                if kind == "chunk":
                    data = base64.b64decode(frame.get("data_b64") or "")
                    if mode == "length":
                        data = data[: length - written]
                    if data:
                        pending.append(b"%x\r\n%s\r\n" % (len(data), data) if mode == "chunked" else data)
                        written += len(data)
                    if sum(len(item) for item in pending) >= GATEWAY_FLUSH_BYTES:
                        sock.sendall(b"".join(pending))
                        pending = []
                    continue
                ended = True
                if kind != "end" or frame.get("error"):
                    if pending and kind == "end":  # what came before the break, then the cut
                        sock.sendall(b"".join(pending))
                    return False  # the body broke off: cut the connection, the program sees it unfinished
                if mode == "chunked":
                    pending.append(b"0\r\n\r\n")
                sock.sendall(b"".join(pending))
                return keep and (mode != "length" or written == length)
        except (OSError, ValueError, TypeError):
            if not ended:
                self.cancel(number)
            return False


def serve_gateway(conn, send_lock, request):
    """Serve `gateway` on `conn`, which is the relay channel from the answer on, until the
    server closes it; False (the connection stays an ordinary one) when it could not listen."""
    max_body = request.get("max_body")
    if not isinstance(max_body, int) or isinstance(max_body, bool) or not 0 < max_body <= GATEWAY_MAX_BODY:
        max_body = GATEWAY_MAX_BODY
    gateway = Gateway(conn, send_lock, max_body)
    try:
        port, hosts = gateway.bind(int(request.get("port") or 0))
        with send_lock:  # the answer goes out before any request frame
            gateway.acceptor = threading.Thread(target=gateway.accept_loop, daemon=True)
            gateway.acceptor.start()
            conn.sendall(encode_frame({"id": request.get("id"), "ok": True, "port": port, "hosts": hosts}))
    except Exception as exc:
        started = gateway.acceptor is not None and gateway.acceptor.is_alive()
        if not started:
            gateway.acceptor = None
        gateway.close()
        if started:
            return True  # the answer could not be sent: the connection is gone
        reply = {"id": request.get("id"), "ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}
        reply["errno"] = _errno_of(exc)
        with send_lock:
            try:
                conn.sendall(encode_frame(reply))
            except OSError:
                return True
        return False
    try:
        gateway.read_loop()
    finally:
        gateway.close()
    return True


def _errno_of(exc):
    """The errno behind a failure, so the server can tell a sandbox out of pids, memory or
    disk (the agent's doing) from other failures."""
    if isinstance(exc, MemoryError):
        return errno.ENOMEM
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return errno.EAGAIN
    number = getattr(exc, "errno", None)
    return number if isinstance(number, int) else None


def serve_connection(runtime, conn):
    send_lock = threading.Lock()

    def answer(request):
        try:
            result = runtime.dispatch(request)
            reply = dict(result, id=request.get("id"), ok=True)
        except Exception as exc:  # noqa: BLE001 - reported to the server, never fatal here
            reply = {
                "id": request.get("id"),
                "ok": False,
                "error": "%s: %s" % (type(exc).__name__, exc),
                "errno": _errno_of(exc),
            }
        data = encode_frame(reply)
        with send_lock:
            try:
                conn.sendall(data)
            except OSError:
                pass

    try:
        while True:
            request = read_frame(conn)
            if request is None:
                return
            if request.get("op") == "gateway":  # the connection becomes the gateway's relay channel
                if serve_gateway(conn, send_lock, request):
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="prorl_runtime")
    commands = parser.add_subparsers(dest="command")
    serve_parser = commands.add_parser("serve")
    serve_parser.add_argument("--socket", required=True)
    serve_parser.add_argument("--workdir", default=os.getcwd())
    serve_parser.add_argument("--init", action="store_true", help="run as the container's PID 1 (see serve_as_init)")
    worker_parser = commands.add_parser("python-worker")
    worker_parser.add_argument("--fd-in", type=int, required=True)
    worker_parser.add_argument("--fd-out", type=int, required=True)
    worker_parser.add_argument("--fd-ack", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "python-worker":
        python_worker(args.fd_in, args.fd_out, args.fd_ack)
    elif args.command == "serve":
        make_non_dumpable()
        (serve_as_init if args.init else serve)(args.socket, args.workdir)
    else:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
