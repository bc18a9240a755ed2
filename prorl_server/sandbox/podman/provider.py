"""Sandboxes as rootless Podman containers, through podman-py.

podman-py is synchronous: every call runs in the provider's bounded threads,
never on the event loop. Each container carries the labels `prorl.managed=1`
and `prorl.server=<instance id>`; cleanup removes exactly the containers with
this server's label.

A container starts the in-sandbox runtime as its init (container_spec.py),
listening on a Unix socket in a per-sandbox folder the server made
(staging.py); the sandbox is served by a SocketRuntime over that socket. An
image without python3 is refused, or served by `podman exec` (ExecRuntime)
when the operator allows that fallback. Either way the sandbox's handle is a
PodmanContainer bound to this provider, which removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog
from podman import PodmanClient
from podman.errors import NotFound

from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import LABEL_MANAGED, LABEL_SERVER, Sandbox, SandboxProvider, SandboxSpec
from prorl_server.sandbox.blame import HostInspector, HostView, RuntimeState
from prorl_server.sandbox.cgroups import CgroupV1Limiter
from prorl_server.sandbox.podman import reset_check
from prorl_server.sandbox.podman.container import PodmanContainer
from prorl_server.sandbox.podman.container_spec import (
    COMMAND_NOT_FOUND,
    IMAGE_MOUNT,
    NOT_RESET,
    RUNTIME_MARKER,
    container_kwargs,
    reset_mode,
    writable_mounts,
    writable_paths,
)
from prorl_server.sandbox.podman.exec_runtime import Confinement, ExecRuntime
from prorl_server.sandbox.podman.host_limits import check_host_limits
from prorl_server.sandbox.podman.options import PodmanOptions
from prorl_server.sandbox.podman.staging import SOCKET_NAME, RuntimeStaging
from prorl_server.sandbox.runtime.abstract import SandboxRuntime
from prorl_server.sandbox.runtime.client import RuntimeClient
from prorl_server.sandbox.runtime.protocol import ResetPath, ResetRequest
from prorl_server.sandbox.runtime.socket_runtime import SocketRuntime

log = structlog.get_logger(__name__)

T = TypeVar("T")


class PodmanProvider(SandboxProvider):
    def __init__(self, *, url_factory: Callable[[], str], options: PodmanOptions) -> None:
        self._url_factory = url_factory
        self._options = options
        self._threads = ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="podman")
        # Moves exec'd commands into their groups while `podman exec` calls hold the other threads.
        self._adopter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cgroups")
        self._client: PodmanClient | None = None
        self._live: set[str] = set()
        self._slots = asyncio.Semaphore(options.max_sandboxes) if options.max_sandboxes else None
        self._background: set[asyncio.Future[Any]] = set()
        self._exec_only_images: set[str] = set()
        self._staging = RuntimeStaging(
            options.state_dir,
            options.instance_id,
            sandbox_user=options.sandbox_user,
            container_user=options.container_user,
        )
        self._limiter: CgroupV1Limiter | None = None

    async def call(self, fn: Callable[[], T]) -> T:
        """Run a blocking call (podman-py, file system) in the provider's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn)

    @property
    def client(self) -> PodmanClient:
        if self._client is None:
            raise SandboxError("sandbox provider not started")
        return self._client

    @property
    def busy(self) -> int:
        return len(self._live)

    async def start(self) -> None:
        url = self._url_factory()
        self._client = PodmanClient(base_url=url, timeout=120)
        await self.call(self._staging.stage)
        await asyncio.to_thread(check_host_limits, self._options.sandbox_user, self._options.max_sandboxes)
        if self._options.cgroup_limits and CgroupV1Limiter.usable():
            self._limiter = CgroupV1Limiter(f"prorl-{self._options.instance_id}")
        try:
            removed = await self.remove_ours()
        except Exception as exc:
            raise SandboxError(
                f"cannot use the Podman API at {url}: {exc}. Check sandbox.podman_socket, or leave it unset "
                "to let the server start one"
            ) from None
        if removed:
            log.warning("removed_leftover_containers", count=removed)

    # --- creation ----------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> Sandbox:
        runtime = spec.image not in self._exec_only_images
        if not runtime and not self._options.allow_exec_fallback:
            raise self._without_python(spec.image)
        sandbox = await self._create(spec, runtime=runtime)
        if sandbox is None:  # the image has no python3: remember, and fall back (or refuse)
            self._exec_only_images.add(spec.image)
            if not self._options.allow_exec_fallback:
                raise self._without_python(spec.image)
            log.warning("image_without_python3", image=spec.image, fallback="podman exec")
            sandbox = await self._create(spec, runtime=False)
        assert sandbox is not None
        return sandbox

    @staticmethod
    def _without_python(image: str) -> SandboxError:
        return SandboxError(
            f"sandbox image {image!r} has no python3, which the sandbox runtime needs; this server does not "
            "serve such images by `podman exec` (setting sandbox.allow_exec_fallback)",
            reason="sandbox_image_without_python",
        )

    async def _create(self, spec: SandboxSpec, *, runtime: bool) -> Sandbox | None:
        """The sandbox, or None when its image cannot run the runtime (no python3)."""
        name = f"prorl-{self._options.instance_id}-{secrets.token_hex(6)}"
        container = await self._start_container(spec, name, runtime=runtime)
        handle = PodmanContainer(self, name)
        init_pid = int(container.attrs["State"].get("Pid") or 0)
        if not runtime:
            exec_runtime = ExecRuntime(
                container,
                run_in_thread=self.call,
                max_output_bytes=self._options.max_output_bytes,
                confinement=self._confinement(name, init_pid),
            )
            return Sandbox(exec_runtime, handle)
        return await self._runtime_sandbox(container, handle, init_pid)

    async def _start_container(self, spec: SandboxSpec, name: str, *, runtime: bool) -> Any:
        """Create and start the container in the thread pool, its limits applied; counted
        from now until its removal is done, and removed even if the job is cancelled meanwhile."""
        labels = {LABEL_MANAGED: "1", LABEL_SERVER: self._options.instance_id, **spec.labels}
        kwargs = container_kwargs(
            spec, name=name, labels=labels, runtime=runtime, options=self._options, staging=self._staging
        )

        def create_and_start() -> Any:
            if runtime:
                self._staging.make_socket_dir(name)
            reusable = runtime and self._options.reusable
            container = self._create_runtime_container(spec, kwargs) if reusable else None
            if container is None:
                container = self.client.containers.create(spec.image, **kwargs)
            try:
                container.start()
                container.reload()
                pid = int(container.attrs["State"].get("Pid") or 0)
                # pid 0: it already exited (e.g. no python3); the runtime check says why.
                if self._limiter is not None and pid > 0:
                    self._limiter.apply(
                        name,
                        pid,
                        cpus=spec.cpus,
                        memory_bytes=spec.memory_mib * 1024 * 1024,
                        pids=spec.pids_limit,
                    )
            except Exception:
                container.remove(force=True)
                raise
            return container

        if self._slots is not None:
            await self._slots.acquire()  # a container is counted until its removal is done
        self._live.add(name)
        creation = asyncio.ensure_future(self.call(create_and_start))
        self._track(creation)
        try:
            return await asyncio.shield(creation)
        except asyncio.CancelledError:
            # The job was cancelled while Podman was still creating its container:
            # remove the container once it exists, or it would outlive the job.
            self._track(asyncio.ensure_future(self._remove_after(creation, name)))
            raise
        except Exception as exc:
            await self._forget(name)
            message = str(exc)
            if "image not known" in message or "no such image" in message.lower():
                raise SandboxError(
                    f"sandbox image {spec.image!r} is not on this node: `make images` builds the project's own, "
                    "others are pulled beforehand (docs/handlers.md)",
                    reason="sandbox_image",
                ) from exc
            raise SandboxError(f"could not start a sandbox from {spec.image!r}: {message}") from exc

    def _create_runtime_container(self, spec: SandboxSpec, kwargs: dict[str, Any]) -> Any:
        """Create through the Podman API itself: podman-py cannot express a tmpfs that keeps
        `exec` and an owner, nor leave out Podman's own read-only tmpfs paths. Blocking."""
        payload = self.client.containers._render_payload({"image": spec.image, **kwargs})
        payload["mounts"] += writable_mounts(spec, self._options)
        payload["read_only_tmpfs"] = False
        response = self.client.api.post(
            "/containers/create", headers={"content-type": "application/json"}, data=json.dumps(payload)
        )
        response.raise_for_status()
        return self.client.containers.get(response.json()["Id"])

    async def _runtime_sandbox(self, container: Any, handle: PodmanContainer, init_pid: int) -> Sandbox | None:
        """The sandbox served by its in-sandbox runtime, once it answers; None (and the container
        removed) when the image cannot run it."""
        name = handle.name
        try:
            client = await self._connect_runtime(name, container)
        except BaseException:
            await self.remove(name)
            raise
        if client is None:
            await self.remove(name)
            return None
        try:
            # What blame looks at when a call to this sandbox's runtime fails (see blame.py),
            # found now, before the agent has run anything.
            view = await self.call(lambda: HostView.find(init_pid, RUNTIME_MARKER))
        except BaseException:  # e.g. the job was cancelled meanwhile: the container must not outlive it
            await client.close()
            await self.remove(name)
            raise
        if view is None:
            log.warning("sandbox_processes_not_visible", container=name, pid=init_pid)
        inspector = HostInspector(view, handle, run_in_thread=self.call)
        socket_runtime = SocketRuntime(client, max_output_bytes=self._options.max_output_bytes, inspector=inspector)
        if view is not None and self._options.reusable:
            try:  # the new container as a reset must leave it: taken before any job ran in it
                if await self.call(lambda: reset_check.read_only(init_pid, IMAGE_MOUNT)):
                    handle.pristine = await self.call(lambda: reset_check.snapshot(init_pid, skip=NOT_RESET))
                    handle.view = view
                else:  # a job could change what resets restore from: never reused
                    log.warning("sandbox_image_mount_writable", container=name)
            except OSError as exc:  # not readable from here: it is never reused
                log.warning("sandbox_not_inspectable", container=name, error=str(exc))
            except BaseException:
                await client.close()
                await self.remove(name)
                raise
        return Sandbox(socket_runtime, handle)

    async def reset(self, handle: PodmanContainer, runtime: SandboxRuntime) -> list[str]:
        """Reset the sandbox for another job and prove it from the host (reset_check.py):
        the problems found, [] when it is as new."""
        if handle.pristine is None or handle.view is None:
            return ["the sandbox was not started reusable or cannot be inspected from the host"]
        view, pristine = handle.view, handle.pristine
        paths = [ResetPath(path, f"{IMAGE_MOUNT}{path}", reset_mode(path)) for path in writable_paths(self._options)]
        paths += [ResetPath(path, None, 0o1777) for path in ("/dev/shm", "/dev/mqueue")]
        reply = await runtime.reset(ResetRequest(tuple(paths), self._options.reset_timeout_s))
        problems = [f"process left: {pid}" for pid in reply.processes]
        problems += [f"IPC object left: {item}" for item in reply.ipc]
        problems += [f"key left: {item}" for item in reply.keys]
        problems += [f"{path} not restored: {why}" for path, why in reply.failed.items()]
        if problems:
            return problems

        def inspect() -> list[str]:
            found = [f"process left: {item}" for item in reset_check.stray_processes(view)]
            if view.runtime_state() is not RuntimeState.RUNNING:
                found.append("the runtime is not running")
            if found:  # with a process left, the file systems could still change
                return found
            found += [f"socket left: {line}" for line in reset_check.inet_sockets(view.runtime.pid)]
            found += reset_check.differences(pristine, reset_check.snapshot(view.init.pid, skip=NOT_RESET))
            reset_check.clear_socket_dir(self._staging.socket_dir(handle.name), SOCKET_NAME)
            extras = reset_check.socket_dir_extras(self._staging.socket_dir(handle.name), SOCKET_NAME)
            return found + [f"socket folder: {item}" for item in extras]

        problems = await self.call(inspect)
        ipc = await reset_check.sysv_ipc(view.init.pid)
        if ipc is None:
            problems.append("the sandbox's SysV IPC objects cannot be seen from the host")
        problems += [f"IPC object left: {line}" for line in ipc or []]
        return problems

    async def _connect_runtime(self, name: str, container: Any) -> RuntimeClient | None:
        """Wait for the runtime's socket; None when the image cannot run it."""
        socket_path = self._staging.socket_path(name)
        deadline = time.monotonic() + self._options.runtime_start_timeout_s
        checked_at = time.monotonic()
        while not socket_path.exists():
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"the sandbox runtime did not start within {self._options.runtime_start_timeout_s:g}s",
                    reason="sandbox_start",
                )
            if time.monotonic() - checked_at > 0.5:
                checked_at = time.monotonic()
                state = await self.call(lambda: (container.reload(), container.attrs["State"])[1])
                if state.get("Status") == "exited":
                    if state.get("ExitCode") == COMMAND_NOT_FOUND:
                        return None
                    raise SandboxError(
                        f"the sandbox exited at start (code {state.get('ExitCode')})", reason="sandbox_start"
                    )
            await asyncio.sleep(0.005)
        return await RuntimeClient.open(str(socket_path))

    def _confinement(self, name: str, init_pid: int) -> Confinement | None:
        """How exec'd commands enter the server-made groups; None where Podman applies the limits."""
        limiter = self._limiter
        if limiter is None:
            return None

        async def adopt(marker: bytes) -> bool:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._adopter, limiter.adopt, name, init_pid, marker)

        return Confinement(group=name, adopt=adopt)

    # --- what the containers' handles ask ---------------------------------------------------

    async def describe(self, name: str) -> str:
        """The container's state and last log lines, for error messages."""

        def inspect() -> str:
            try:
                container = self.client.containers.get(name)
                state = container.attrs.get("State", {})
                raw = container.logs(stdout=True, stderr=True, tail=12, stream=False)
                logs = raw if isinstance(raw, bytes) else b"".join(raw)
                tail = logs.decode(errors="replace").strip()[-1500:]
                return f"status={state.get('Status')} exit={state.get('ExitCode')} oom={state.get('OOMKilled')}; {tail}"
            except Exception as exc:  # diagnostics must never hide the original failure
                return f"not inspectable ({exc})"

        return await self.call(inspect)

    async def limits_hit(self, name: str) -> list[str]:
        """The limits of the server-made cgroups the container ran into; [] where Podman applies them."""
        limiter = self._limiter
        return await self.call(lambda: limiter.limits_hit(name)) if limiter else []

    async def writable_layer_bytes(self, name: str) -> int:
        def size() -> int:
            response = self.client.api.get(f"/containers/{name}/json", params={"size": "true"})
            response.raise_for_status()
            return int(response.json().get("SizeRw") or 0)

        try:
            return await self.call(size)
        except Exception:  # not knowing means not blaming the agent
            return 0

    async def remove(self, name: str) -> None:
        """Remove the container `name` with its cgroups and socket folder. Idempotent."""

        def remove() -> None:
            with contextlib.suppress(NotFound):
                self.client.containers.remove(name, force=True, v=True)
            if self._limiter is not None:
                self._limiter.remove(name)
            self._staging.remove_socket_dir(name)

        try:
            await self.call(remove)
        finally:
            self._release(name)

    # --- bookkeeping and cleanup -------------------------------------------------------------

    def _track(self, future: asyncio.Future[Any]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    async def _remove_after(self, creation: asyncio.Future[Any], name: str) -> None:
        with contextlib.suppress(Exception):
            await creation
        await self.remove(name)

    async def _settle(self) -> None:
        """Wait for container creations and removals still under way."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _release(self, name: str) -> None:
        if name in self._live:
            self._live.discard(name)
            if self._slots is not None:
                self._slots.release()

    async def _forget(self, name: str) -> None:
        self._release(name)
        await self.call(lambda: self._staging.remove_socket_dir(name))

    async def remove_ours(self) -> int:
        """Remove every container labelled as this server's; returns the count."""

        def remove_all() -> int:
            containers = self.client.containers.list(
                all=True, filters={"label": f"{LABEL_SERVER}={self._options.instance_id}"}
            )
            for container in containers:
                with contextlib.suppress(NotFound):
                    container.remove(force=True, v=True)
            if self._limiter is not None:
                self._limiter.remove_all()
            return len(containers)

        return await self.call(remove_all)

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._settle()
                await self.remove_ours()
                await self.call(self._staging.remove_socket_dirs)
            except Exception as exc:  # shutting down: report, and go on closing the rest
                log.error("sandbox_cleanup_failed", error=str(exc))
            finally:
                for name in list(self._live):
                    self._release(name)
                self._client.close()  # podman-py leaves it unannotated
                self._client = None
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._adopter.shutdown(wait=False, cancel_futures=True)
