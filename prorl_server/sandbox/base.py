"""The sandbox interface: one isolated container a job runs its tools in.

Two implementations behind it: the in-sandbox runtime over a Unix socket
(fast, stateful; the default) and `podman exec` (for images without python3).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class CommandResult:
    output: str
    exit_code: int | None = None
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    is_error: bool = False
    """Python raised, or the editor refused: the output says why."""


@dataclass(frozen=True)
class JudgeResult:
    """How a run of the judging harness (runtime/prorl_judge.py) ended."""

    verdict: dict[str, Any] | None
    """What the harness wrote on its verdict pipe; None when it gave none (killed,
    crashed, timed out): the judged code cannot write here, only prevent it."""
    problem: str = ""
    """Why there is no verdict."""
    output: str = ""
    """The harness's log, with what the judged code printed: for humans, never judged."""
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0


class Sandbox(abc.ABC):
    """A started container. `close()` removes it; it is idempotent."""

    id: str
    mode: str
    """"runtime" (in-sandbox runtime) or "exec" (podman exec fallback)."""
    _close_callbacks: list[Callable[[], None]]

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the sandbox is closed (e.g. to count it free)."""
        self.__dict__.setdefault("_close_callbacks", []).append(callback)

    def _closed_now(self) -> None:
        for callback in self.__dict__.pop("_close_callbacks", []):
            callback()

    @abc.abstractmethod
    async def bash(self, command: str, *, timeout_s: float) -> CommandResult:
        """Run in the sandbox's shell. A command still running after timeout_s
        is interrupted, then killed with its process group; the result says so."""

    @abc.abstractmethod
    async def python(self, code: str, *, timeout_s: float) -> CommandResult:
        """Execute Python; names persist between calls where the mode allows."""

    @abc.abstractmethod
    async def edit(self, command: str, path: str, **params: Any) -> CommandResult:
        """str_replace-style editor: view, create, str_replace, insert, undo."""

    @abc.abstractmethod
    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes: ...

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None: ...

    @abc.abstractmethod
    async def list_dir(self, path: str) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def judge(self, mode: str, spec: Mapping[str, Any], *, timeout_s: float) -> JudgeResult:
        """Run the trusted judging harness in `mode` ("function", "stdio", "swe") on
        `spec`; it is killed with everything it started after timeout_s. Its verdict
        comes back on a channel the judged code can neither reach nor forge."""

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
