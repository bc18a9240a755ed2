"""PostgreSQL LISTEN/NOTIFY for one server: one connection, many waiters.

The store NOTIFYs after every change others must see (cluster/store.py): new
events of a job (channel prorl_events, payload the job id), a job queued
(prorl_queue), a cancel asked (prorl_cancel, the job id), an admin operation
(prorl_admin). One connection of its own LISTENs to all of them and wakes:

- the watchers of a job (`waiter(job_id)`), who then read the new events by
  seq from the store;
- the callbacks of a channel (`on(channel, callback)`), e.g. the claim loop.

A notification can be missed (the connection drops, the database restarts):
so the connection is watched and opened again, and each reconnection wakes
everyone as if everything had changed; the readers poll as well, slowly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterator

import asyncpg
import structlog

from prorl_server.cluster.store import ADMIN_CHANNEL, CANCEL_CHANNEL, EVENTS_CHANNEL, QUEUE_CHANNEL

log = structlog.get_logger(__name__)

CHANNELS = (EVENTS_CHANNEL, QUEUE_CHANNEL, CANCEL_CHANNEL, ADMIN_CHANNEL)
CHECK_S = 0.5
"""How often the connection is checked (a closed one is opened again)."""
RECONNECT_S = (0.2, 5.0)
"""First and longest pause between attempts to reconnect."""

Callback = Callable[[str], None]


class Notifications:
    def __init__(self, url: str, *, connect_timeout_s: float = 10.0) -> None:
        self._url = url
        self._connect_timeout_s = connect_timeout_s
        self._callbacks: dict[str, list[Callback]] = collections.defaultdict(list)
        self._waiters: dict[str, set[asyncio.Event]] = collections.defaultdict(set)
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    def on(self, channel: str, callback: Callback) -> None:
        """Call `callback(payload)` for each notification on `channel`, and with "" after
        each reconnection. It must be quick and must not raise."""
        self._callbacks[channel].append(callback)

    @contextlib.contextmanager
    def waiter(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set when the job's events may have changed; the holder clears it
        before reading the store."""
        changed = asyncio.Event()
        self._waiters[job_id].add(changed)
        try:
            yield changed
        finally:
            waiting = self._waiters.get(job_id)
            if waiting is not None:
                waiting.discard(changed)
                if not waiting:
                    del self._waiters[job_id]

    async def start(self) -> None:
        """Connect (raises if the database cannot be reached now) and keep connected."""
        await self._connect()
        self._task = asyncio.create_task(self._keep_connected(), name="cluster-notifications")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._disconnect()

    async def _connect(self) -> None:
        conn = await asyncpg.connect(self._url, timeout=self._connect_timeout_s)
        try:
            for channel in CHANNELS:
                await conn.add_listener(channel, self._received)
        except BaseException:
            await conn.close(timeout=2)
            raise
        self._conn = conn
        self.connected.set()

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        self.connected.clear()
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), 2)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                conn.terminate()

    async def _keep_connected(self) -> None:
        pause = RECONNECT_S[0]
        while True:
            await asyncio.sleep(CHECK_S)
            if self._conn is not None and not self._conn.is_closed():
                continue
            if self.connected.is_set():
                log.warning("cluster_notifications_lost")
                await self._disconnect()
            try:
                await self._connect()
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.debug("cluster_notifications_reconnect_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_S[1])
                continue
            pause = RECONNECT_S[0]
            log.info("cluster_notifications_reconnected")
            self._wake_everyone()

    def _received(self, _conn: object, _pid: int, channel: str, payload: object) -> None:
        payload = str(payload)
        if channel == EVENTS_CHANNEL:
            for changed in self._waiters.get(payload, ()):
                changed.set()
        for callback in self._callbacks.get(channel, ()):
            callback(payload)

    def _wake_everyone(self) -> None:
        for waiting in self._waiters.values():
            for changed in waiting:
                changed.set()
        for callbacks in self._callbacks.values():
            for callback in callbacks:
                callback("")
