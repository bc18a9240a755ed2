"""The container handle: how a started sandbox is looked at and removed.

Owned by the provider that started the sandbox (its lifecycle side), kept apart
from what can be done inside it (sandbox/runtime/abstract.py). Implementations:
`PodmanContainer` (podman/container.py) and the test fake's
(tests/fakes/sandbox_provider.py).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prorl_server.sandbox.runtime.abstract import SandboxRuntime


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

    async def reset(self, runtime: SandboxRuntime) -> list[str]:
        """Bring the sandbox back to how it was new, through `runtime`, and prove it: the
        problems found, [] only when nothing of what ran in it is left. A sandbox with any
        problem must not serve another job. By default: not resettable."""
        return ["this provider's sandboxes cannot be reset"]
