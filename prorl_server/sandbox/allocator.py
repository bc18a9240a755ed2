"""Warm pools: started sandboxes kept ready per image and resource spec, and their reuse.

Acquire takes a ready sandbox of the job's pool key when there is one; when none
is ready but one is being reset, it waits for that one (a reset takes
milliseconds, a new container hundreds, see docs/benchmarks.md); otherwise it
starts one cold. A configured pool's refill keeps `size` ready.

Without reuse (the default), a sandbox serves one job and is then removed.

With reuse (sandbox.reuse.enabled), closing a job's sandbox hands it back here:
its container resets it (ContainerHandle.reset: every process but init and the
runtime ended, the writable paths restored from the image, IPC objects and keys
removed) and proves it as new from the host (podman/reset_check.py). Then it goes
to a job waiting for one, else back among the ready ones of its pool key. A
sandbox is removed (retired) instead when its reset finds any problem, fails or
takes too long, when it has served `max_jobs`, or when its pool already holds
`max_idle` ready ones. Ready sandboxes beyond the configured size that nobody
took for `idle_s` are removed: a pool grows with the concurrency of the jobs it
serves, up to `max_idle`, and shrinks when they go away.

A reset sandbox is as good as a new one (the adversarial suite,
tests/adversarial/test_sandbox_reuse.py, is what makes that claim): jobs and the
verdicts they judge in a sandbox of their own get either kind.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass

import structlog

from prorl_server.errors import SandboxBroken, SandboxError
from prorl_server.sandbox.base import Sandbox, SandboxProvider, SandboxSpec

log = structlog.get_logger(__name__)

PoolKey = tuple[str, float, int, int]
HEALTH_TIMEOUT_S = 2.0
REFILL_BACKOFF_S = 2.0
RESET_TIMES_KEPT = 4096


@dataclass(frozen=True)
class ReusePolicy:
    """How sandboxes are reused between jobs (config: sandbox.reuse)."""

    enabled: bool = False
    max_idle: int = 16
    """Ready sandboxes kept per pool key at most (the configured size, if larger, wins)."""
    idle_s: float = 60.0
    """A ready sandbox beyond the configured size that nobody took for this long is removed."""
    max_jobs: int = 1000
    """Jobs one container serves before it is retired anyway."""
    reset_timeout_s: float = 60.0
    """A reset (and its proof) still running after this retires the sandbox."""


@dataclass
class PoolStats:
    image: str
    cpus: float
    memory_mib: int
    pids_limit: int
    warm: int
    busy: int
    target: int
    resetting: int = 0
    reused: int = 0
    """Sandboxes handed to a job after a reset, since start."""
    retired: int = 0
    """Sandboxes removed because their reset could not prove them clean (or failed)."""


class WarmPool:
    def __init__(self, provider: SandboxProvider, spec: SandboxSpec, size: int, policy: ReusePolicy) -> None:
        self.spec = spec
        self.size = size
        self._policy = policy
        self._provider = provider
        self.ready: collections.deque[tuple[Sandbox, float]] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Sandbox | None]] = collections.deque()
        self.resetting = 0
        self.reused = 0
        self.retired = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and (self.size or self._policy.enabled):
            self._task = asyncio.create_task(self._refill(), name=f"warm-pool:{self.spec.image}")

    @property
    def capacity(self) -> int:
        return max(self.size, self._policy.max_idle if self._policy.enabled else 0)

    async def _refill(self) -> None:
        while True:
            while len(self.ready) + self.resetting < self.size:
                try:
                    self._hand_out(await self._provider.create(self.spec))
                except SandboxError as exc:
                    log.error("warm_pool_refill_failed", image=self.spec.image, error=exc.message)
                    await asyncio.sleep(REFILL_BACKOFF_S)
            await self._trim_idle()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._policy.idle_s / 4 if self._policy.enabled else None):
                    await self._wake.wait()

    async def _trim_idle(self) -> None:
        """Remove the ready sandboxes beyond `size` that waited longer than idle_s."""
        now = time.monotonic()
        while len(self.ready) > self.size and now - self.ready[0][1] > self._policy.idle_s:
            sandbox, _ = self.ready.popleft()
            await _remove(sandbox)

    def _hand_out(self, sandbox: Sandbox) -> bool:
        """To the first job waiting for one, else among the ready ones; False when the pool is
        full (the caller removes it)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(sandbox)
                return True
        if len(self.ready) >= self.capacity:
            return False
        self.ready.append((sandbox, time.monotonic()))
        return True

    def reset_ended(self, sandbox: Sandbox | None) -> bool:
        """A reset of this pool's is over: `sandbox` proven clean, or None when it was retired.
        False when a clean one finds no room (the caller removes it)."""
        self.resetting -= 1
        if sandbox is not None:
            self.reused += 1
            return self._hand_out(sandbox)
        self.retired += 1
        # A job waiting on this reset starts a sandbox of its own instead.
        while len(self._waiters) > self.resetting:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._wake.set()
        return True

    async def take(self) -> Sandbox | None:
        """A healthy ready sandbox, one being reset once it is, or None (start one cold)."""
        while self.ready:
            sandbox, _ = self.ready.popleft()
            self._wake.set()
            if await _healthy(sandbox):
                return sandbox
        if self.resetting > len(self._waiters):
            waiter: asyncio.Future[Sandbox | None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                handed = await waiter
            except asyncio.CancelledError:
                late = waiter.result() if waiter.done() and not waiter.cancelled() else None
                if late is not None and not self._hand_out(late):  # handed over as the job was cancelled
                    await _remove(late)
                raise
            if handed is not None and await _healthy(handed):
                return handed
        return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        while self.ready:
            await _remove(self.ready.popleft()[0])


async def _healthy(sandbox: Sandbox) -> bool:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            await sandbox.health()
        return True
    except (SandboxError, SandboxBroken, TimeoutError):  # no job holds it: nobody's failure
        log.warning("warm_sandbox_unhealthy", sandbox=sandbox.id)
        await _remove(sandbox)
        return False


async def _remove(sandbox: Sandbox) -> None:
    """Remove a sandbox no job holds (a recycled one's `close` would only recycle it)."""
    try:
        await sandbox.runtime.close()
    finally:
        await sandbox.container.remove()


class SandboxAllocator:
    """The sandboxes jobs get: ready or reset when a pool of their key has one, cold otherwise."""

    def __init__(
        self,
        provider: SandboxProvider,
        pools: list[tuple[SandboxSpec, int]],
        *,
        reuse: ReusePolicy | None = None,
    ) -> None:
        self.provider = provider
        self.reuse = reuse or ReusePolicy()
        self._pools = {spec.pool_key: WarmPool(provider, spec, size, self.reuse) for spec, size in pools}
        self._busy: collections.Counter[PoolKey] = collections.Counter()
        self._specs: dict[PoolKey, SandboxSpec] = {spec.pool_key: spec for spec, _ in pools}
        self._resets: set[asyncio.Task[None]] = set()
        self._started = False
        self.reset_times: collections.deque[float] = collections.deque(maxlen=RESET_TIMES_KEPT)
        """Seconds each recent reset took, its proof included (for the benches)."""

    def start(self) -> None:
        self._started = True
        for pool in self._pools.values():
            pool.start()

    def _pool(self, spec: SandboxSpec) -> WarmPool | None:
        key = spec.pool_key
        pool = self._pools.get(key)
        if pool is None and self.reuse.enabled:
            # Not configured: a pool of size 0, filled by the resets of its jobs' sandboxes.
            pool = self._pools[key] = WarmPool(self.provider, _unlabelled(spec), 0, self.reuse)
            if self._started:
                pool.start()
        return pool

    async def acquire(self, spec: SandboxSpec) -> Sandbox:
        key = spec.pool_key
        pool = self._pool(spec)
        sandbox = await pool.take() if pool is not None else None
        if sandbox is None:
            sandbox = await self.provider.create(spec)
        self._specs.setdefault(key, spec)
        self._busy[key] += 1
        if self.reuse.enabled:
            lease = Sandbox(sandbox.runtime, sandbox.container, recycle=lambda used: self._recycle(spec, used))
            lease.jobs_served = sandbox.jobs_served
            sandbox = lease

        def released() -> None:
            self._busy[key] -= 1

        sandbox.on_close(released)
        return sandbox

    async def _recycle(self, spec: SandboxSpec, used: Sandbox) -> None:
        """A job closed `used`: reset it in the background (the job's cleanup does not wait)."""
        pool = self._pool(spec)
        assert pool is not None
        pool.resetting += 1
        task = asyncio.create_task(self._reset(pool, used), name=f"sandbox-reset:{used.id}")
        self._resets.add(task)
        task.add_done_callback(self._resets.discard)

    async def _reset(self, pool: WarmPool, used: Sandbox) -> None:
        started = time.perf_counter()
        problems: list[str]
        try:
            if used.jobs_served + 1 >= self.reuse.max_jobs:
                problems = [f"served {used.jobs_served + 1} jobs, the most one container may"]
            else:
                async with asyncio.timeout(self.reuse.reset_timeout_s):
                    problems = await used.container.reset(used.runtime)
        except TimeoutError:
            problems = [f"the reset took longer than {self.reuse.reset_timeout_s:g}s"]
        except asyncio.CancelledError:
            pool.reset_ended(None)
            await asyncio.shield(_remove(used))
            raise
        except Exception as exc:
            problems = [f"the reset failed: {type(exc).__name__}: {exc}"]
        self.reset_times.append(time.perf_counter() - started)
        if problems:
            log.warning("sandbox_retired", sandbox=used.id, problems=problems[:5])
            pool.reset_ended(None)
            await _remove(used)
            return
        fresh = Sandbox(used.runtime, used.container)
        fresh.jobs_served = used.jobs_served + 1
        if not pool.reset_ended(fresh):
            await _remove(fresh)

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
                resetting=self._pools[key].resetting if key in self._pools else 0,
                reused=self._pools[key].reused if key in self._pools else 0,
                retired=self._pools[key].retired if key in self._pools else 0,
            )
            for key in sorted(keys)
        ]

    async def close(self) -> None:
        resets, self._resets = set(self._resets), set()
        for task in resets:
            task.cancel()
        await asyncio.gather(*resets, return_exceptions=True)
        for pool in self._pools.values():
            await pool.close()


def _unlabelled(spec: SandboxSpec) -> SandboxSpec:
    """The spec a reuse pool keeps, without the first job's labels (its id)."""
    return SandboxSpec(image=spec.image, cpus=spec.cpus, memory_mib=spec.memory_mib, pids_limit=spec.pids_limit)
