"""The pool of inference backends and the choice of one per request.

A new trajectory goes to the healthy backend with the fewest requests in
flight per unit of weight (live load, not jobs ever assigned); its later turns stick to the same
backend while it stays healthy, to reuse its prefix cache. A health check
evicts backends that stop answering and readmits them when they answer again.
Pause/Resume bracket a weight update: while paused no request starts;
UpdateWeights loads a checkpoint into the backends that can load one and
stages its version; Resume bumps the policy version that every model turn
records. A job may ask for a minimum version: its turns wait for it.

Slots are granted first come, first served: a request that finds no free slot
joins a queue, and a slot freed by a request that ends goes straight to the
oldest request waiting that can use it. A job that finishes a turn and asks
again at once queues behind the jobs already waiting, so the turns of jobs
sharing one backend interleave instead of one trajectory running to its end
while the others wait. How long each request waited is the job's wait clock's
business (`wait_clocks`): waiting for a slot is never the policy's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from prorl_server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, LLMError, NotFound, ProrlError
from prorl_server.llm.base import LLMBackend

log = structlog.get_logger(__name__)


@dataclass
class BackendEntry:
    backend: LLMBackend
    managed: bool = False
    shared: bool = False
    """Added to the whole cluster through AdminService (the same server for every member),
    rather than from this server's own settings."""
    in_flight: int = 0
    requests_total: int = 0
    errors_total: int = 0
    healthy: bool = True
    removed: bool = False
    failed_checks: int = 0
    """Health checks failed in a row."""

    @property
    def id(self) -> str:
        return self.backend.info.id

    @property
    def has_capacity(self) -> bool:
        cap = self.backend.info.max_in_flight
        return cap <= 0 or self.in_flight < cap


class WaitClock(Protocol):
    """Told when a job's request starts and stops waiting for a model slot (the job's budget
    stops meanwhile); several requests of one job may wait at once."""

    def waiting_for_model(self) -> AbstractContextManager[None]: ...


@dataclass(eq=False)
class _Waiter:
    """A request waiting for a slot, in arrival order."""

    job_id: str
    min_version: int
    granted: asyncio.Future[BackendEntry] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BackendRouter:
    def __init__(self, *, health_interval_s: float = 10.0, failed_checks_to_evict: int = 1) -> None:
        self._entries: dict[str, BackendEntry] = {}
        self._sticky: dict[str, str] = {}
        self._changed = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._in_flight_tasks: set[asyncio.Task[object]] = set()
        self._aborted: set[asyncio.Task[object]] = set()
        self.policy_version = 0
        self.staged_version: int | None = None
        """The version of weights loaded by UpdateWeights during this pause: the next Resume's default."""
        self.held: str | None = None
        """Why this server stays paused whatever Resume says (its backends failed to load the
        cluster's new weights: serving the old ones under the new version would mislabel turns)."""
        self.aborted_total = 0
        """In-flight requests Pause(abort_in_flight) has cancelled since the start."""
        self._health_interval_s = health_interval_s
        self._failed_checks_to_evict = failed_checks_to_evict
        self._health_task: asyncio.Task[None] | None = None
        self._waiters: list[_Waiter] = []
        """Requests waiting for a slot, oldest first."""
        self.wait_clocks: dict[str, WaitClock] = {}
        """Per job id: the clock told of the job's waits for a slot (its budget); `forget` drops it."""

    # --- membership ------------------------------------------------------------

    def add(self, backend: LLMBackend, *, managed: bool = False) -> BackendEntry:
        backend_id = backend.info.id
        if backend_id in self._entries:
            raise AlreadyExists(f"backend {backend_id!r} already exists; remove it first to replace it")
        entry = BackendEntry(backend, managed=managed)
        self._entries[backend_id] = entry
        self._wake()
        self._dispatch()
        log.info("backend_added", backend=backend_id, url=backend.info.base_url)
        return entry

    async def remove(self, backend_id: str) -> None:
        entry = self._entries.get(backend_id)
        if entry is None:
            raise NotFound(f"no backend with id {backend_id!r}; ListBackends shows the ids")
        if entry.managed:
            raise FailedPrecondition(f"backend {backend_id!r} is the server's embedded model and cannot be removed")
        del self._entries[backend_id]
        entry.removed = True
        self._dispatch()  # requests waiting for the last backend learn there is none
        if entry.in_flight == 0:
            await entry.backend.close()
        log.info("backend_removed", backend=backend_id)

    def entries(self) -> list[BackendEntry]:
        return list(self._entries.values())

    def forget(self, job_id: str) -> None:
        """The job has finished: drop its stickiness and its wait clock."""
        self._sticky.pop(job_id, None)
        self.wait_clocks.pop(job_id, None)

    # --- choosing --------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _choose(self, job_id: str) -> BackendEntry | None:
        sticky = self._entries.get(self._sticky.get(job_id, ""))
        if sticky is not None and sticky.healthy and sticky.has_capacity:
            return sticky
        # The job's own backend is full (or gone): a free slot elsewhere beats
        # waiting for its prefix cache, or the pool would idle while jobs queue.
        candidates = [e for e in self._entries.values() if e.healthy and e.has_capacity]
        if not candidates:
            return None
        return min(candidates, key=lambda e: e.in_flight / e.backend.info.weight)

    def _unservable(self) -> LLMError | None:
        """Why no request can be served now, whatever it waits for."""
        if not self._entries:
            return LLMError("no LLM backend is configured: add one with AdminService.AddBackend")
        if not any(e.healthy for e in self._entries.values()):
            return LLMError("every LLM backend is failing its health check", reason="llm_unavailable")
        return None

    def _eligible(self, waiter: _Waiter) -> bool:
        """The waiter could be served now if a slot were free (not held by a pause or a version)."""
        return not waiter.granted.done() and not self.paused and self.policy_version >= waiter.min_version

    def _take(self, job_id: str, entry: BackendEntry) -> BackendEntry:
        self._sticky[job_id] = entry.id
        entry.in_flight += 1
        entry.requests_total += 1
        return entry

    def _take_now(self, job_id: str, min_version: int) -> BackendEntry | None:
        """A slot for a new request without waiting, if one is free and nobody who could
        use it waits already (a new request never overtakes the queue)."""
        if self.paused or self.policy_version < min_version:
            return None
        if any(self._eligible(waiter) for waiter in self._waiters):
            return None
        problem = self._unservable()
        if problem is not None:
            raise problem
        entry = self._choose(job_id)
        return self._take(job_id, entry) if entry is not None else None

    def _dispatch(self) -> None:
        """Hand free slots to the waiting requests, oldest first; tell them when none can be served."""
        self._waiters = [waiter for waiter in self._waiters if not waiter.granted.done()]
        if self.paused or not self._waiters:
            return
        for waiter in list(self._waiters):
            if not self._eligible(waiter):
                continue
            problem = self._unservable()
            if problem is not None:
                waiter.granted.set_exception(problem)
                continue
            entry = self._choose(waiter.job_id)
            if entry is None:
                break  # no backend has a free slot: nobody behind gets one either
            waiter.granted.set_result(self._take(waiter.job_id, entry))
        self._waiters = [waiter for waiter in self._waiters if not waiter.granted.done()]

    def _release(self, entry: BackendEntry) -> None:
        entry.in_flight -= 1
        self._wake()
        self._dispatch()

    async def _wait_for_slot(self, job_id: str, min_version: int) -> BackendEntry:
        waiter = _Waiter(job_id, min_version)
        self._waiters.append(waiter)
        clock = self.wait_clocks.get(job_id)
        with clock.waiting_for_model() if clock is not None else contextlib.nullcontext():
            try:
                return await waiter.granted
            except asyncio.CancelledError:
                granted = waiter.granted
                if granted.done() and not granted.cancelled() and granted.exception() is None:
                    self._release(granted.result())  # granted just as it was cancelled: pass the slot on
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (a pause or a policy version included)."""
        return sum(1 for waiter in self._waiters if not waiter.granted.done())

    @contextlib.asynccontextmanager
    async def lease(self, job_id: str, *, min_version: int = 0) -> AsyncIterator[BackendEntry]:
        """A backend for one request of `job_id`, counted in flight while held; the request
        waits until the policy version is at least `min_version`, and for a free slot in
        arrival order."""
        entry = self._take_now(job_id, min_version)
        if entry is None:
            entry = await self._wait_for_slot(job_id, min_version)
        try:
            yield entry
        except LLMError:
            entry.errors_total += 1
            raise
        finally:
            self._release(entry)
            if entry.removed and entry.in_flight == 0:
                await asyncio.shield(entry.backend.close())

    def fail_over(self, entry: BackendEntry) -> bool:
        """Mark a backend that stopped answering unhealthy (the health check readmits
        it); True when another healthy backend can take the request."""
        if entry.healthy:
            log.warning("backend_unreachable", backend=entry.id)
            entry.healthy = False
            self._wake()
            self._dispatch()
        return any(e.healthy for e in self._entries.values())

    # --- pause / resume around a weight update -------------------------------------

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def track(self, task: asyncio.Task[object]) -> None:
        self._in_flight_tasks.add(task)
        task.add_done_callback(self._in_flight_tasks.discard)

    def was_aborted(self, task: asyncio.Task[object]) -> bool:
        """True once for a request that Pause(abort) cancelled: retry it after Resume."""
        if task in self._aborted:
            self._aborted.discard(task)
            return True
        return False

    def pause(self, *, abort_in_flight: bool) -> int:
        """Stop new requests. Returns the number of in-flight requests aborted."""
        self._resumed.clear()
        aborted = 0
        if abort_in_flight:
            for task in list(self._in_flight_tasks):
                if not task.done():
                    self._aborted.add(task)
                    task.cancel()
                    aborted += 1
        self.aborted_total += aborted
        log.info("generation_paused", aborted=aborted, policy_version=self.policy_version)
        return aborted

    def resume(self, policy_version: int | None = None) -> int:
        policy_version = self.check_version(policy_version)
        self.policy_version = policy_version
        self.staged_version = None
        if self.held is not None:
            log.error("generation_held", policy_version=policy_version, reason=self.held)
            return policy_version
        self._resumed.set()
        self._wake()
        self._dispatch()
        log.info("generation_resumed", policy_version=policy_version)
        return policy_version

    def check_version(self, policy_version: int | None) -> int:
        """The version Resume would take: `policy_version`, or the staged one, or current + 1."""
        floor = self.policy_version if self.staged_version is None else self.staged_version
        if policy_version is None:
            return self.policy_version + 1 if self.staged_version is None else self.staged_version
        if policy_version < floor:
            raise FailedPrecondition(
                f"policy version {policy_version} is older than the current {floor}; versions only grow"
            )
        return policy_version

    # --- weight updates ---------------------------------------------------------------

    def weight_targets(self, backend_ids: Sequence[str]) -> list[BackendEntry]:
        """The backends UpdateWeights loads: those named, or every one that can."""
        if not backend_ids:
            entries = [e for e in self._entries.values() if e.backend.loads_weights]
            if not entries:
                raise FailedPrecondition(
                    "no backend in the pool can load weights through the service (the embedded model, vLLM and "
                    "SGLang can); update the others yourself between Pause and Resume"
                )
            return entries
        entries = []
        for backend_id in dict.fromkeys(backend_ids):
            entry = self._entries.get(backend_id)
            if entry is None:
                raise NotFound(f"no backend with id {backend_id!r}; ListBackends shows the ids")
            if not entry.backend.loads_weights:
                raise InvalidArgument(
                    f"backend {backend_id!r} ({entry.backend.info.kind}) cannot load weights through the service; "
                    "update it yourself between Pause and Resume"
                )
            entries.append(entry)
        return entries

    async def drained(self, entries: Sequence[BackendEntry]) -> None:
        """Wait until none of `entries` has a request in flight."""
        while any(entry.in_flight for entry in entries):
            await self._changed.wait()

    async def load_weights(self, entries: Sequence[BackendEntry], model_path: str) -> list[tuple[str, float]]:
        """Load `model_path` into each backend once its requests have finished; (id, seconds) each."""
        if not self.paused:
            raise FailedPrecondition(
                "generation is not paused: call Pause, then UpdateWeights, then Resume (or UpdateWeights with resume)"
            )
        await self.drained(entries)
        loaded: list[tuple[str, float]] = []
        for entry in entries:
            started = time.perf_counter()
            try:
                await entry.backend.load_weights(model_path)
            except ProrlError as exc:
                done = f"; {', '.join(i for i, _ in loaded)} loaded it" if loaded else ""
                exc.message = f"{exc.message}{done}; generation stays paused"
                exc.args = (exc.message,)
                raise
            loaded.append((entry.id, time.perf_counter() - started))
        log.info("weights_loaded", model_path=model_path, backends=[i for i, _ in loaded])
        return loaded

    def stage(self, policy_version: int) -> None:
        """New weights are loaded: Resume without a version resumes under `policy_version`."""
        self.staged_version = policy_version
        self.held = None

    # --- health ----------------------------------------------------------------

    def start(self) -> None:
        if self._health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="backend-health")

    async def check_health(self) -> None:
        """Evict backends that fail `failed_checks_to_evict` checks in a row (one slow
        answer from a busy server is not an outage); readmit one as soon as it passes."""
        entries = list(self._entries.values())
        results = await asyncio.gather(*(e.backend.check_health() for e in entries), return_exceptions=True)
        for entry, ok in zip(entries, results, strict=True):
            entry.failed_checks = 0 if ok is True else entry.failed_checks + 1
            healthy = entry.failed_checks == 0 or (entry.healthy and entry.failed_checks < self._failed_checks_to_evict)
            if healthy != entry.healthy:
                log.warning("backend_health_changed", backend=entry.id, healthy=healthy)
                entry.healthy = healthy
                self._wake()
                self._dispatch()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await self.check_health()

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        self._resumed.set()
        for entry in list(self._entries.values()):
            await entry.backend.close()
        self._entries.clear()
        self._dispatch()  # anything still waiting learns there is no backend
