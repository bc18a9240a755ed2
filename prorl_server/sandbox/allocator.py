"""Warm pools: started, healthy sandboxes kept ready per image and resource spec.

Acquire takes a warm sandbox when its pool has one (and refills the pool in
the background), or starts one cold. A sandbox is used by one job and then
destroyed: never handed to another job.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass

import structlog

from prorl_server.errors import SandboxBroken, SandboxError
from prorl_server.sandbox.base import Sandbox, SandboxProvider, SandboxSpec

log = structlog.get_logger(__name__)

PoolKey = tuple[str, float, int, int]
HEALTH_TIMEOUT_S = 2.0
REFILL_BACKOFF_S = 2.0


@dataclass
class PoolStats:
    image: str
    cpus: float
    memory_mib: int
    pids_limit: int
    warm: int
    busy: int
    target: int


class WarmPool:
    def __init__(self, provider: SandboxProvider, spec: SandboxSpec, size: int) -> None:
        self.spec = spec
        self.size = size
        self._provider = provider
        self.ready: collections.deque[Sandbox] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._refill(), name=f"warm-pool:{self.spec.image}")

    async def _refill(self) -> None:
        while True:
            while len(self.ready) < self.size:
                try:
                    self.ready.append(await self._provider.create(self.spec))
                except SandboxError as exc:
                    log.error("warm_pool_refill_failed", image=self.spec.image, error=exc.message)
                    await asyncio.sleep(REFILL_BACKOFF_S)
            self._wake.clear()
            await self._wake.wait()

    async def take(self) -> Sandbox | None:
        """A healthy warm sandbox, or None when the pool is empty."""
        while self.ready:
            sandbox = self.ready.popleft()
            self._wake.set()
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):
                    await sandbox.health()
                return sandbox
            except (SandboxError, SandboxBroken, TimeoutError):  # no agent has run in it yet: not the job's
                log.warning("warm_sandbox_unhealthy", sandbox=sandbox.id)
                await sandbox.close()
        return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self.ready:
            await self.ready.popleft().close()


class SandboxAllocator:
    """The sandboxes jobs get: warm when a pool matches, cold otherwise."""

    def __init__(self, provider: SandboxProvider, pools: list[tuple[SandboxSpec, int]]) -> None:
        self.provider = provider
        self._pools = {spec.pool_key: WarmPool(provider, spec, size) for spec, size in pools}
        self._busy: collections.Counter[PoolKey] = collections.Counter()
        self._specs: dict[PoolKey, SandboxSpec] = {spec.pool_key: spec for spec, _ in pools}

    def start(self) -> None:
        for pool in self._pools.values():
            pool.start()

    async def acquire(self, spec: SandboxSpec) -> Sandbox:
        key = spec.pool_key
        pool = self._pools.get(key)
        sandbox = await pool.take() if pool is not None else None
        if sandbox is None:
            sandbox = await self.provider.create(spec)
        self._specs.setdefault(key, spec)
        self._busy[key] += 1

        def released() -> None:
            self._busy[key] -= 1

        sandbox.on_close(released)
        return sandbox

    @property
    def busy(self) -> int:
        return sum(self._busy.values())

    def stats(self) -> list[PoolStats]:
        keys = set(self._pools) | {key for key, count in self._busy.items() if count}
        return [
            PoolStats(
                image=key[0],
                cpus=key[1],
                memory_mib=key[2],
                pids_limit=key[3],
                warm=len(self._pools[key].ready) if key in self._pools else 0,
                busy=self._busy[key],
                target=self._pools[key].size if key in self._pools else 0,
            )
            for key in sorted(keys)
        ]

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()
