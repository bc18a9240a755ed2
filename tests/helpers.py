"""Shared test helpers: polling instead of sleeps, requests, a test server's settings, event summaries."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prorl_client import v1
from prorl_server.config import Settings, load_settings
from tests.conftest import instance_id


async def assert_eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], *, timeout_s: float = 20.0, message: str = ""
) -> None:
    """Poll `check` until it is true; fail after timeout_s (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(message or f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.05)


def math_request(
    question: str,
    answer: str = "42",
    *,
    job_id: str = "",
    budget_s: float | None = None,
    max_turns: int | None = None,
    **fields: Any,
) -> v1.RolloutRequest:
    request = v1.RolloutRequest(job_id=job_id, handler="math", **fields)
    request.instance.update({"question": question, "answer": answer})
    if budget_s is not None:
        request.limits.budget.FromNanoseconds(int(budget_s * 1e9))
    if max_turns is not None:
        request.limits.max_turns = max_turns
    return request


def server_settings(name: str = "server", **sections: dict[str, Any]) -> Settings:
    """The settings of a test's own server: a free port, an instance id of this test session's
    (`name`), no shutdown grace, no job store, no embedded model and no health polling (the test
    gives ProrlServer its sandbox provider and its backends, or names them in `llm`). `sections`
    add to these key by key (`jobs={"store": True, "store_path": ...}`) or bring their own."""
    overrides: dict[str, dict[str, Any]] = {
        "server": {"port": 0, "instance_id": instance_id(name), "shutdown_grace_s": 0},
        "jobs": {"store": False},
        "llm": {"embedded": {"enabled": "never"}, "health_interval_s": 0},
    }
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    return load_settings(None, environ={}, overrides=overrides)


def kinds(events: list[v1.RolloutEvent]) -> list[str]:
    return [str(event.WhichOneof("kind")) for event in events]


class ServeProcess:
    """`prorl-server serve` as a child process: started with --set flags, its
    address read from its log, killed (never left behind) on exit."""

    def __init__(self, *settings: str) -> None:
        self.settings = settings
        self.process: asyncio.subprocess.Process | None = None
        self.address = ""
        self.log: list[str] = []

    async def __aenter__(self) -> ServeProcess:
        flags = [arg for setting in self.settings for arg in ("--set", setting)]
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prorl_server", "serve", "--port", "0", *flags,
            stderr=asyncio.subprocess.PIPE, cwd="/",
        )  # fmt: skip
        assert self.process.stderr is not None
        async with asyncio.timeout(60):
            while not self.address:
                line = (await self.process.stderr.readline()).decode()
                assert line, "the server exited before listening:\n" + "".join(self.log)
                self.log.append(line)
                if line.startswith("prorl-server listening on "):
                    self.address = line.split()[-1]
        self._drain = asyncio.ensure_future(self._read_log())
        return self

    async def _read_log(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        async for line in self.process.stderr:
            self.log.append(line.decode())

    async def wait(self, timeout_s: float = 60) -> int:
        assert self.process is not None
        async with asyncio.timeout(timeout_s):
            return await self.process.wait()

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop it as an operator would (SIGTERM: it removes its sandboxes), killed if it
        does not end within 30 s."""
        assert self.process is not None
        if self.process.returncode is None:
            self.process.terminate()
            try:
                async with asyncio.timeout(30):
                    await self.process.wait()
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        await self._drain
