"""A child process the server starts, watches and stops (Podman API, llama.cpp).

Its stderr is drained continuously (a full pipe would stall the child) and its
last lines kept, to explain a failed start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Sequence

import structlog

log = structlog.get_logger(__name__)


class ChildExited(Exception):
    """The child process ended while we waited for it to become ready."""


class SupervisedProcess:
    def __init__(self, name: str, command: Sequence[str], *, cwd: str | None = None) -> None:
        self.name = name
        self._command = list(command)
        self._cwd = cwd
        self._process: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=40)

    @property
    def stderr_tail(self) -> str:
        return "\n".join(self._stderr_tail)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self, ready: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """Start the child and wait until `ready()` says so (TimeoutError, ChildExited)."""
        self._process = await asyncio.create_subprocess_exec(
            *self._command,
            cwd=self._cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._drain = asyncio.create_task(self._drain_stderr(self._process))
        try:
            await asyncio.wait_for(self._wait_ready(ready), timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self, ready: Callable[[], Awaitable[bool]]) -> None:
        assert self._process is not None
        while not await ready():
            if self._process.returncode is not None:
                raise ChildExited(f"{self.name} exited with code {self._process.returncode}")
            await asyncio.sleep(0.1)

    async def _drain_stderr(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        async for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._stderr_tail.append(line)

    async def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                # The whole group (the child leads it): killing the child alone would orphan
                # what it started, e.g. the podman service under runuser.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
            log.info("child_stopped", child=self.name)
        if self._drain is not None:
            drain, self._drain = self._drain, None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain, 2)
