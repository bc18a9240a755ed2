"""The sandbox layer's public face: what a job asks for, the provider interface, and
the labels every provider puts on its containers.

Two extension points, each with its own interface:
- *what can be done in a sandbox*: `SandboxRuntime` (runtime/abstract.py),
  typed requests and responses per operation (runtime/protocol.py);
- *how a sandbox is started and stopped*: `SandboxProvider` (here), which
  returns a `Sandbox` (sandbox.py) made of a runtime and a `ContainerHandle`
  (handle.py) that it owns.

Providers: `PodmanProvider` (podman/), and the in-process fake for tests
(tests/fakes/sandbox_provider.py).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field

from prorl_server.sandbox.handle import ContainerHandle
from prorl_server.sandbox.runtime.abstract import SandboxRuntime
from prorl_server.sandbox.runtime.protocol import CommandResult, JudgeResult
from prorl_server.sandbox.sandbox import Sandbox

__all__ = [
    "LABEL_JOB",
    "LABEL_MANAGED",
    "LABEL_POOL",
    "LABEL_SERVER",
    "CommandResult",
    "ContainerHandle",
    "JudgeResult",
    "Sandbox",
    "SandboxProvider",
    "SandboxRuntime",
    "SandboxSpec",
]

LABEL_MANAGED = "prorl.managed"
"""Every sandbox container of any prorl server: "1"."""
LABEL_SERVER = "prorl.server"
"""The instance id of the server that created it: cleanup removes exactly its own."""
LABEL_JOB = "prorl.job"
"""The job a sandbox was opened for."""
LABEL_POOL = "prorl.pool"
"""Set ("warm") on the sandboxes a warm pool keeps ready."""


@dataclass(frozen=True)
class SandboxSpec:
    """What a job asks of its sandbox. Network access is never granted."""

    image: str
    cpus: float
    memory_mib: int
    pids_limit: int
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def pool_key(self) -> tuple[str, float, int, int]:
        """Sandboxes with the same key are interchangeable (warm pools)."""
        return (self.image, self.cpus, self.memory_mib, self.pids_limit)


class SandboxProvider(abc.ABC):
    """Creates sandboxes and owns their cleanup."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect, and remove containers a previous run of this server left behind."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A started sandbox, its runtime answering; `Sandbox.close()` removes it. Raises
        SandboxError (reason sandbox_image, sandbox_start, ...) when none can be had."""

    @property
    @abc.abstractmethod
    def busy(self) -> int:
        """Sandboxes created and not yet removed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Remove every sandbox this server created."""
