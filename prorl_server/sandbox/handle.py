"""The container handle: how a started sandbox is looked at and removed.

Owned by the provider that started the sandbox (its lifecycle side), kept apart
from what can be done inside it (sandbox/runtime/abstract.py). Implementations:
`PodmanContainer` (podman/container.py) and the test fake's
(tests/fakes/sandbox_provider.py).
"""

from __future__ import annotations

import abc


class ContainerHandle(abc.ABC):
    @property
    @abc.abstractmethod
    def id(self) -> str:
        """The sandbox's id, as the provider names it (for Podman, what `podman ps` shows)."""

    @abc.abstractmethod
    async def remove(self) -> None:
        """Remove the container with everything started in it and everything the provider
        made for it; the provider no longer counts it busy. Idempotent."""

    @abc.abstractmethod
    async def describe(self) -> str:
        """The container's state and last log lines, for error messages. Never raises."""

    @abc.abstractmethod
    async def limits_hit(self) -> list[str]:
        """The sandbox's limits it ran into so far, e.g. ["pids"], ["memory"]; [] when
        none or not known."""
