"""Bearer-token authentication, in one server interceptor.

Every call must carry `authorization: Bearer <token>` with one of the
configured tokens; otherwise UNAUTHENTICATED. The health service and server
reflection stay open, so load balancers and tools can probe the server.
Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from prorl_server.api.rpc_wrapping import replace_behaviour

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MESSAGE = "missing or wrong bearer token: send the metadata `authorization: Bearer <token>`"


async def _deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)
    yield  # pragma: no cover - abort raises; this makes the function a generator


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Sequence[str]) -> None:
        self._tokens = [token.encode() for token in tokens if token]

    def _allowed(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                presented = (value if isinstance(value, str) else value.decode()).encode()
                if presented.startswith(b"Bearer "):
                    candidate = presented[len(b"Bearer ") :]
                    # Compare with every token: the time taken says nothing about which matched.
                    matches = [hmac.compare_digest(candidate, token) for token in self._tokens]
                    return any(matches)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (
            handler is None
            or method.startswith(OPEN_PREFIXES)
            or self._allowed(handler_call_details.invocation_metadata)
        ):
            return handler
        return replace_behaviour(handler, lambda _: _deny_unary, lambda _: _deny_stream)
