"""The in-sandbox runtime (runtime/prorl_runtime.py) over its Unix socket: the default runtime.

Each typed request becomes one JSON frame {"id", "op", "timeout_s",
"max_output_bytes", ...fields}, each reply a typed response: the field names
on the wire are the ones the runtime's `Runtime` (prorl_sandbox_runtime/server.py)
reads and writes, and are mapped here only.

A failed call is blamed before it is raised (sandbox/blame.py): what the
agent's commands did to their own sandbox (killed or stopped the runtime,
reached its limits, filled its disk) is a SandboxBroken, a POLICY failure;
anything else stays a SandboxError, INFRASTRUCTURE.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Mapping
from typing import Any

from prorl_server.errors import ProrlError, SandboxBroken, SandboxError
from prorl_server.sandbox.blame import RuntimeState, SandboxInspector, Symptom, blame, gather
from prorl_server.sandbox.runtime.abstract import SandboxRuntime
from prorl_server.sandbox.runtime.client import RuntimeClient, RuntimeOpFailed
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
    Op,
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
from prorl_server.sandbox.runtime.socket_relay import SocketRelay

# Seconds the server waits beyond a call's own timeout before declaring the runtime lost.
CALL_GRACE_S = 15.0
# While a call is pending, the runtime's process is looked at this often (host /proc: cheap);
# a runtime found stopped for STOPPED_GRACE_S fails the call without waiting for the timeout.
PROBE_INTERVAL_S = 0.5
STOPPED_GRACE_S = 2.0
# The time a call without a timeout of its own (files, the editor) may take.
DEFAULT_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0


class _NoAnswer(Exception):
    """The call's time, grace included, ran out."""


def _command_fields(reply: Mapping[str, Any]) -> dict[str, Any]:
    exit_code = reply.get("exit_code")
    return {
        "output": str(reply.get("output", "")),
        "exit_code": exit_code if isinstance(exit_code, int) else None,
        "truncated": bool(reply.get("truncated")),
        "timed_out": bool(reply.get("timed_out")),
        "duration_s": float(reply.get("duration_s") or 0.0),
        "is_error": bool(reply.get("is_error")),
    }


class SocketRuntime(SandboxRuntime):
    mode = "runtime"

    def __init__(self, client: RuntimeClient, *, max_output_bytes: int, inspector: SandboxInspector) -> None:
        """`client` is connected (RuntimeClient.open); `inspector` is the provider's view of the
        sandbox from outside, which blame looks at when a call fails."""
        self._client = client
        self._max_output_bytes = max_output_bytes
        self._inspector = inspector
        self._closed = False
        self._relays: list[SocketRelay] = []

    async def bash(self, request: BashRequest) -> BashResponse:
        reply = await self._call(request.op, request.timeout_s, {"command": request.command})
        return BashResponse(**_command_fields(reply))

    async def python(self, request: PythonRequest) -> PythonResponse:
        reply = await self._call(request.op, request.timeout_s, {"code": request.code})
        return PythonResponse(**_command_fields(reply), state_lost=bool(reply.get("state_lost")))

    async def edit(self, request: EditRequest) -> EditResponse:
        fields = {"command": request.command, "path": request.path, **request.arguments()}
        reply = await self._call(request.op, DEFAULT_TIMEOUT_S, fields)
        return EditResponse(**_command_fields(reply))

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        reply = await self._call(request.op, DEFAULT_TIMEOUT_S, {"path": request.path, "max_bytes": request.max_bytes})
        return ReadFileResponse(base64.b64decode(reply["content_b64"]), truncated=bool(reply.get("truncated")))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        content = base64.b64encode(request.data).decode()
        fields = {"path": request.path, "content_b64": content, "mode": request.mode}
        reply = await self._call(request.op, DEFAULT_TIMEOUT_S, fields)
        return WriteFileResponse(str(reply.get("path", request.path)))

    async def list_dir(self, request: ListDirRequest) -> ListDirResponse:
        reply = await self._call(request.op, DEFAULT_TIMEOUT_S, {"path": request.path})
        entries = [
            DirEntry(str(entry["name"]), "dir" if entry.get("type") == "dir" else "file", int(entry.get("size") or 0))
            for entry in reply["entries"]
        ]
        return ListDirResponse(str(reply.get("path", request.path)), entries)

    async def health(self, request: HealthRequest) -> HealthResponse:
        reply = await self._call(request.op, HEALTH_TIMEOUT_S, {})
        pid, python, uptime = reply.get("pid"), reply.get("python"), reply.get("uptime_s")
        return HealthResponse(
            ok=True,
            pid=pid if isinstance(pid, int) else None,
            python=python if isinstance(python, str) else None,
            uptime_s=float(uptime) if isinstance(uptime, int | float) else None,
        )

    async def judge(self, request: JudgeRequest) -> JudgeResponse:
        reply = await self._call(request.op, request.timeout_s, {"mode": request.mode, "spec": dict(request.spec)})
        exit_code, verdict = reply.get("exit_code"), reply.get("verdict")
        return JudgeResponse(
            output=str(reply.get("output", "")),
            exit_code=exit_code if isinstance(exit_code, int) else None,
            timed_out=bool(reply.get("timed_out")),
            verdict=verdict if isinstance(verdict, str) else None,
            verdict_truncated=bool(reply.get("verdict_truncated")),
            truncated=bool(reply.get("truncated")),
            duration_s=float(reply.get("duration_s") or 0.0),
        )

    async def reset(self, request: ResetRequest) -> ResetResponse:
        paths = [{"path": item.path, "lower": item.lower, "mode": item.mode} for item in request.paths]
        reply = await self._call(request.op, request.timeout_s, {"paths": paths})
        return ResetResponse(
            processes=[int(pid) for pid in reply.get("processes") or []],
            ipc=[str(item) for item in reply.get("ipc") or []],
            keys=[str(item) for item in reply.get("keys") or []],
            failed={str(path): str(why) for path, why in (reply.get("failed") or {}).items()},
        )

    async def open_relay(self, handler: RelayHandler, *, port: int = 0) -> RelayHandle:
        """On a connection of its own to the runtime (runtime/socket_relay.py)."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        relay = await SocketRelay.open(self._client.socket_path, handler, port=port)
        if self._closed:  # closed meanwhile
            await relay.close()
            raise SandboxError("the sandbox is closed")
        self._relays = [*(item for item in self._relays if not item.closed), relay]
        return relay

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        relays, self._relays = self._relays, []
        for relay in relays:
            with contextlib.suppress(Exception):
                await relay.close()
        await self._client.close()

    # --- calls and blame --------------------------------------------------------------------

    async def _call(self, op: Op, timeout_s: float, fields: Mapping[str, Any]) -> dict[str, Any]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        message = {"timeout_s": timeout_s, "max_output_bytes": self._max_output_bytes, **fields}
        call = asyncio.ensure_future(self._client.call(op, message))
        try:
            return await self._answer(call, op, timeout_s + CALL_GRACE_S)
        except _NoAnswer:
            symptom = Symptom("timeout")
            error = SandboxError(
                f"the sandbox runtime did not answer {op} within {timeout_s + CALL_GRACE_S:g}s", reason="sandbox_lost"
            )
        except RuntimeOpFailed as exc:
            symptom, error = Symptom("refused", exc.errno), exc
        except SandboxError as exc:
            if exc.reason != "sandbox_lost":
                raise
            symptom, error = Symptom("closed"), exc
        finally:
            if not call.done():
                call.cancel()
                await asyncio.wait({call})  # never raises: a cancel of this task still propagates
                if not call.cancelled():
                    call.exception()  # retrieved: it is superseded by the outcome here
        raise await self._blame(op, symptom, error) from None

    async def _answer(self, call: asyncio.Future[dict[str, Any]], op: str, limit_s: float) -> dict[str, Any]:
        """The call's answer; meanwhile a runtime that stays stopped fails it at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        stopped_since: float | None = None
        while not call.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _NoAnswer
            await asyncio.wait({call}, timeout=min(PROBE_INTERVAL_S, remaining))
            if call.done():
                break
            if self._inspector.runtime_state() is not RuntimeState.STOPPED:
                stopped_since = None
            elif stopped_since is None:
                stopped_since = loop.time()
            elif loop.time() - stopped_since >= STOPPED_GRACE_S:
                raise SandboxBroken(
                    f"the sandbox runtime was stopped from inside the sandbox (e.g. by SIGSTOP) while serving {op}",
                    reason="runtime_stopped",
                )
        return call.result()

    async def _blame(self, op: str, symptom: Symptom, error: SandboxError) -> ProrlError:
        """What the agent did to its own sandbox is POLICY; otherwise the original failure,
        with what the container reported when the runtime was lost."""
        if self._closed:  # closed by the server while the call was pending: nobody's fault
            return error
        broken = blame(op, symptom, await gather(self._inspector, symptom))
        if broken is not None:
            return broken
        if symptom.kind == "refused":
            return error
        container = await self._inspector.describe()
        return SandboxError(
            f"the sandbox runtime stopped answering ({op}): {error.message}; container: {container}",
            reason="sandbox_lost",
        )
