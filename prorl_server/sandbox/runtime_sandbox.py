"""A sandbox driven through the in-sandbox runtime (see runtime/prorl_runtime.py).

A failed call is blamed before it is raised (sandbox/blame.py): what the
agent's commands did to their own sandbox (killed or stopped the runtime,
reached its limits, filled its disk) is a SandboxBroken, a POLICY failure;
anything else stays a SandboxError, INFRASTRUCTURE.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prorl_server.errors import ProrlError, SandboxBroken, SandboxError
from prorl_server.sandbox.base import CommandResult, JudgeResult, Sandbox
from prorl_server.sandbox.blame import RuntimeState, SandboxInspector, Symptom, blame, gather
from prorl_server.sandbox.runtime.client import RuntimeClient, RuntimeOpFailed

# Seconds the server waits beyond a call's own timeout before declaring the runtime lost.
CALL_GRACE_S = 15.0
# While a call is pending, the runtime's process is looked at this often (host /proc: cheap);
# a runtime found stopped for STOPPED_GRACE_S fails the call without waiting for the timeout.
PROBE_INTERVAL_S = 0.5
STOPPED_GRACE_S = 2.0


def judge_result(reply: dict[str, Any]) -> JudgeResult:
    """The runtime's answer to `judge`: a verdict only from a harness that wrote a JSON
    object and then exited 0 by itself, before its time ran out."""
    exit_code = reply.get("exit_code")
    timed_out = bool(reply.get("timed_out"))
    text = reply.get("verdict")
    verdict: dict[str, Any] | None = None
    problem = ""
    if timed_out:
        problem = "the judging harness ran out of time and was killed"
    elif exit_code != 0:
        problem = f"the judging harness ended with exit status {exit_code} before giving a verdict"
    elif reply.get("verdict_truncated"):
        problem = "the judging harness wrote an oversized verdict"
    elif not isinstance(text, str) or not text:
        problem = "the judging harness wrote no verdict"
    else:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            verdict = parsed
        else:
            problem = "the judging harness wrote a malformed verdict"
    return JudgeResult(
        verdict=verdict,
        problem=problem,
        output=str(reply.get("output", "")),
        exit_code=exit_code if isinstance(exit_code, int) else None,
        timed_out=timed_out,
        duration_s=float(reply.get("duration_s") or 0.0),
    )


class _NoAnswer(Exception):
    """The call's time, grace included, ran out."""


class RuntimeSandbox(Sandbox):
    mode = "runtime"

    def __init__(
        self,
        container_id: str,
        client: RuntimeClient,
        *,
        max_output_bytes: int,
        remove: Callable[[], Awaitable[None]],
        inspector: SandboxInspector,
    ) -> None:
        self.id = container_id
        self._client = client
        self._max_output_bytes = max_output_bytes
        self._remove = remove
        self._inspector = inspector
        self._closed = False

    async def _call(self, op: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        call = asyncio.ensure_future(
            self._client.call(op, timeout_s=timeout_s, max_output_bytes=self._max_output_bytes, **params)
        )
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

    @staticmethod
    def _result(reply: dict[str, Any]) -> CommandResult:
        return CommandResult(
            output=str(reply.get("output", "")),
            exit_code=reply.get("exit_code"),
            truncated=bool(reply.get("truncated")),
            timed_out=bool(reply.get("timed_out")),
            duration_s=float(reply.get("duration_s") or 0.0),
            is_error=bool(reply.get("is_error")),
        )

    async def bash(self, command: str, *, timeout_s: float) -> CommandResult:
        return self._result(await self._call("bash", timeout_s, command=command))

    async def python(self, code: str, *, timeout_s: float) -> CommandResult:
        return self._result(await self._call("python", timeout_s, code=code))

    async def edit(self, command: str, path: str, **params: Any) -> CommandResult:
        return self._result(await self._call("edit", command=command, path=path, **params))

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        reply = await self._call("read_file", path=path, max_bytes=max_bytes)
        return base64.b64decode(reply["content_b64"])

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None:
        await self._call("write_file", path=path, content_b64=base64.b64encode(data).decode(), mode=mode)

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        reply = await self._call("list_dir", path=path)
        return list(reply["entries"])

    async def health(self) -> dict[str, Any]:
        return await self._call("health", 5.0)

    async def judge(self, mode: str, spec: Mapping[str, Any], *, timeout_s: float) -> JudgeResult:
        reply = await self._call("judge", timeout_s, mode=mode, spec=dict(spec))
        return judge_result(reply)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_now()
        try:
            await self._client.close()
        finally:
            await self._remove()
