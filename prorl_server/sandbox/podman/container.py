"""The Podman provider's handle on one of its containers (see sandbox/handle.py).

A view bound to the provider that created the container: removal, inspection
and the limits go through the provider, which owns its threads, its Podman
client, its cgroups and its slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prorl_server.sandbox.handle import ContainerHandle
from prorl_server.sandbox.runtime.abstract import SandboxRuntime

if TYPE_CHECKING:
    from prorl_server.sandbox.blame import HostView
    from prorl_server.sandbox.podman.reset_check import Snapshot


class ContainerOwner(Protocol):
    """What the handle asks of the provider that created the container (PodmanProvider)."""

    async def remove(self, name: str) -> None: ...

    async def describe(self, name: str) -> str: ...

    async def limits_hit(self, name: str) -> list[str]: ...

    async def writable_layer_bytes(self, name: str) -> int: ...

    async def reset(self, handle: PodmanContainer, runtime: SandboxRuntime) -> list[str]: ...


class PodmanContainer(ContainerHandle):
    def __init__(self, provider: ContainerOwner, name: str) -> None:
        self._provider = provider
        self.name = name
        self.view: HostView | None = None
        """The container's init and runtime on the host, when the server can see them."""
        self.pristine: Snapshot | None = None
        """What a reset must bring it back to (reset_check.py); None: it cannot be reset."""

    @property
    def id(self) -> str:
        return self.name

    async def remove(self) -> None:
        await self._provider.remove(self.name)

    async def describe(self) -> str:
        return await self._provider.describe(self.name)

    async def limits_hit(self) -> list[str]:
        return await self._provider.limits_hit(self.name)

    async def writable_layer_bytes(self) -> int:
        """Bytes of the container's writable layer (its own writes); 0 when not known."""
        return await self._provider.writable_layer_bytes(self.name)

    async def reset(self, runtime: SandboxRuntime) -> list[str]:
        return await self._provider.reset(self, runtime)

    def __repr__(self) -> str:
        return f"PodmanContainer({self.name!r})"
