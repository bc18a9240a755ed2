"""A bounded pool of killable checker processes: where answer checks a policy can make slow run.

math-verify (sympy) on `\\boxed{9^{9^{8}}}` computes for minutes and takes gigabytes, and
no Python thread can be stopped; run in the server it blocked the event loop, and run in a
thread pool it kept its thread (and the memory) after its job had given up. Here every such
check runs in a separate process (`checker_worker.py`) with a hard memory limit, and:

- slots are handed out in arrival order, one check per slot, so a hostile job holds one
  process for at most `time_limit_s` and the jobs behind it get theirs in turn;
- a check's time runs from when its process takes it (waiting for a slot is not counted);
  past it the process is killed (SIGKILL, not asked) and the slot starts a fresh one for
  the next check;
- the failure is the job's own: `VerificationFailed` is a `PolicyError` (reward 0, kind
  POLICY) with reason `verification_timeout`, `verification_memory` or
  `verification_crashed`.

Checkers are forks of one template process (`checker_zygote.py`) that imported math-verify,
sympy and pint once: a killed checker's replacement is ready in milliseconds, where a new
interpreter re-imported them for seconds of CPU while right answers waited for the slot. The
server kills a checker through a pidfd the template hands over with it (never a pid that may
have been reused); the template reaps its checkers and reports how each ended. The
template starts when first needed, so a server that never checks math or STEM never starts
one. One pool serves a process (`shared_pool`); a server holds it with `hold_shared_pool`
(its `verifier` settings apply) and the last one to let go stops its processes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import select
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_server.config import VerifierSettings
from prorl_server.errors import InfrastructureError, PolicyError
from prorl_server.verifiers.checker_worker import frame

START_TIMEOUT_S = 120.0
"""A checker process that is not ready by then (imports and warm-up) is an infrastructure failure."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_MAX_MESSAGE = 65536


class VerificationFailed(PolicyError):
    """The answer made its own check fail: too slow, too large, or it crashed the checker."""


class CheckerError(InfrastructureError):
    """A checker process could not be started or spoke nonsense."""

    reason = "checker_unavailable"


class _FairSlots:
    """A semaphore that serves waiters strictly in arrival order."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot as it was cancelled: pass it on
                self.release()
            else:
                self._waiters.remove(waiter)
            raise

    def resize(self, delta: int) -> None:
        """More slots at once, or fewer as checks now running end."""
        self._free += delta
        while self._free > 0 and self._waiters:
            self._free -= 1
            self.release()

    def release(self) -> None:
        if self._free < 0:  # shrunk: this slot goes away
            self._free += 1
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    @property
    def waiting(self) -> int:
        return len(self._waiters)


class _Template:
    """The template process (`checker_zygote.py`) that checkers are forked from, and the
    control socket it takes fork requests and reports exits on."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket) -> None:
        self.process = process
        self.control = control
        self.lost = False
        self.forks = 0
        """Checkers forked so far."""
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._forks: dict[int, asyncio.Future[_Forked]] = {}
        self._exits: dict[int, asyncio.Future[int | None]] = {}
        self._numbers = itertools.count()

    @classmethod
    async def start(cls) -> _Template:
        """Started and warmed up (the checks imported); CheckerError if it could not be."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "prorl_server.verifiers.checker_zygote",
                str(theirs.fileno()),
                str(os.getpid()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,  # a library's print goes nowhere
                stderr=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=env,
                cwd="/",
                start_new_session=True,  # a ^C to the server's group is the server's to handle
            )
        except OSError as exc:
            ours.close()
            raise CheckerError(f"the checker template process did not start: {exc}") from None
        finally:
            theirs.close()
        _LIVE_PIDS.add(process.pid)
        ours.setblocking(False)
        template = cls(process, ours)
        template._loop.add_reader(ours.fileno(), template._on_message)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await template._ready
        except (TimeoutError, CheckerError) as exc:
            await template.close()
            raise CheckerError(f"the checker template process could not start: {exc or 'it took too long'}") from None
        except BaseException:  # cancelled while it started: the child watcher reaps it
            template.kill_now()
            raise
        return template

    async def fork(self, memory_mib: int) -> _Forked:
        """A new checker, forked from the template."""
        if self.lost:
            raise CheckerError("the checker template process has ended")
        number = next(self._numbers)
        forked: asyncio.Future[_Forked] = self._loop.create_future()
        self._forks[number] = forked
        try:
            self.control.send(json.dumps({"fork": number, "memory_mib": memory_mib}).encode())
        except OSError as exc:
            del self._forks[number]
            raise CheckerError(f"the checker template process took no request: {exc}") from None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                return await forked  # cancelled: the checker, when it comes, is killed at once
        except TimeoutError:
            raise CheckerError("the checker template process did not fork in time") from None

    def _on_message(self) -> None:
        while not self.lost:
            try:
                data, fds, _, _ = socket.recv_fds(self.control, _MAX_MESSAGE, 2, socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lose()
                return
            self._dispatch(json.loads(data), fds)

    def _dispatch(self, message: dict[str, Any], fds: list[int]) -> None:
        if "ready" in message:
            if message["ready"]:
                self._ready.set_result(None)
            else:
                self._ready.set_exception(CheckerError(str(message.get("error"))))
        elif "forked" in message:
            self.forks += 1
            pid = int(message["pid"])
            exited = self._exits[pid] = self._loop.create_future()
            waiter = self._forks.pop(int(message["forked"]), None)
            channel, pidfd = fds
            if waiter is None or waiter.done():  # its caller gave up: nobody will use it
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(channel)
                os.close(pidfd)
            else:
                waiter.set_result(_Forked(pid, channel, pidfd, exited))
        elif "failed" in message:
            waiter = self._forks.pop(int(message["failed"]), None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(CheckerError(f"the checker template could not fork: {message.get('error')}"))
        elif "exited" in message:
            done = self._exits.pop(int(message["exited"]), None)
            if done is not None and not done.done():
                done.set_result(int(message["status"]))

    def _lose(self) -> None:
        """The template ended (its checkers die with it): whoever waits on it is told."""
        self.lost = True
        self._loop.remove_reader(self.control.fileno())
        self.control.close()
        lost = CheckerError("the checker template process ended")
        waiters: list[asyncio.Future[Any]] = [self._ready, *self._forks.values()]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(lost)
        for exited in self._exits.values():
            if not exited.done():
                exited.set_result(None)  # unknown: its checker was killed with the template
        self._forks.clear()
        self._exits.clear()

    def kill_now(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def close(self) -> None:
        """Close the control socket (the template kills its checkers and exits), and reap it."""
        if not self.lost:
            self._lose()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await self.process.wait()
        except TimeoutError:
            self.kill_now()
            await self.process.wait()
        _LIVE_PIDS.discard(self.process.pid)


@dataclass(frozen=True)
class _Forked:
    pid: int
    channel: int
    pidfd: int
    exited: asyncio.Future[int | None]


class _Checker:
    """One checker process (a fork of the template) and its socket."""

    def __init__(self, forked: _Forked, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pid = forked.pid
        self._pidfd = forked.pidfd
        self._exited = forked.exited
        self._reader = reader
        self._writer = writer
        self.rss_mib = 0.0
        self.template = 0
        """The pid of the template it was forked from, as it says."""

    @classmethod
    async def start(cls, template: _Template, memory_limit_mib: int) -> _Checker:
        forked = await template.fork(memory_limit_mib)
        try:
            reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=forked.channel))
        except BaseException:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(forked.pidfd, signal.SIGKILL)
            os.close(forked.pidfd)
            raise
        checker = cls(forked, reader, writer)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await checker._read()
        except (TimeoutError, OSError, ValueError) as exc:
            await checker.kill()
            raise CheckerError(f"a checker process did not start: {exc or type(exc).__name__}") from None
        except BaseException:  # cancelled while it started: the template reaps it
            checker.kill_now()
            checker._close()
            raise
        if ready is None or not ready.get("ready"):
            code = await checker.kill()
            raise CheckerError(f"a checker process could not start: it exited with status {code}")
        checker.rss_mib = float(ready.get("rss_mib", 0.0))
        checker.template = int(ready.get("template", 0))
        return checker

    async def _read(self) -> dict[str, Any] | None:
        try:
            header = await self._reader.readexactly(4)
            body = await self._reader.readexactly(int.from_bytes(header, "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        value = json.loads(body)
        if not isinstance(value, dict):
            raise ValueError("a checker's reply is not an object")
        return value

    async def send(self, request: dict[str, Any]) -> bool:
        """False when the process is gone (it cannot take the request)."""
        if self._writer.is_closing():
            return False
        try:
            self._writer.write(frame(request))
            await self._writer.drain()
        except ConnectionError:
            return False
        return True

    async def reply(self) -> dict[str, Any] | None:
        """The reply to the request sent; None when the process ended without one."""
        reply = await self._read()
        if reply is not None and "rss_mib" in reply:
            self.rss_mib = float(reply["rss_mib"])
        return reply

    def kill_now(self) -> None:
        """SIGKILL at once, through its pidfd (synchronous: safe in a cancelled task); `kill`
        also waits for the template to reap it."""
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def kill(self) -> int | None:
        """Its exit status (as `Popen.returncode`); None when its template ended with it."""
        self.kill_now()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                code = await asyncio.shield(self._exited)
        except TimeoutError:
            code = None
        self._close()
        return code

    def _close(self) -> None:
        self._writer.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    @property
    def alive(self) -> bool:
        if self._exited.done() or self._pidfd < 0:
            return False
        return not select.select([self._pidfd], [], [], 0)[0]  # a pidfd reads ready once it exited


class CheckerPool:
    """At most `settings.processes` checker processes; `check` runs one check in one of them."""

    def __init__(self, settings: VerifierSettings | None = None) -> None:
        self.settings = settings or VerifierSettings()
        self._slots = _FairSlots(self.settings.processes)
        self._idle: list[_Checker] = []
        self._reaping: set[asyncio.Task[int | None]] = set()
        self._closed = False
        self._template: _Template | None = None
        self._template_lock = asyncio.Lock()
        self.templates_started = 0
        """Template processes started (each imports the checks once); a killed checker's
        replacement is a fork and starts none."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.killed = 0
        """Processes killed mid-check: past its time or memory, crashed, or its job cancelled."""

    def reconfigure(self, settings: VerifierSettings) -> None:
        """New limits: the time limit from the next check on, the memory limit from the next
        process on (idle ones are retired), the number of processes as checks end."""
        if settings == self.settings:
            return
        self._slots.resize(settings.processes - self.settings.processes)
        if settings.memory_limit_mib != self.settings.memory_limit_mib:
            idle, self._idle = self._idle, []
            for checker in idle:
                self._discard(checker)
        self.settings = settings

    @property
    def waiting(self) -> int:
        """Checks waiting for a slot."""
        return self._slots.waiting

    @property
    def pids(self) -> list[int]:
        return [checker.pid for checker in self._idle]

    @property
    def template_pid(self) -> int | None:
        """The template process checkers are forked from (None before the first check)."""
        return None if self._template is None else self._template.process.pid

    @property
    def forks(self) -> int:
        """Checkers forked by the current template."""
        return 0 if self._template is None else self._template.forks

    async def check(self, name: str, args: dict[str, Any], *, what: str = "the answer") -> Any:
        """The named check's result on `args`; `VerificationFailed` if the check went past its
        limits, `InfrastructureError` if no checker process could be had or a check had a bug."""
        if self._closed:
            raise CheckerError("the server is stopping: no checker process is left")
        self.loop = self.loop or asyncio.get_running_loop()
        await self._slots.acquire()
        try:
            request = {"check": name, "args": args, "time_limit_s": self.settings.time_limit_s}
            checker = await self._checker()
            if not await self._hand(checker, request):
                self._discard(checker)  # it died idle: not this answer's doing, a fresh one checks it
                checker = await self._fresh()
                if not await self._hand(checker, request):
                    self._discard(checker)
                    raise CheckerError("a fresh checker process did not take its check")
            return await self._run(checker, name, what)
        finally:
            self._slots.release()

    async def _checker(self) -> _Checker:
        """An idle process that is still alive, else a fresh one."""
        while self._idle:
            checker = self._idle.pop()
            if checker.alive:
                return checker
            self._discard(checker)
        return await self._fresh()

    async def _fresh(self) -> _Checker:
        """A new checker, forked from the template (started first if there is none, or it ended)."""
        for attempt in range(2):
            async with self._template_lock:
                if self._template is None or self._template.lost:
                    if self._closed:
                        raise CheckerError("the server is stopping: no checker process is left")
                    if self._template is not None:
                        await self._template.close()
                    self._template = await _Template.start()
                    self.templates_started += 1
                template = self._template
            try:
                return await _Checker.start(template, self.settings.memory_limit_mib)
            except CheckerError:
                if attempt or not template.lost:
                    raise
        raise AssertionError("unreachable")

    async def _hand(self, checker: _Checker, request: dict[str, Any]) -> bool:
        """Send `request` and wait for the process's receipt; False when it ended first (it was
        dead or died before reading: whatever killed it was not this answer)."""
        if not await checker.send(request):
            return False
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                receipt = await checker.reply()
        except TimeoutError:
            return False
        except BaseException:
            self._discard(checker, killed=True)
            raise
        return receipt is not None and bool(receipt.get("received"))

    async def _run(self, checker: _Checker, name: str, what: str) -> Any:
        """The reply to the check `checker` was sent; it goes back to the idle list or is killed."""
        limit = self.settings.time_limit_s
        try:
            async with asyncio.timeout(limit):
                reply = await checker.reply()
        except TimeoutError:
            self._discard(checker, killed=True)
            raise VerificationFailed(
                f"checking {what} took longer than {limit:g}s (verifier.time_limit_s): its checker process was killed",
                reason="verification_timeout",
            ) from None
        except BaseException:  # cancelled (or a broken pipe) mid-check: the process may still be computing
            self._discard(checker, killed=True)
            raise
        error = None if reply is None else reply.get("error")
        if reply is None or error == "memory":
            self.killed += 1
            code = await checker.kill()
            if reply is None and code is None:
                raise CheckerError(f"the checker template process ended while it checked {what}")
            if reply is not None:
                raise VerificationFailed(
                    f"checking {what} needed more than {self.settings.memory_limit_mib} MiB "
                    "(verifier.memory_limit_mib)",
                    reason="verification_memory",
                )
            if code == -signal.SIGXCPU:
                raise VerificationFailed(
                    f"checking {what} used more than twice its {limit:g}s in CPU time", reason="verification_timeout"
                )
            raise VerificationFailed(
                f"checking {what} crashed its checker process (exit status {code})", reason="verification_crashed"
            )
        self._release(checker)
        if error == "recursion":
            raise VerificationFailed(
                f"checking {what} overflowed the stack: it nests too deeply", reason="verification_crashed"
            )
        if error is not None:
            raise InfrastructureError(f"the {name} check failed: {reply.get('message', '')}"[:2000])
        return reply["result"]

    def _release(self, checker: _Checker) -> None:
        if self._keep(checker):
            self._idle.append(checker)
        else:
            self._discard(checker)

    def _keep(self, checker: _Checker) -> bool:
        """Back to the idle list unless closed, dead, or left holding half its memory limit."""
        return not self._closed and checker.alive and checker.rss_mib < self.settings.memory_limit_mib / 2

    def _discard(self, checker: _Checker, *, killed: bool = False) -> None:
        """Kill now, reap in the background (a cancelled caller cannot wait)."""
        self.killed += killed
        checker.kill_now()
        task = asyncio.get_running_loop().create_task(checker.kill())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def close(self) -> None:
        """Kill every process; checks still running end with CheckerError or their own verdict."""
        self._closed = True
        idle, self._idle = self._idle, []
        for checker in idle:
            await checker.kill()
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
        async with self._template_lock:
            if self._template is not None:
                await self._template.close()


_LIVE_PIDS: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    """A process that exits without closing its pool takes its checkers with it."""
    for pid in list(_LIVE_PIDS):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class _Shared:
    pool: CheckerPool | None = None
    settings: VerifierSettings | None = None
    holders = 0


def shared_pool() -> CheckerPool:
    """This process's pool, for the running event loop (started, empty, on first use)."""
    pool = _Shared.pool
    loop = asyncio.get_running_loop()
    if pool is None or pool._closed or (pool.loop is not None and pool.loop is not loop):
        pool = _Shared.pool = CheckerPool(_Shared.settings)
        pool.loop = loop
    return pool


async def hold_shared_pool(settings: VerifierSettings) -> None:
    """A server starts using the shared pool; its settings apply from now on (the latest
    holder's, should several servers share a process)."""
    _Shared.settings = settings
    if _Shared.pool is not None:
        _Shared.pool.reconfigure(settings)
    _Shared.holders += 1


async def release_shared_pool() -> None:
    """A server is done with the shared pool; the last one stops its processes."""
    _Shared.holders = max(_Shared.holders - 1, 0)
    if _Shared.holders == 0 and _Shared.pool is not None:
        pool, _Shared.pool = _Shared.pool, None
        await pool.close()
