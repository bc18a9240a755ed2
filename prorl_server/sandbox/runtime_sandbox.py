"""A sandbox driven through the in-sandbox runtime (see runtime/prorl_runtime.py)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from typing import Any

from prorl_server.errors import SandboxError, SandboxLimitExceeded
from prorl_server.sandbox.base import CommandResult, Sandbox
from prorl_server.sandbox.runtime.client import RuntimeClient

# Seconds the server waits beyond a call's own timeout before declaring the runtime lost.
CALL_GRACE_S = 15.0


class RuntimeSandbox(Sandbox):
    mode = "runtime"

    def __init__(
        self,
        container_id: str,
        client: RuntimeClient,
        *,
        max_output_bytes: int,
        remove: Callable[[], Awaitable[None]],
        limits_hit: Callable[[], Awaitable[list[str]]],
        describe: Callable[[], Awaitable[str]],
    ) -> None:
        self.id = container_id
        self._client = client
        self._max_output_bytes = max_output_bytes
        self._remove = remove
        self._limits_hit = limits_hit
        self._describe = describe
        self._closed = False

    async def _call(self, op: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        try:
            async with asyncio.timeout(timeout_s + CALL_GRACE_S):
                return await self._client.call(
                    op, timeout_s=timeout_s, max_output_bytes=self._max_output_bytes, **params
                )
        except TimeoutError:
            await self._blame_limits(op)
            raise SandboxError(
                f"the sandbox runtime did not answer {op} within {timeout_s + CALL_GRACE_S:g}s", reason="sandbox_lost"
            ) from None
        except SandboxError as exc:
            if exc.reason == "sandbox_lost":
                await self._blame_limits(op)
            raise

    async def _blame_limits(self, op: str) -> None:
        """A lost sandbox that ran into its own limits was killed by what the agent ran;
        otherwise say what the container reported, so the failure explains itself."""
        hit = await self._limits_hit()
        if hit:
            raise SandboxLimitExceeded(
                f"the sandbox stopped answering ({op}) after reaching its {' and '.join(hit)} limit"
            )
        raise SandboxError(
            f"the sandbox runtime stopped answering ({op}); container: {await self._describe()}",
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

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_now()
        try:
            await self._client.close()
        finally:
            await self._remove()
