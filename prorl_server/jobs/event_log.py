"""A job's events: appended in order, replayed and followed by any number of watchers.

Listeners (add_listener) are told of each event as it is appended, synchronously:
the job manager's EventWriter uses this to send running jobs' events to the store.
A listener must be quick and must not raise.

Durability (a cluster's jobs): `durable_seq` is how far the log is in the shared
store. A follower that asks for durable events only (`follow(durable_only=True)`)
never sees an event the store does not have, so that what it saw is what any
other server shows, even if this server dies the next moment. If the log can
no longer become durable (`durability_lost`), such a follower ends early and
goes on from the store.
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
        self.durable_seq = 0
        """The events up to this seq are in the store (tracked for a cluster's jobs only)."""
        self.durability_lost = False

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

    def mark_durable(self, seq: int) -> None:
        if seq > self.durable_seq:
            self.durable_seq = min(seq, len(self._events))
            self._notify()

    def lose_durability(self) -> None:
        """The rest of the log will not reach the store (its final write failed)."""
        self.durability_lost = True
        self._notify()

    def close(self) -> None:
        """No more events: followers end once they have read everything."""
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def events(self) -> list[v1.RolloutEvent]:
        return list(self._events)

    async def follow(self, after_seq: int = 0, *, durable_only: bool = False) -> AsyncIterator[v1.RolloutEvent]:
        """Events with seq > after_seq, then new ones as they come, until closed (with
        `durable_only`, each once it is in the store; see the module's docstring)."""
        index = max(after_seq, 0)
        while True:
            # Taken before reading: a change made while this generator is suspended in a yield
            # below (its reader slow, its gRPC write pending) sets this one, which the wait
            # then sees; waiting on the Event current after the yields would miss it for good.
            changed = self._changed
            limit = min(self.durable_seq, len(self._events)) if durable_only else len(self._events)
            while index < limit:
                yield self._events[index]
                index += 1
            if self.closed and (index >= len(self._events) or self.durability_lost):
                return
            if durable_only and self.durability_lost:
                return
            await changed.wait()
