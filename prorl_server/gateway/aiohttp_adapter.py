"""Serving a `RelayHandler` over HTTP with aiohttp: one catch-all route.

Each aiohttp request becomes an `HttpRequest` (method, path with query, lower-cased headers, the
whole body); the `HttpResponse` goes back whole, or piece by piece through a `StreamResponse`
when its body is an async iterator (server-sent events). When the client goes away mid-stream
the body's iterator is closed; `GatewayServer` also cancels the handler when the client hangs up
before the answer (a `RelayHandler` is cancelled when the program closes its connection).

Before a body is read, a handler with an `admit(request)` method (the server's gateway directory)
is asked about the request's head: its refusal (a 401 for an unknown job or a bad key, a 413 for a
declared body over the limit) is sent with nothing of the body read, and the connection closed.
The body must then arrive within `body_timeout_s` (else 408 and the connection closed). A
connection must bring a request's whole head within `header_timeout_s` of being opened or of its
last answer (aiohttp's keep-alive timer, which also runs on a fresh connection and is not reset by
partial data): else it is closed, so a client trickling header bytes holds no connection for long.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from aiohttp import web

from prorl_server.sandbox.runtime.prorl_sandbox_runtime.http_request import HOP_BY_HOP
from prorl_server.sandbox.runtime.relay import HttpRequest, HttpResponse, RelayHandler

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Agents send the whole conversation on every call: far over aiohttp's 1 MiB default. The job's
own limit (gateway.max_request_bytes, its gateway's `admit`) is usually lower."""
BODY_TIMEOUT_S = 60.0
HEADER_TIMEOUT_S = 30.0
"""Also how long an idle keep-alive connection stays open (SDK clients drop theirs sooner: httpx
after 5 s, Node's after 4 s)."""
PIECE_BYTES = 1 << 20


def to_http_request(request: web.Request, body: bytes = b"") -> HttpRequest:
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return HttpRequest(method=request.method, path=request.path_qs, headers=headers, body=body)


def _headers(response: HttpResponse) -> dict[str, str]:
    """The answer's end-to-end headers. The hop-by-hop ones (HOP_BY_HOP: RFC 7230 section 6.1's and
    Proxy-Connection) and the framing (aiohttp's to set) are dropped: the one list the sandbox's
    relay drops too."""
    return {name: value for name, value in response.headers.items() if name.lower() not in HOP_BY_HOP}


async def write_response(request: web.Request, response: HttpResponse) -> web.StreamResponse:
    """Send `response` for `request`: whole, or streamed piece by piece."""
    body = response.body
    if isinstance(body, bytes):
        return web.Response(status=response.status, headers=_headers(response), body=body)
    stream = web.StreamResponse(status=response.status, headers=_headers(response))
    try:
        await stream.prepare(request)
        async for piece in body:
            await stream.write(piece)
        await stream.write_eof()
    finally:
        if isinstance(body, AsyncGenerator):
            await body.aclose()
    return stream


def _refusal(status: int, message: str) -> web.Response:
    response = web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)
    response.force_close()
    return response


async def read_body(request: web.Request, *, max_bytes: int, timeout_s: float) -> bytes | web.Response:
    """The body, read piece by piece (aiohttp's own `read()` would keep a second copy on the
    request), or the refusal when it is too large or too slow."""
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.content.iter_chunked(PIECE_BYTES):
                body += piece
                if len(body) > max_bytes:
                    return _refusal(413, f"request body larger than {max_bytes} bytes")
    except TimeoutError:
        return _refusal(408, f"the request body did not arrive within {timeout_s:g}s")
    data = bytes(body)
    del body
    return data


def aiohttp_handler(
    gateway: RelayHandler, *, max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    admit: Callable[[HttpRequest], HttpResponse | None] | None = getattr(gateway, "admit", None)

    async def handle(request: web.Request) -> web.StreamResponse:
        head = to_http_request(request)
        refused = admit(head) if admit is not None else None
        if refused is not None:
            response = await write_response(request, refused)
            response.force_close()  # the body, if any, is never read
            return response
        body = await read_body(request, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
        if isinstance(body, web.Response):
            return body
        head.body = body
        del body
        return await write_response(request, await gateway(head))

    return handle


def gateway_app(
    gateway: RelayHandler, *, max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S
) -> web.Application:
    """An aiohttp application that hands every request, whatever its path and method, to `gateway`."""
    app = web.Application(client_max_size=max_body_bytes)
    handler = aiohttp_handler(gateway, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


class GatewayServer:
    """`gateway` served on host:port (port 0: any free port; `port` and `url` once started)."""

    def __init__(
        self,
        gateway: RelayHandler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        body_timeout_s: float = BODY_TIMEOUT_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        # A client that hangs up cancels its turn (aiohttp lets handlers run on by default). A body
        # left unread (a refusal) is not drained: the connection is closed (lingering_time 0).
        self._runner = web.AppRunner(
            gateway_app(gateway, body_timeout_s=body_timeout_s),
            access_log=None,
            handler_cancellation=True,
            lingering_time=0.0,
            keepalive_timeout=header_timeout_s,
        )
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """The base URL (no `/v1`)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        await self._runner.cleanup()
