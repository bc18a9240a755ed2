"""The runtime for images without python3: every call is a `podman exec`.

Same interface, fewer guarantees: each bash call starts a fresh shell (no
persistent cwd or environment), Python runs with `python3 -c` if the image has
it, the editor and judging are unavailable. Podman calls run in the provider's
threads, never on the event loop.

Limits: `podman exec` starts its command outside the cgroups the server made for
the sandbox (cgroup v1, see cgroups.py). With a `Confinement`, each command runs
under a shell wrapper that waits until /proc/$$/cgroup shows it in the sandbox's
memory, cpu and pids groups, while the server moves it there; only then does it
exec the command, which (with everything it starts) inherits the groups.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from podman.errors import APIError, NotFound

from prorl_server.errors import SandboxError
from prorl_server.sandbox.output import cap_output
from prorl_server.sandbox.runtime.abstract import SandboxRuntime
from prorl_server.sandbox.runtime.protocol import (
    BashRequest,
    BashResponse,
    DirEntry,
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
    WriteFileRequest,
    WriteFileResponse,
)
from prorl_server.sandbox.runtime.relay import RelayHandle, RelayHandler

# Exit codes of coreutils `timeout`: 124 after the signal, 137 after -k's KILL.
TIMEOUT_EXIT_CODES = (124, 137)
EXEC_GRACE_S = 10.0
# Waits until this shell is in the three groups named by $1, checking every 10 ms,
# at most $2 times.
ENTER_LIMITS = (
    "group=$1; patience=$2; shift 2; tries=0; "
    "while :; do n=0; "
    "while IFS=: read -r _ controllers path; do "
    'case ",$controllers," in *,memory,*|*,cpu,*|*,pids,*) case "$path" in */"$group") n=$((n + 1));; esac;; esac; '
    "done < /proc/$$/cgroup; "
    '[ "$n" -ge 3 ] && break; tries=$((tries + 1)); '
    'if [ "$tries" -gt "$patience" ]; then echo "prorl: not moved into the sandbox limits"; exit 125; fi; '
    "sleep 0.01; done; "
)
CONFINE_FAILED = b"prorl: not moved into the sandbox limits"


@dataclass(frozen=True)
class Confinement:
    """How exec'd commands enter the sandbox's limits."""

    group: str
    """Name of the sandbox's groups: a command starts once its cgroup paths end in it."""
    adopt: Callable[[bytes], Awaitable[bool]]
    """Moves the sandbox's processes into its groups; True once the one whose command line
    holds the given marker is inside."""
    patience: int = 500
    """Checks, 10 ms apart (and slower on a loaded host), before a command that is still
    outside the groups gives up without running."""


class ExecRuntime(SandboxRuntime):
    mode = "exec"

    def __init__(
        self,
        container: Any,
        *,
        run_in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
        max_output_bytes: int,
        confinement: Confinement | None = None,
    ) -> None:
        """`container` is podman-py's Container; `run_in_thread` runs a blocking call in
        the provider's threads."""
        self._container = container
        self._thread = run_in_thread
        self._max_output_bytes = max_output_bytes
        self._confinement = confinement
        self._closed = False

    async def _exec(self, argv: Sequence[str], timeout_s: float) -> tuple[int, bytes, float]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        # `timeout` puts the command in its own process group and kills the whole
        # group; `2>&1` keeps stdout and stderr in their true order.
        command = ["timeout", "-k", "2", f"{timeout_s:g}", *argv]
        marker = f"prorl-exec-{secrets.token_hex(8)}"
        confinement = self._confinement
        if confinement is None:
            wrapped = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *command]
            waiting_s = 0.0
        else:
            script = "shift; " + ENTER_LIMITS + 'exec "$@" 2>&1'
            wrapped = ["/bin/sh", "-c", script, "sh", marker, confinement.group, str(confinement.patience), *command]
            waiting_s = 0.02 * confinement.patience  # the wrapper's wait comes on top (checks of 10 ms and more)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s + EXEC_GRACE_S + waiting_s):
                code, output = await self._run(wrapped, marker.encode())
        except TimeoutError:
            raise SandboxError(
                f"exec did not return {EXEC_GRACE_S:g}s after its timeout", reason="sandbox_lost"
            ) from None
        except (APIError, NotFound) as exc:
            raise SandboxError(f"exec failed: the container is gone or broken ({exc})", reason="sandbox_lost") from exc
        stdout = (output[0] if output else None) or b""
        if code == 125 and stdout.startswith(CONFINE_FAILED):
            raise SandboxError("a command could not be moved into the sandbox's limits", reason="sandbox_confine")
        return (-1 if code is None else int(code)), stdout, time.perf_counter() - started

    async def _run(self, wrapped: list[str], marker: bytes) -> Any:
        execution = asyncio.ensure_future(self._thread(lambda: self._container.exec_run(wrapped, demux=True)))
        try:
            delay = 0.005  # `podman exec` takes some 50 ms to start the wrapper; a sweep costs a few ms
            while self._confinement is not None and not execution.done():
                if await self._confinement.adopt(marker):
                    break
                await asyncio.wait([execution], timeout=delay)
                delay = min(2 * delay, 0.1)
            return await execution
        finally:
            execution.cancel()  # only when leaving early (a timeout): the call itself runs on in its thread

    async def _command(self, argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
        code, stdout, duration = await self._exec(argv, timeout_s)
        text, truncated = cap_output(stdout, self._max_output_bytes)
        timed_out = code in TIMEOUT_EXIT_CODES
        if timed_out:
            text += f"\n[command timed out after {timeout_s:g}s; its process group was killed]"
        return {
            "output": text,
            "exit_code": code,
            "truncated": truncated,
            "timed_out": timed_out,
            "duration_s": duration,
            "is_error": code != 0,
        }

    async def bash(self, request: BashRequest) -> BashResponse:
        return BashResponse(**await self._command(["sh", "-c", request.command], request.timeout_s))

    async def python(self, request: PythonRequest) -> PythonResponse:
        return PythonResponse(**await self._command(["python3", "-c", request.code], request.timeout_s))

    async def edit(self, request: EditRequest) -> EditResponse:
        return EditResponse(
            "Error: the file editor needs python3 in the sandbox image; use bash (cat, sed) instead", is_error=True
        )

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        path = request.path
        code, data, _ = await self._exec(["cat", path], 60)
        if code != 0:
            raise SandboxError(f"cannot read {path}: {data[:300].decode(errors='replace')}", reason="sandbox_file")
        if request.max_bytes is None:
            return ReadFileResponse(data)
        return ReadFileResponse(data[: request.max_bytes], truncated=len(data) > request.max_bytes)

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        path = shlex.quote(request.path)
        encoded = shlex.quote(base64.b64encode(request.data).decode())
        script = f"printf %s {encoded} | base64 -d > {path}"
        if request.mode is not None:
            script += f" && chmod {request.mode:o} {path}"
        code, output, _ = await self._exec(["sh", "-c", script], 60)
        if code != 0:
            raise SandboxError(
                f"cannot write {request.path}: {output[:300].decode(errors='replace')}", reason="sandbox_file"
            )
        return WriteFileResponse(request.path)

    async def list_dir(self, request: ListDirRequest) -> ListDirResponse:
        code, output, _ = await self._exec(
            ["find", request.path, "-mindepth", "1", "-maxdepth", "1", "-printf", r"%y %s %f\n"], 30
        )
        if code != 0:
            raise SandboxError(
                f"cannot list {request.path}: {output[:300].decode(errors='replace')}", reason="sandbox_file"
            )
        entries = []
        for line in sorted(output.decode(errors="replace").splitlines(), key=lambda item: item.split(" ", 2)[-1]):
            kind, size, name = line.split(" ", 2)
            entries.append(DirEntry(name, "dir" if kind == "d" else "file", int(size)))
        return ListDirResponse(request.path, entries)

    async def health(self, request: HealthRequest) -> HealthResponse:
        code, _, _ = await self._exec(["true"], 10)
        return HealthResponse(ok=code == 0)

    async def judge(self, request: JudgeRequest) -> JudgeResponse:
        """Judging needs the runtime's harness: its verdict pipe and a non-dumpable
        process are what keep the judged code from writing its own verdict."""
        raise SandboxError(
            f"judging ({request.mode}) needs the in-sandbox runtime, and this sandbox's image has no python3: "
            "judge in an image with python3",
            reason="judge_needs_runtime",
        )

    async def open_relay(self, handler: RelayHandler, *, port: int = 0) -> RelayHandle:
        """The relay is the in-sandbox runtime's listener: without it there is nothing
        inside to listen, and the sandbox has no network to reach the server by."""
        raise SandboxError(
            "the model gateway's relay into the sandbox needs the in-sandbox runtime, and this sandbox's image has no "
            "python3: use an image with python3",
            reason="gateway_needs_runtime",
        )

    async def close(self) -> None:
        self._closed = True
