"""Maps the server's exceptions to gRPC status codes, in one interceptor.

A ProrlError becomes its status code with its message; anything else is a bug:
logged with its traceback, sent as INTERNAL without one.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from prorl_server import errors
from prorl_server.api.rpc_wrapping import replace_behaviour

log = structlog.get_logger(__name__)

STATUS_CODES: dict[type[errors.ProrlError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.InfrastructureError: grpc.StatusCode.UNAVAILABLE,
}
REASON_METADATA_KEY = "prorl-error-reason"


def status_code(exc: errors.ProrlError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    if isinstance(exc, errors.ProrlError):
        context.set_trailing_metadata(((REASON_METADATA_KEY, exc.reason), *exc.metadata.items()))
        await context.abort(status_code(exc), exc.message)
    log.exception("rpc_failed", method=method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # A streaming method may also be a coroutine that writes with
        # context.write() (grpc's own health Watch does): wrap it as one.
        return _wrap_unary(behavior, method)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, method)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return replace_behaviour(
            handler,
            lambda behaviour: _wrap_unary(behaviour, method),
            lambda behaviour: _wrap_stream(behaviour, method),
        )
