"""The agent's bash: one persistent shell on a pty, commands delimited by sentinels.

Environment, working folder and shell state carry over from one command to the
next; a command that outlives its timeout is interrupted (then its session killed).
"""

import os
import pty
import re
import select
import signal
import tempfile
import termios
import threading
import time
import tty

from .capped import DEFAULT_CAP, CappedBuffer
from .hygiene import kill_session

INTERRUPT_GRACE_S = 1.0
BASH_START_S = 120.0
"""How long a new bash has to read its set-up line (seconds on a loaded machine)."""


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
            kill_session(self.pid)
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
