"""The framing layer of the in-sandbox runtime's protocol: a connection, and JSON
objects in and out.

Frames are an 8-byte big-endian length and UTF-8 JSON, encoded and checked by the
codec the runtime itself uses (prorl_sandbox_runtime/wire.py); an answer whose
length is over wire.MAX_REPLY breaks the connection before anything is read.
Many calls may be in flight on one connection; answers are matched by id, so
concurrent tool calls on one sandbox are safe. Outputs of many megabytes are
read with readexactly and decoded off the event loop. The typed operations
on top of it are SocketRuntime's (runtime/socket_runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Mapping
from typing import Any

from prorl_server.errors import SandboxError
from prorl_server.sandbox.runtime.prorl_sandbox_runtime import wire

# Frames larger than this are decoded in a worker thread.
INLINE_DECODE_BYTES = 1 << 20


class RuntimeOpFailed(SandboxError):
    """The runtime answered, but could not serve the request; `errno` is the cause's
    errno when it had one (EAGAIN, ENOMEM, ENOSPC tell a sandbox out of resources)."""

    reason = "sandbox_runtime"

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class RuntimeClient:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._read_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._broken: str | None = None

    @classmethod
    async def open(cls, socket_path: str) -> RuntimeClient:
        """A client connected to a runtime that answered `health`."""
        client = cls(socket_path)
        await client.connect()
        try:
            await client.call(wire.OP_HEALTH, {})
        except BaseException:
            await client.close()
            raise
        return client

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path, limit=1 << 20)
        self._read_task = asyncio.create_task(self._read_loop(), name=f"runtime-reader:{self.socket_path}")

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                header = await self._reader.readexactly(wire.HEADER.size)
                size = wire.frame_size(header, wire.MAX_REPLY, "runtime answer")
                body = await self._reader.readexactly(size)
                if size > INLINE_DECODE_BYTES:
                    reply = await asyncio.to_thread(json.loads, body)
                else:
                    reply = json.loads(body)
                future = self._pending.pop(reply.get(wire.ID), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except wire.FrameTooLarge as exc:
            self._fail(f"the sandbox runtime broke the protocol: {exc}")
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail(f"the sandbox runtime closed the connection ({type(exc).__name__})")
        except asyncio.CancelledError:
            self._fail("the runtime client was closed")
            raise

    def _fail(self, reason: str) -> None:
        self._broken = reason
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(SandboxError(reason, reason="sandbox_lost"))

    async def call(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request, {"id", "op", **fields}, and wait for its answer; RuntimeOpFailed
        when the runtime could not serve it, SandboxError when the runtime is gone."""
        if self._writer is None or self._broken:
            raise SandboxError(self._broken or "the runtime client is not connected", reason="sandbox_lost")
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        frame = wire.encode_frame({**fields, wire.ID: request_id, wire.OP: op})
        try:
            async with self._write_lock:
                self._writer.write(frame)
                await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self._pending.pop(request_id, None)
            raise SandboxError(f"cannot reach the sandbox runtime: {exc}", reason="sandbox_lost") from exc
        try:
            reply = await future
        finally:
            self._pending.pop(request_id, None)
        if not reply.get(wire.OK):
            number = reply.get(wire.ERRNO)
            raise RuntimeOpFailed(
                f"the sandbox runtime failed on {op}: {str(reply.get(wire.ERROR))[:2000]}",
                errno=number if isinstance(number, int) else None,
            )
        return reply

    async def close(self) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._read_task
            self._read_task = None
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
            self._writer = None
