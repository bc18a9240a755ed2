"""The server's end of the HTTP relay: a loopback endpoint inside a network-less sandbox.

`SocketRelay.open` connects to the in-sandbox runtime's Unix socket on a
connection of its own and sends `{"id": 1, "op": "gateway", "port": P, "max_body": B}`;
the runtime listens on the sandbox's loopback (127.0.0.1:P, P=0 any free port),
answers 413 to any request whose body would exceed B bytes before reading it, and
answers `{"id": 1, "ok": true, "port": bound}`. From then on the connection
carries relay frames (8-byte big-endian length + JSON, as every runtime frame, in
the codec and words of prorl_sandbox_runtime/wire.py, which the runtime uses too),
each naming its exchange (one HTTP request and its response) by `gw`:

    runtime -> server  {"gw": k, "type": "request", "method", "path", "headers": [[name, value], ...],
                        "body_b64"}
                       {"gw": k, "type": "cancel"}     the program went away before the end
    server -> runtime  {"gw": k, "type": "response", "status", "headers": [[name, value], ...]}
                       {"gw": k, "type": "chunk", "data_b64"}    any number of them
                       {"gw": k, "type": "end"}        or with "error": the body broke off

Each request is served in an asyncio task of its own that awaits the
`RelayHandler` (relay.py); a body given whole is relayed with its
Content-Length, an async iterator piece by piece as it yields (the runtime
writes those with chunked encoding, flushed at once: server-sent events arrive
as they are produced). A `cancel` cancels the handler's task; a handler that
raises is answered with 500 and a short JSON error. Closing either end closes
the listener inside the sandbox.

Memory per request: the frame's bytes are dropped once decoded, its base64 text
once the body is decoded (taken out of the frame, which the read loop still
names), and the handler takes the body from the `HttpRequest` it parses
(relay.py), so no copy of a large body outlives the step that needs it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import structlog

from prorl_server.errors import SandboxError
from prorl_server.sandbox.runtime.client import RuntimeOpFailed
from prorl_server.sandbox.runtime.prorl_sandbox_runtime import wire
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse, RelayHandle, RelayHandler

log = structlog.get_logger(__name__)

MAX_FRAME = wire.MAX_RELAY
PIECE_BYTES = 1 << 20
"""A body (or a piece an iterator yields) is relayed in chunks of at most this."""
INLINE_BYTES = 1 << 20
"""Larger frames are decoded in a worker thread, never on the event loop."""
OPEN_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0
"""How long `close()` waits for the runtime to confirm that its listener is closed."""


def error_response(status: int, message: str) -> HttpResponse:
    """A short JSON error, shaped as OpenAI-compatible APIs shape theirs."""
    body = json.dumps({"error": {"message": message, "type": "gateway_error", "code": status}}).encode()
    return HttpResponse(status, {"content-type": "application/json"}, body)


def _encode(message: Mapping[str, Any]) -> bytes:
    return wire.encode_frame(message, compact=True)


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame; wire.FrameTooLarge (a ValueError) over MAX_FRAME, before reading its body."""
    size = wire.frame_size(await reader.readexactly(wire.HEADER.size), MAX_FRAME, "relay frame")
    body = await reader.readexactly(size)
    if size > INLINE_BYTES:
        return await asyncio.to_thread(json.loads, body)
    return json.loads(body)


def _checked(response: Any) -> HttpResponse:
    """The handler's answer, if it is one the relay can send (else TypeError, answered 500)."""
    if not isinstance(response, HttpResponse):
        raise TypeError(f"the handler returned {type(response).__name__}, not an HttpResponse")
    if not isinstance(response.status, int) or not 200 <= response.status <= 599:
        raise TypeError(f"the handler returned status {response.status!r}, not one of 200-599")
    if not isinstance(response.body, bytes | bytearray | memoryview) and not hasattr(response.body, "__aiter__"):
        raise TypeError(f"the handler returned a body of {type(response.body).__name__}: bytes or an async iterator")
    return response


def _request_of(frame: dict[str, Any]) -> HttpRequest:
    """The handler's view of a request frame; header names lower-cased, repeated ones joined
    with ", " (as HTTP allows). The base64 body is taken out of the frame. Raises ValueError or
    TypeError on a malformed frame."""
    method, path = frame["method"], frame["path"]
    if not isinstance(method, str) or not isinstance(path, str):
        raise TypeError("method and path must be strings")
    headers: dict[str, str] = {}
    for name, value in frame.get("headers") or []:
        key = str(name).lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else str(value)
    body = base64.b64decode(frame.pop("body_b64", None) or "", validate=True)
    return HttpRequest(method=method, path=path, headers=headers, body=body)


class SocketRelay(RelayHandle):
    """A relay over a dedicated connection to the in-sandbox runtime (see the module's docstring)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: RelayHandler,
        *,
        port: int,
        hosts: list[str],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._port = port
        self.hosts = hosts
        """The loopback addresses listened on: 127.0.0.1, and ::1 when the sandbox has IPv6."""
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._read_task: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        socket_path: str,
        handler: RelayHandler,
        *,
        port: int = 0,
        timeout_s: float = OPEN_TIMEOUT_S,
        max_body_bytes: int | None = None,
    ) -> SocketRelay:
        """Connect to the runtime at `socket_path` and have it listen on `port` (0: any free
        one), refusing bodies over `max_body_bytes` (None: the handler's `max_request_bytes`,
        else the runtime's own 64 MiB). SandboxError when the runtime cannot be reached,
        RuntimeOpFailed when it cannot listen (the port is taken: errno EADDRINUSE)."""
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is not a TCP port")
        if max_body_bytes is None:
            limit = getattr(handler, "max_request_bytes", None)
            max_body_bytes = limit if isinstance(limit, int) else None
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_unix_connection(socket_path)
        except (OSError, TimeoutError) as exc:
            raise SandboxError(
                f"cannot reach the sandbox runtime to open the HTTP relay: {str(exc) or type(exc).__name__}",
                reason="sandbox_lost",
            ) from exc
        try:
            async with asyncio.timeout(timeout_s):
                opening: dict[str, Any] = {wire.ID: 1, wire.OP: wire.OP_RELAY, "port": port}
                if max_body_bytes is not None:
                    opening["max_body"] = max_body_bytes
                writer.write(_encode(opening))
                await writer.drain()
                reply = await _read_frame(reader)
            if not isinstance(reply, dict) or reply.get("id") != 1:
                raise ValueError(f"unexpected answer {str(reply)[:200]}")
            if not reply.get("ok"):
                number = reply.get("errno")
                raise RuntimeOpFailed(
                    f"the sandbox runtime could not open the relay on port {port}: {str(reply.get('error'))[:500]}",
                    errno=number if isinstance(number, int) else None,
                )
            bound = reply.get("port")
            if not isinstance(bound, int) or not 0 < bound <= 65535:
                raise ValueError(f"the answer names no port: {str(reply)[:200]}")
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as exc:
            writer.close()
            raise SandboxError(
                f"the sandbox runtime did not open the HTTP relay: {str(exc) or type(exc).__name__}",
                reason="sandbox_lost",
            ) from exc
        except BaseException:
            writer.close()
            raise
        hosts = [str(host) for host in reply.get("hosts") or ["127.0.0.1"]]
        relay = cls(reader, writer, handler, port=bound, hosts=hosts)
        relay._read_task = asyncio.create_task(relay._read_loop(), name=f"relay-reader:{bound}")
        return relay

    @property
    def port(self) -> int:
        return self._port

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """Requests whose handler is running or whose response is being relayed."""
        return len(self._tasks)

    async def close(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    # --- the relay ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = None  # the last frame (its body is its task's) is not kept while waiting
                frame = await _read_frame(self._reader)
                if not isinstance(frame, dict):
                    continue
                number, kind = frame.get(wire.EXCHANGE), frame.get(wire.TYPE)
                if not isinstance(number, int):
                    continue
                if kind == wire.RELAY_REQUEST and number not in self._tasks and not self._closed:
                    task = asyncio.create_task(self._serve(number, frame), name=f"relay:{self._port}:{number}")
                    self._tasks[number] = task
                    task.add_done_callback(functools.partial(self._forget, number))
                elif kind == wire.RELAY_CANCEL and number in self._tasks:
                    self._tasks[number].cancel()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError):
            pass  # the runtime closed the relay (or its sandbox is gone)
        finally:
            self._closed = True
            for task in self._tasks.values():
                task.cancel()
            if self._closing is None:  # the runtime ended it: nothing more will be sent either
                self._writer.close()

    def _forget(self, number: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(number) is task:
            del self._tasks[number]
        if not task.cancelled() and task.exception() is not None:
            log.error("relay_exchange_failed", port=self._port, error=repr(task.exception()))

    async def _send(self, *messages: Mapping[str, Any]) -> None:
        """Frames, in one write."""
        if self._closed:
            raise ConnectionResetError("the relay is closed")
        self._writer.write(b"".join(_encode(message) for message in messages))
        await self._writer.drain()

    async def _serve(self, number: int, frame: dict[str, Any]) -> None:
        try:
            refused = self._refusal(frame)
            if refused is not None:  # answered from the head: the body is never decoded
                frame.pop("body_b64", None)
                await self._respond(number, refused)
                return
            try:
                if len(str(frame.get("body_b64") or "")) > INLINE_BYTES:
                    request = await asyncio.to_thread(_request_of, frame)
                else:
                    request = _request_of(frame)
            except (KeyError, TypeError, ValueError):
                await self._respond(number, error_response(400, "the relayed request was malformed"))
                return
            try:
                response = _checked(await self._handler(request))
            except Exception as exc:
                log.warning(
                    "relay_handler_failed", port=self._port, method=request.method, path=request.path, exc_info=exc
                )
                response = error_response(500, f"the gateway's handler failed ({type(exc).__name__})")
            await self._respond(number, response)
        except (ConnectionError, OSError):
            pass  # the relay is gone: nobody is left to answer

    def _refusal(self, frame: dict[str, Any]) -> HttpResponse | None:
        """The handler's answer from the request's head alone, when it has an `admit` (the model
        gateway: a bad key, too many calls at once, a body over its limit)."""
        admit = getattr(self._handler, "admit", None)
        if admit is None:
            return None
        try:
            head = _request_of({**frame, "body_b64": ""})
        except (KeyError, TypeError, ValueError):
            return None  # answered 400 as malformed below
        answer = admit(head)
        return answer if isinstance(answer, HttpResponse) else None

    async def _respond(self, number: int, response: HttpResponse) -> None:
        body = response.body
        headers = [[str(name), str(value)] for name, value in response.headers.items()]
        if isinstance(body, bytes | bytearray | memoryview):
            body = bytes(body)
            if not any(name.lower() == "content-length" for name, _ in headers):
                headers.append(["content-length", str(len(body))])
        head = {
            wire.EXCHANGE: number,
            wire.TYPE: wire.RELAY_RESPONSE,
            "status": int(response.status),
            "headers": headers,
        }
        if isinstance(body, bytes):
            end = {wire.EXCHANGE: number, wire.TYPE: wire.RELAY_END}
            if len(body) <= PIECE_BYTES:  # the whole response in one write
                data = (
                    [{wire.EXCHANGE: number, wire.TYPE: wire.RELAY_CHUNK, "data_b64": base64.b64encode(body).decode()}]
                    if body
                    else []
                )
                await self._send(head, *data, end)
                return
            await self._send(head)
            await self._send_data(number, body)
            await self._send(end)
            return
        await self._send(head)
        await self._relay_stream(number, body)

    async def _relay_stream(self, number: int, body: AsyncIterator[bytes]) -> None:
        try:
            async for piece in body:
                await self._send_data(number, piece.encode() if isinstance(piece, str) else bytes(piece))
        except (asyncio.CancelledError, ConnectionError, OSError):
            raise
        except Exception as exc:
            log.warning("relay_body_failed", port=self._port, exc_info=exc)
            await self._send(
                {
                    wire.EXCHANGE: number,
                    wire.TYPE: wire.RELAY_END,
                    "error": f"the body broke off ({type(exc).__name__})",
                }
            )
            return
        finally:
            close = getattr(body, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        await self._send({wire.EXCHANGE: number, wire.TYPE: wire.RELAY_END})

    async def _send_data(self, number: int, data: bytes) -> None:
        for start in range(0, len(data), PIECE_BYTES):
            piece = base64.b64encode(data[start : start + PIECE_BYTES]).decode()
            await self._send({wire.EXCHANGE: number, wire.TYPE: wire.RELAY_CHUNK, "data_b64": piece})

    async def _close(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Half-close: the runtime closes its listener, then the connection; its EOF tells
        # that the port inside the sandbox is free.
        with contextlib.suppress(OSError, RuntimeError):
            if self._writer.can_write_eof():
                self._writer.write_eof()
        reader = self._read_task
        if reader is not None:
            await asyncio.wait({reader}, timeout=CLOSE_TIMEOUT_S)
            reader.cancel()
            await asyncio.wait({reader})
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()

    def __repr__(self) -> str:
        return f"SocketRelay(port={self._port}, closed={self._closed}, in_flight={len(self._tasks)})"
