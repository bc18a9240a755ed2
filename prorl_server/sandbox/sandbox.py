"""The sandbox the agents and verifiers use: a runtime (what can be done inside)
composed with a container handle (how it is removed).

Providers build it from their own parts: the Podman provider from a
SocketRuntime or an ExecRuntime and a PodmanContainer, the test fake from a
SocketRuntime on a local process and its own handle. One concrete class, so
everything above the providers sees the same methods and the same lifecycle:
`close()` stops the runtime, then removes the container; it is idempotent.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prorl_server.errors import SandboxError
from prorl_server.sandbox.handle import ContainerHandle
from prorl_server.sandbox.runtime.abstract import RuntimeMode, SandboxRuntime
from prorl_server.sandbox.runtime.protocol import (
    BashRequest,
    CommandResult,
    EditRequest,
    HealthRequest,
    HealthResponse,
    JudgeRequest,
    JudgeResponse,
    JudgeResult,
    ListDirRequest,
    PythonRequest,
    ReadFileRequest,
    WriteFileRequest,
)
from prorl_server.sandbox.runtime.relay import RelayHandle, RelayHandler


def judge_result(response: JudgeResponse) -> JudgeResult:
    """The runtime's answer to `judge`: a verdict only from a harness that wrote a JSON
    object and then exited 0 by itself, before its time ran out."""
    verdict: dict[str, Any] | None = None
    problem = ""
    if response.timed_out:
        problem = "the judging harness ran out of time and was killed"
    elif response.exit_code != 0:
        problem = f"the judging harness ended with exit status {response.exit_code} before giving a verdict"
    elif response.verdict_truncated:
        problem = "the judging harness wrote an oversized verdict"
    elif not response.verdict:
        problem = "the judging harness wrote no verdict"
    else:
        try:
            parsed = json.loads(response.verdict)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            verdict = parsed
        else:
            problem = "the judging harness wrote a malformed verdict"
    return JudgeResult(
        verdict=verdict,
        problem=problem,
        output=response.output,
        exit_code=response.exit_code,
        timed_out=response.timed_out,
        duration_s=response.duration_s,
    )


class Sandbox:
    """A started sandbox. Calls after `close()` raise SandboxError."""

    def __init__(
        self,
        runtime: SandboxRuntime,
        container: ContainerHandle,
        *,
        recycle: Callable[[Sandbox], Awaitable[None]] | None = None,
    ) -> None:
        """`recycle`: given, `close()` hands the runtime and container to it (to be reset for
        another job, or removed) instead of removing them; this object is closed either way."""
        self._runtime = runtime
        self._container = container
        self._recycle = recycle
        self.jobs_served = 0
        """Jobs this container served before the one holding this object (reuse)."""
        self._close_callbacks: list[Callable[[], None]] = []
        self._relays: list[RelayHandle] = []
        self._closed = False

    @property
    def id(self) -> str:
        return self._container.id

    @property
    def mode(self) -> RuntimeMode:
        """ "runtime" (in-sandbox runtime) or "exec" (podman exec fallback)."""
        return self._runtime.mode

    @property
    def runtime(self) -> SandboxRuntime:
        return self._runtime

    @property
    def container(self) -> ContainerHandle:
        return self._container

    @property
    def closed(self) -> bool:
        return self._closed

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the sandbox is closed (e.g. to count it free); at once when it
        already is."""
        if self._closed:
            callback()
        else:
            self._close_callbacks.append(callback)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    async def bash(self, command: str, *, timeout_s: float) -> CommandResult:
        """Run in the sandbox's shell. A command still running after timeout_s
        is interrupted, then killed with its process group; the result says so."""
        self._check_open()
        return await self._runtime.bash(BashRequest(command, timeout_s))

    async def python(self, code: str, *, timeout_s: float) -> CommandResult:
        """Execute Python; names persist between calls where the mode allows."""
        self._check_open()
        return await self._runtime.python(PythonRequest(code, timeout_s))

    async def edit(
        self,
        command: str,
        path: str,
        *,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> CommandResult:
        """str_replace-style editor: view, create, str_replace, insert, undo. A mistake
        (a missing file, an ambiguous old_str) is a result with is_error set."""
        self._check_open()
        request = EditRequest(command, path, file_text, old_str, new_str, insert_line, view_range)
        return await self._runtime.edit(request)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        self._check_open()
        return (await self._runtime.read_file(ReadFileRequest(path, max_bytes))).content

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None:
        self._check_open()
        await self._runtime.write_file(WriteFileRequest(path, data, mode))

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        """Entries as {"name", "type" ("file" or "dir"), "size"}, sorted by name."""
        self._check_open()
        return [entry.as_dict() for entry in (await self._runtime.list_dir(ListDirRequest(path))).entries]

    async def health(self) -> HealthResponse:
        self._check_open()
        return await self._runtime.health(HealthRequest())

    async def judge(self, mode: str, spec: Mapping[str, Any], *, timeout_s: float) -> JudgeResult:
        """Run the trusted judging harness in `mode` ("function", "stdio", "swe", "terminal") on
        `spec`; it is killed with everything it started after timeout_s. Its verdict
        comes back on a channel the judged code can neither reach nor forge."""
        self._check_open()
        return judge_result(await self._runtime.judge(JudgeRequest(mode, spec, timeout_s)))

    async def open_relay(self, handler: RelayHandler, *, port: int = 0) -> RelayHandle:
        """Serve HTTP to the programs inside at http://127.0.0.1:<port> (the handle's `port`;
        0: any free port), the sandbox's own loopback: each request goes to `handler`
        (runtime/relay.py) and its response back, streamed bodies piece by piece. The
        sandbox keeps no network. Closed with the sandbox, or by the handle's `close()`.
        SandboxError(reason="gateway_needs_runtime") in an image without python3."""
        self._check_open()
        relay = await self._runtime.open_relay(handler, port=port)
        if self._closed:  # closed meanwhile
            await relay.close()
            raise SandboxError("the sandbox is closed")
        self._relays = [*(item for item in self._relays if not item.closed), relay]
        return relay

    async def close(self) -> None:
        """Close the relays, stop the runtime and remove the container (or hand both to
        `recycle`); the close callbacks run before the runtime stops."""
        if self._closed:
            return
        self._closed = True
        relays, self._relays = self._relays, []
        for relay in relays:
            with contextlib.suppress(Exception):
                await relay.close()
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback()
        if self._recycle is not None:
            await self._recycle(self)
            return
        try:
            await self._runtime.close()
        finally:
            await self._container.remove()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, mode={self.mode!r}, closed={self._closed})"
