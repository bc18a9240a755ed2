"""Sandboxes as rootless Podman containers, through podman-py.

podman-py is synchronous: every call runs in a bounded thread pool, never on
the event loop. Each container carries the labels `prorl.managed=1` and
`prorl.server=<instance id>`; cleanup removes exactly the containers with
this server's label.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog
from podman import PodmanClient
from podman.errors import APIError, NotFound

from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import ExecResult, Sandbox, SandboxProvider, SandboxSpec
from prorl_server.sandbox.output import cap_output

log = structlog.get_logger(__name__)

T = TypeVar("T")

LABEL_MANAGED = "prorl.managed"
LABEL_SERVER = "prorl.server"
LABEL_JOB = "prorl.job"
# Exit codes of coreutils `timeout`: 124 after the signal, 137 after -k's KILL.
TIMEOUT_EXIT_CODES = (124, 137)
# Extra seconds the host waits beyond a command's own timeout before giving up on it.
EXEC_GRACE_S = 10.0


class PodmanSandbox(Sandbox):
    def __init__(self, provider: PodmanProvider, container: Any, max_output_bytes: int) -> None:
        self._provider = provider
        self._container = container
        self._max_output_bytes = max_output_bytes
        self._closed = False
        self.id = container.id

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        # `timeout` puts the command in its own process group and kills the
        # whole group; `2>&1` keeps stdout and stderr in their true order.
        wrapped = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", "timeout", "-k", "2", f"{timeout_s:g}", *argv]
        started = time.perf_counter()

        def run() -> tuple[int | None, Any]:
            return self._container.exec_run(  # type: ignore[no-any-return]
                wrapped, demux=True, workdir=workdir, environment=dict(env or {})
            )

        try:
            exit_code, output = await asyncio.wait_for(self._provider.call(run), timeout_s + EXEC_GRACE_S)
        except TimeoutError:
            raise SandboxError(f"exec did not return {timeout_s + EXEC_GRACE_S:g}s after its timeout") from None
        except (APIError, NotFound) as exc:
            raise SandboxError(f"exec failed: the container is gone or broken ({exc})") from exc
        stdout = (output[0] if output else None) or b""
        text, truncated = cap_output(stdout, self._max_output_bytes)
        code = -1 if exit_code is None else int(exit_code)
        timed_out = code in TIMEOUT_EXIT_CODES
        if timed_out:
            text += f"\n[command timed out after {timeout_s:g}s and was killed]"
        return ExecResult(
            exit_code=code,
            output=text,
            truncated=truncated,
            timed_out=timed_out,
            duration_s=time.perf_counter() - started,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._provider.remove(self._container.id)


class PodmanProvider(SandboxProvider):
    def __init__(
        self,
        *,
        url_factory: Callable[[], str],
        instance_id: str,
        max_output_bytes: int,
        threads: int,
    ) -> None:
        self._url_factory = url_factory
        self._instance_id = instance_id
        self._max_output_bytes = max_output_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="podman")
        self._client: PodmanClient | None = None
        self._live: set[str] = set()

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    @property
    def client(self) -> PodmanClient:
        if self._client is None:
            raise SandboxError("sandbox provider not started")
        return self._client

    @property
    def busy(self) -> int:
        return len(self._live)

    async def start(self) -> None:
        self._client = PodmanClient(base_url=self._url_factory(), timeout=120)
        removed = await self.remove_ours()
        if removed:
            log.warning("removed_leftover_containers", count=removed)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        labels = {LABEL_MANAGED: "1", LABEL_SERVER: self._instance_id, **spec.labels}
        job = spec.labels.get(LABEL_JOB, "")
        name = f"prorl-{self._instance_id}-{secrets.token_hex(6)}"
        memory = spec.memory_mib * 1024 * 1024

        def create_and_start() -> Any:
            container = self.client.containers.create(
                spec.image,
                command=["sleep", "infinity"],
                name=name,
                labels=labels,
                network_mode="none",
                init=True,
                mem_limit=memory,
                memswap_limit=memory,
                nano_cpus=int(spec.cpus * 1e9),
                pids_limit=spec.pids_limit,
                # Where cgroup limits are ignored (rootless on cgroup v1) the
                # process rlimit still bounds forks. RLIMIT_AS cannot stand in
                # for memory: runc itself needs more address space than that.
                ulimits=[
                    {"Name": "nproc", "Soft": spec.pids_limit, "Hard": spec.pids_limit},
                    {"Name": "nofile", "Soft": 1024, "Hard": 1024},
                ],
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
            )
            try:
                container.start()
            except Exception:
                container.remove(force=True)
                raise
            return container

        self._live.add(name)
        try:
            container = await self.call(create_and_start)
        except Exception as exc:
            self._live.discard(name)
            message = str(exc)
            if "image not known" in message or "no such image" in message.lower():
                raise SandboxError(
                    f"sandbox image {spec.image!r} is not built: run `make images`", reason="sandbox_image"
                ) from exc
            raise SandboxError(f"could not start sandbox from {spec.image!r}: {message}") from exc
        self._live.discard(name)
        self._live.add(container.id)
        log.debug("sandbox_started", container=container.id[:12], image=spec.image, job=job)
        return PodmanSandbox(self, container, self._max_output_bytes)

    async def remove(self, container_id: str) -> None:
        def remove() -> None:
            with contextlib.suppress(NotFound):
                self.client.containers.remove(container_id, force=True, v=True)

        try:
            await self.call(remove)
        finally:
            self._live.discard(container_id)

    async def remove_ours(self) -> int:
        """Remove every container labelled as this server's; returns the count."""

        def remove_all() -> int:
            containers = self.client.containers.list(all=True, filters={"label": f"{LABEL_SERVER}={self._instance_id}"})
            for container in containers:
                with contextlib.suppress(NotFound):
                    container.remove(force=True, v=True)
            return len(containers)

        return await self.call(remove_all)

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self.remove_ours()
            finally:
                self._live.clear()
                self._client.close()
                self._client = None
        self._pool.shutdown(wait=False, cancel_futures=True)
