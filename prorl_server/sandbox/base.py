"""The sandbox interface: one isolated container a job runs its tools in."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SandboxSpec:
    """What a job asks of its sandbox. Network access is never granted."""

    image: str
    cpus: float
    memory_mib: int
    pids_limit: int
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    output: str
    truncated: bool
    timed_out: bool
    duration_s: float


class Sandbox(abc.ABC):
    """A started container. `close()` removes it; it is idempotent."""

    id: str

    @abc.abstractmethod
    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run argv in the sandbox; stdout and stderr merged, output capped.

        A command still running after timeout_s is killed (with its process
        group) and the result says timed_out.
        """

    @abc.abstractmethod
    async def close(self) -> None: ...


class SandboxProvider(abc.ABC):
    """Creates sandboxes and owns their cleanup."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect, and remove containers a previous run of this server left behind."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox: ...

    @property
    @abc.abstractmethod
    def busy(self) -> int:
        """Sandboxes created and not yet closed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Remove every sandbox this server created."""
