"""A job's events: appended in order, replayed and followed by any number of watchers.

Listeners (add_listener) are told of each event as it is appended, synchronously:
the job manager's EventWriter uses this to send running jobs' events to the store.
A listener must be quick and must not raise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from prorl_client import v1

Listener = Callable[[v1.RolloutEvent], None]


class EventLog:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._events: list[v1.RolloutEvent] = []
        self._changed = asyncio.Event()
        self.closed = False
        self._listeners: list[Listener] = []

    @classmethod
    def restored(cls, job_id: str, events: list[v1.RolloutEvent], *, closed: bool = True) -> EventLog:
        """A log holding the events of a job stored before a restart (seq 1..n, in order);
        closed unless `closed=False` (more events are to be appended)."""
        log = cls(job_id)
        log._events = list(events)
        log.closed = closed
        return log

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(event)` for every event appended from now on."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @property
    def last_seq(self) -> int:
        return len(self._events)

    def append(self, **kind: Any) -> v1.RolloutEvent:
        """Append one event, e.g. `append(queued=v1.JobQueued())`. Sequence numbers start at 1."""
        if self.closed:
            raise RuntimeError(f"event log of {self.job_id} is closed")
        stamp = Timestamp()
        stamp.FromNanoseconds(time.time_ns())
        event = v1.RolloutEvent(job_id=self.job_id, seq=len(self._events) + 1, time=stamp, **kind)
        self._events.append(event)
        self._notify()
        for listener in tuple(self._listeners):
            listener(event)
        return event

    def close(self) -> None:
        """No more events: followers end once they have read everything."""
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def events(self) -> list[v1.RolloutEvent]:
        return list(self._events)

    async def follow(self, after_seq: int = 0) -> AsyncIterator[v1.RolloutEvent]:
        """Events with seq > after_seq, then new ones as they come, until closed."""
        index = max(after_seq, 0)
        while True:
            while index < len(self._events):
                yield self._events[index]
                index += 1
            if self.closed:
                return
            await self._changed.wait()
