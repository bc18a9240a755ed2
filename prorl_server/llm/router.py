"""The pool of inference backends and the choice of one per request.

A new trajectory goes to the healthy backend with the fewest requests in
flight (live load, not jobs ever assigned); its later turns stick to the same
backend while it stays healthy, to reuse its prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from prorl_server.errors import AlreadyExists, FailedPrecondition, LLMError, NotFound
from prorl_server.llm.base import ChatBackend, ChatResult, Sampling

log = structlog.get_logger(__name__)


@dataclass
class BackendEntry:
    backend: ChatBackend
    managed: bool = False
    in_flight: int = 0
    requests_total: int = 0
    errors_total: int = 0
    healthy: bool = True
    removed: bool = False

    @property
    def has_capacity(self) -> bool:
        cap = self.backend.info.max_in_flight
        return cap <= 0 or self.in_flight < cap


class BackendPool:
    def __init__(self) -> None:
        self._entries: dict[str, BackendEntry] = {}
        self._sticky: dict[str, str] = {}
        self._capacity_freed = asyncio.Event()

    def add(self, backend: ChatBackend, *, managed: bool = False) -> BackendEntry:
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
        self._sticky = {job: bid for job, bid in self._sticky.items() if bid != backend_id}
        if entry.in_flight == 0:
            await entry.backend.close()
        log.info("backend_removed", backend=backend_id)

    def entries(self) -> list[BackendEntry]:
        return list(self._entries.values())

    def get(self, backend_id: str) -> BackendEntry:
        entry = self._entries.get(backend_id)
        if entry is None:
            raise NotFound(f"no backend with id {backend_id!r}")
        return entry

    def forget(self, job_id: str) -> None:
        """The job has finished: drop its stickiness."""
        self._sticky.pop(job_id, None)

    def _wake(self) -> None:
        self._capacity_freed.set()
        self._capacity_freed = asyncio.Event()

    def _choose(self, job_id: str) -> BackendEntry | None:
        sticky = self._entries.get(self._sticky.get(job_id, ""))
        if sticky is not None and sticky.healthy and sticky.has_capacity:
            return sticky
        candidates = [e for e in self._entries.values() if e.healthy and e.has_capacity]
        if not candidates:
            return None
        return min(candidates, key=lambda e: e.in_flight)

    async def _acquire(self, job_id: str) -> BackendEntry:
        while True:
            if not self._entries:
                raise LLMError("no LLM backend is configured: add one with AdminService.AddBackend")
            entry = self._choose(job_id)
            if entry is not None:
                self._sticky[job_id] = entry.backend.info.id
                entry.in_flight += 1
                entry.requests_total += 1
                return entry
            await self._capacity_freed.wait()

    async def _release(self, entry: BackendEntry) -> None:
        entry.in_flight -= 1
        self._wake()
        if entry.removed and entry.in_flight == 0:
            await entry.backend.close()

    async def chat(
        self,
        job_id: str,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]],
        sampling: Sampling,
    ) -> ChatResult:
        entry = await self._acquire(job_id)
        try:
            return await entry.backend.chat(messages, tools, sampling)
        except LLMError:
            entry.errors_total += 1
            raise
        finally:
            await asyncio.shield(self._release(entry))

    async def close(self) -> None:
        for entry in list(self._entries.values()):
            await entry.backend.close()
        self._entries.clear()
