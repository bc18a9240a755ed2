"""The client's one exception type.

Exception tree::

    RpcError          any failed call; `.code` is the grpc.StatusCode,
                      `.details` the server's message
"""

from __future__ import annotations

import grpc


class RpcError(Exception):
    """A call to the prorl server failed."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_grpc(cls, exc: grpc.aio.AioRpcError) -> RpcError:
        return cls(exc.code(), exc.details() or "")
