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
"""

import argparse
import base64
import codecs
import errno
import fcntl
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import traceback
import tty

HEADER = struct.Struct(">Q")
MAX_FRAME = 1 << 30
DEFAULT_CAP = 64 * 1024
INTERRUPT_GRACE_S = 1.0


# --- framing -----------------------------------------------------------------


def read_exact(sock, size):
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(stream):
    header = read_exact(stream, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError("frame of %d bytes is too large" % size)
    body = read_exact(stream, size)
    return None if body is None else json.loads(body.decode("utf-8"))


def encode_frame(message):
    body = json.dumps(message).encode("utf-8")
    return HEADER.pack(len(body)) + body


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
        self._read_until(token, 10.0, CappedBuffer(DEFAULT_CAP))

    def _token(self):
        self.counter += 1
        return "__PRORL_%d_%d__" % (os.getpid(), self.counter)

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
            pending += chunk
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
            # Keep back what could be the start of the marker; flush the rest.
            keep = len(marker) + 16
            if len(pending) > keep:
                buffer.write(pending[:-keep])
                pending = pending[-keep:]

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


def python_worker(fd_in, fd_out):
    """Child process: executes code in one persistent namespace.

    stdout and stderr (fds 1 and 2, so child processes too) go to a file per
    call, read back by the parent.
    """
    namespace = {"__name__": "__main__"}
    control_in = os.fdopen(fd_in, "rb", buffering=0)
    control_out = os.fdopen(fd_out, "wb", buffering=0)
    while True:
        header = control_in.read(HEADER.size)
        if not header or len(header) < HEADER.size:
            return
        (size,) = HEADER.unpack(header)
        request = json.loads(control_in.read(size).decode("utf-8"))
        is_error = False
        with open(request["output"], "wb") as sink:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                code = compile(request["code"], "<agent>", "exec")
                exec(code, namespace)
            except BaseException as exc:  # noqa: BLE001 - the agent's exception is its output
                is_error = True
                # Show the agent's frames only, not this worker's.
                traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
            finally:
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
        self.process = subprocess.Popen(
            [
                sys.executable, "-u", os.path.abspath(__file__), "python-worker",
                "--fd-in", str(to_child_r), "--fd-out", str(from_child_w),
            ],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            cwd=self.workdir if os.path.isdir(self.workdir) else None,
            start_new_session=True,
        )  # fmt: skip
        os.close(to_child_r)
        os.close(from_child_w)
        self.to_child = to_child_w
        self.from_child = from_child_r

    def _kill(self):
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
            self.process.wait()
            os.close(self.to_child)
            os.close(self.from_child)
        self.process = None

    def _await_reply(self, timeout):
        deadline = time.monotonic() + timeout
        data = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.from_child], [], [], remaining)
            if not ready:
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
            body = json.dumps({"code": code, "output": output_path}).encode("utf-8")
            os.write(self.to_child, HEADER.pack(len(body)) + body)
            timed_out = lost = False
            try:
                reply = self._await_reply(timeout)
                if reply is None:
                    timed_out = True
                    os.killpg(self.process.pid, signal.SIGINT)
                    reply = self._await_reply(INTERRUPT_GRACE_S)
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
            if lost:
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
JUDGE_MODES = ("function", "stdio", "swe")
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
            env={
                "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
                "HOME": os.environ.get("HOME") or "/tmp",
                "LANG": "C.UTF-8",
            },
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
    args = parser.parse_args(argv)
    if args.command == "python-worker":
        python_worker(args.fd_in, args.fd_out)
    elif args.command == "serve":
        make_non_dumpable()
        (serve_as_init if args.init else serve)(args.socket, args.workdir)
    else:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
