"""The pool of inference backends and the choice of one per request.

A new trajectory goes to the healthy backend with the fewest requests in
flight per unit of weight (live load, not jobs ever assigned); its later turns stick to the same
backend while it stays healthy, to reuse its prefix cache. A health check
evicts backends that stop answering and readmits them when they answer again.
Pause/Resume bracket a weight update: while paused no request starts;
UpdateWeights loads a checkpoint into the backends that can load one and
stages its version; Resume bumps the policy version that every model turn
records. A job may ask for a minimum version: its turns wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

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

    # --- membership ------------------------------------------------------------

    def add(self, backend: LLMBackend, *, managed: bool = False) -> BackendEntry:
        backend_id = backend.info.id
        if backend_id in self._entries:
            raise AlreadyExists(f"backend {backend_id!r} already exists; remove it first to replace it")
        entry = BackendEntry(backend, managed=managed)
        self._entries[backend_id] = entry
        self._wake()
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
        if entry.in_flight == 0:
            await entry.backend.close()
        log.info("backend_removed", backend=backend_id)

    def entries(self) -> list[BackendEntry]:
        return list(self._entries.values())

    def forget(self, job_id: str) -> None:
        """The job has finished: drop its stickiness."""
        self._sticky.pop(job_id, None)

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

    @contextlib.asynccontextmanager
    async def lease(self, job_id: str, *, min_version: int = 0) -> AsyncIterator[BackendEntry]:
        """A backend for one request of `job_id`, counted in flight while held; the request
        waits until the policy version is at least `min_version`."""
        while True:
            await self._resumed.wait()
            if self.policy_version < min_version:
                await self._changed.wait()
                continue
            if not self._entries:
                raise LLMError("no LLM backend is configured: add one with AdminService.AddBackend")
            if not any(e.healthy for e in self._entries.values()):
                raise LLMError("every LLM backend is failing its health check", reason="llm_unavailable")
            entry = self._choose(job_id)
            if entry is not None:
                break
            await self._changed.wait()
        self._sticky[job_id] = entry.id
        entry.in_flight += 1
        entry.requests_total += 1
        try:
            yield entry
        except LLMError:
            entry.errors_total += 1
            raise
        finally:
            entry.in_flight -= 1
            self._wake()
            if entry.removed and entry.in_flight == 0:
                await asyncio.shield(entry.backend.close())

    def fail_over(self, entry: BackendEntry) -> bool:
        """Mark a backend that stopped answering unhealthy (the health check readmits
        it); True when another healthy backend can take the request."""
        if entry.healthy:
            log.warning("backend_unreachable", backend=entry.id)
            entry.healthy = False
            self._wake()
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
