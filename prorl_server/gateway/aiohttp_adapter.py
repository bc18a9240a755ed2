"""Serving a `GatewayHandler` over HTTP with aiohttp: one catch-all route.

Each aiohttp request becomes an `HttpRequest` (method, path with query, lower-cased headers, the
whole body); the `HttpResponse` goes back whole, or piece by piece through a `StreamResponse`
when its body is an async iterator (server-sent events). When the client goes away mid-stream
the body's iterator is closed; `GatewayServer` also cancels the handler when the client hangs up
before the answer (a `GatewayHandler` is cancelled when the program closes its connection).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

from aiohttp import web

from prorl_server.sandbox.runtime.relay import GatewayHandler, HttpRequest, HttpResponse

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Agents send the whole conversation on every call: far over aiohttp's 1 MiB default."""

# Framing is aiohttp's to set.
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


def to_http_request(request: web.Request, body: bytes) -> HttpRequest:
    headers: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return HttpRequest(method=request.method, path=request.path_qs, headers=headers, body=body)


def _headers(response: HttpResponse) -> dict[str, str]:
    return {name: value for name, value in response.headers.items() if name.lower() not in _HOP_HEADERS}


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


def aiohttp_handler(gateway: GatewayHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = await gateway(to_http_request(request, await request.read()))
        return await write_response(request, response)

    return handle


def gateway_app(gateway: GatewayHandler, *, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    """An aiohttp application that hands every request, whatever its path and method, to `gateway`."""
    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_route("*", "/{tail:.*}", aiohttp_handler(gateway))
    return app


class GatewayServer:
    """`gateway` served on host:port (port 0: any free port; `port` and `url` once started)."""

    def __init__(self, gateway: GatewayHandler, *, host: str = "127.0.0.1", port: int = 0) -> None:
        # A client that hangs up cancels its turn (aiohttp lets handlers run on by default).
        self._runner = web.AppRunner(gateway_app(gateway), access_log=None, handler_cancellation=True)
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
