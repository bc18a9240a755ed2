"""A concurrency limit per phase, granting slots by priority then arrival."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prorl_client import v1


class PhaseGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def queued(self) -> int:
        return sum(1 for _, _, future in self._waiters if not future.done())

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        if self.active < self.limit and self.queued == 0:
            self.active += 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (-priority, next(self._arrivals), future))
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release()  # granted just as we were cancelled
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self.active -= 1
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                self.active += 1
                future.set_result(None)
                return


def phase_gates(*, init: int, run: int, eval: int) -> dict[v1.Phase, PhaseGate]:
    """One gate per phase, with the limits of settings.phases."""
    return {v1.PHASE_INIT: PhaseGate(init), v1.PHASE_RUN: PhaseGate(run), v1.PHASE_EVAL: PhaseGate(eval)}
