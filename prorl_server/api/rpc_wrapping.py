"""Rebuilding a gRPC method handler around new behaviour, whatever its streaming shape.

Interceptors of grpc.aio cannot wrap a call directly: they return a handler.
This keeps the request/response codec and swaps the behaviour, choosing the
unary-response or streaming-response replacement by the handler's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behaviour = Callable[..., Any]


def replace_behaviour(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Behaviour], Behaviour],
    streaming: Callable[[Behaviour], Behaviour],
) -> grpc.RpcMethodHandler:
    """A handler whose behaviour is `unary(old)` for single responses and `streaming(old)` for streams."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **codec)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **codec)
    return handler
