"""The runtime interface: what can be done in a started sandbox.

How the sandbox is started and removed is not a runtime's business (see
sandbox/handle.py and the providers). Implementations: `SocketRuntime`
(runtime/socket_runtime.py, the in-sandbox runtime over a Unix socket: fast,
stateful, the default) and `ExecRuntime` (podman/exec_runtime.py, one
`podman exec` per call, for images without python3).
"""

from __future__ import annotations

import abc
from typing import ClassVar, Literal

from prorl_server.errors import SandboxError
from prorl_server.sandbox.runtime.protocol import (
    BashRequest,
    BashResponse,
    EditRequest,
    EditResponse,
    HealthRequest,
    HealthResponse,
    JudgeRequest,
    JudgeResponse,
    ListDirRequest,
    ListDirResponse,
    PythonRequest,
    PythonResponse,
    ReadFileRequest,
    ReadFileResponse,
    ResetRequest,
    ResetResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from prorl_server.sandbox.runtime.relay import RelayHandle, RelayHandler

RuntimeMode = Literal["runtime", "exec"]


class SandboxRuntime(abc.ABC):
    """One method per operation, each taking one request and returning one response.

    A call that cannot be served raises `SandboxError` (INFRASTRUCTURE), or a
    `SandboxBroken` when the evidence shows that the agent's own commands broke
    the sandbox (POLICY, see sandbox/blame.py). A command that ran and failed is
    a response, not an exception."""

    mode: ClassVar[RuntimeMode]
    """"runtime" (the in-sandbox runtime) or "exec" (the `podman exec` fallback)."""

    @abc.abstractmethod
    async def bash(self, request: BashRequest) -> BashResponse: ...

    @abc.abstractmethod
    async def python(self, request: PythonRequest) -> PythonResponse: ...

    @abc.abstractmethod
    async def edit(self, request: EditRequest) -> EditResponse: ...

    @abc.abstractmethod
    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse: ...

    @abc.abstractmethod
    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse: ...

    @abc.abstractmethod
    async def list_dir(self, request: ListDirRequest) -> ListDirResponse: ...

    @abc.abstractmethod
    async def health(self, request: HealthRequest) -> HealthResponse: ...

    @abc.abstractmethod
    async def judge(self, request: JudgeRequest) -> JudgeResponse: ...

    async def reset(self, request: ResetRequest) -> ResetResponse:
        """Make the sandbox fit for another job (see ResetRequest). Runtimes that cannot
        raise SandboxError(reason="reset_unsupported"): their sandboxes are never reused."""
        raise SandboxError(f"a {self.mode} runtime cannot reset its sandbox", reason="reset_unsupported")

    @abc.abstractmethod
    async def open_relay(self, handler: RelayHandler, *, port: int = 0) -> RelayHandle:
        """Listen for HTTP on the sandbox's own loopback (127.0.0.1:port; 0: any free port) and
        relay each request to `handler` (runtime/relay.py), its response back as it is
        produced: a program inside reaches the server while the sandbox has no network.
        The handle names the port bound; closing the runtime closes its relays."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving calls (later ones raise SandboxError); calls still pending fail
        without blame. The sandbox itself stays up: removing it is its handle's job.
        Idempotent."""
