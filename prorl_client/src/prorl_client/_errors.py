"""The client's one exception type.

Exception tree::

    RpcError          any failed call; `.code` is the grpc.StatusCode,
                      `.details` the server's message, `.metadata` the
                      status's trailing metadata (`.reason`, the server's
                      error reason; `.resume_cursor`, where a Subscribe
                      stream that ended can go on)
"""

from __future__ import annotations

import grpc


class RpcError(Exception):
    """A call to the prorl server failed."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = dict(metadata or {})

    @property
    def reason(self) -> str:
        return self.metadata.get("prorl-error-reason", "")

    @property
    def resume_cursor(self) -> str:
        return self.metadata.get("prorl-resume-cursor", "")

    @classmethod
    def from_grpc(cls, exc: grpc.aio.AioRpcError) -> RpcError:
        trailing = exc.trailing_metadata() or ()
        metadata = {str(key): value for key, value in trailing if isinstance(value, str)}
        return cls(exc.code(), exc.details() or "", metadata)
