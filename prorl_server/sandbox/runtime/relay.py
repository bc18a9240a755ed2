"""HTTP exchanges relayed between a program inside a sandbox and the server.

The in-sandbox runtime listens on the sandbox's own loopback and hands each
HTTP request it receives to the server over its Unix socket; the server
answers with a status, headers and a body that may stream. These are the
values on the server's side: the relay (socket_relay.py) builds an
`HttpRequest` and runs a `RelayHandler` on it; the model gateway
(prorl_server/gateway/) is such a handler.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field


@dataclass
class HttpRequest:
    method: str
    path: str
    """The request target as sent: path and query string."""
    headers: Mapping[str, str]
    """Header names in lower case."""
    body: bytes = b""
    """Empty once taken (`take_body`)."""

    def take_body(self) -> bytes:
        """The body, which this request then no longer holds: whoever parses it is its only
        holder, so a large body is freed as soon as it is parsed (not at the end of the call)."""
        body, self.body = self.body, b""
        return body


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | AsyncIterator[bytes] = b""
    """The whole body, or its pieces as they come (server-sent events): each piece is
    relayed to the program as soon as it is produced."""


RelayHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]
"""Answers one relayed request. Cancelled when the program closes its connection."""


class RelayHandle(abc.ABC):
    """An open relay: the sandbox's runtime listens on its loopback at `port` and relays
    what it receives to a handler. `close()` stops it (the port refuses connections once it
    returns); it is idempotent. A relay also closes when its sandbox does."""

    @property
    @abc.abstractmethod
    def port(self) -> int:
        """The port bound inside the sandbox, on 127.0.0.1 (and on [::1] when the sandbox has IPv6)."""

    @property
    def url(self) -> str:
        """The base URL a program inside the sandbox uses, e.g. http://127.0.0.1:8000."""
        return f"http://127.0.0.1:{self.port}"

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Closed by `close()`, or because the runtime (or the sandbox) went away."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening, cancel the handler calls in flight and cut the program's connections."""
