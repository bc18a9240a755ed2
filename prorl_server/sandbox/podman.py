"""Sandboxes as rootless Podman containers, through podman-py.

podman-py is synchronous: every call runs in a bounded thread pool, never on
the event loop. Each container carries the labels `prorl.managed=1` and
`prorl.server=<instance id>`; cleanup removes exactly the containers with this
server's label.

A container starts the in-sandbox runtime (bind-mounted read-only) listening
on a Unix socket in a per-sandbox folder the server created; the server talks
to it over that socket. An image without python3 is refused, or served by
`podman exec` when the operator allows that fallback.

Every container runs with no capabilities, `no_new_privileges` (setuid
binaries gain nothing) and the seccomp profile shipped beside this module:
Podman's default one, except that no user namespace can be created inside
(unshare/clone with CLONE_NEWUSER fail with EPERM, clone3 with ENOSYS so that
libc falls back to clone).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
from podman import PodmanClient
from podman.errors import NotFound

from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import Sandbox, SandboxProvider, SandboxSpec
from prorl_server.sandbox.blame import HostInspector, HostView
from prorl_server.sandbox.cgroups import CgroupV1Limiter
from prorl_server.sandbox.exec_sandbox import Confinement, ExecSandbox
from prorl_server.sandbox.idmap import host_id
from prorl_server.sandbox.runtime import JUDGE_FILE, RUNTIME_FILE
from prorl_server.sandbox.runtime.client import RuntimeClient
from prorl_server.sandbox.runtime_sandbox import RuntimeSandbox

log = structlog.get_logger(__name__)

T = TypeVar("T")

LABEL_MANAGED = "prorl.managed"
LABEL_SERVER = "prorl.server"
LABEL_JOB = "prorl.job"
LABEL_POOL = "prorl.pool"
RUNTIME_MOUNT = "/opt/prorl"
SOCKET_MOUNT = "/run/prorl"
SOCKET_NAME = "rt.sock"
# The sandbox user's process ceiling (containers.conf default_ulimits; the
# rootless user cannot raise its hard limit beyond it).
USER_NPROC_CEILING = 4096
# Exit code of a shell that could not find the command (no python3 in the image).
COMMAND_NOT_FOUND = 127
SECCOMP_PROFILE = Path(__file__).with_name("seccomp.json")


@dataclass(frozen=True)
class PodmanOptions:
    instance_id: str
    state_dir: Path
    """Host folder for the staged runtime and the per-sandbox socket folders."""
    sandbox_user: str
    container_user: str
    """uid:gid the sandbox processes run as inside the container."""
    workdir: str
    tmp_mib: int
    max_output_bytes: int
    threads: int
    runtime_start_timeout_s: float
    cgroup_limits: bool
    max_sandboxes: int = 0
    """Containers held at once, from creation until removal is done; 0: no limit."""
    allow_exec_fallback: bool = False
    """Serve images without python3 by `podman exec`; False: refuse them."""


class PodmanProvider(SandboxProvider):
    def __init__(self, *, url_factory: Callable[[], str], options: PodmanOptions) -> None:
        self._url_factory = url_factory
        self._options = options
        self._pool = ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="podman")
        # Moves exec'd commands into their groups while `podman exec` calls hold the pool's threads.
        self._adopter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cgroups")
        self._client: PodmanClient | None = None
        self._live: set[str] = set()
        self._slots = asyncio.Semaphore(options.max_sandboxes) if options.max_sandboxes else None
        self._background: set[asyncio.Future[Any]] = set()
        self._exec_only_images: set[str] = set()
        self._runtime_dir = options.state_dir / "runtime"
        self._seccomp_profile = options.state_dir / SECCOMP_PROFILE.name
        self._sockets_dir = options.state_dir / "sockets" / options.instance_id
        self._limiter: CgroupV1Limiter | None = None

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

    @property
    def limits_enforced_by(self) -> str:
        return "cgroup-v1 (server)" if self._limiter else "podman"

    async def start(self) -> None:
        url = self._url_factory()
        self._client = PodmanClient(base_url=url, timeout=120)
        await self.call(self._stage_runtime)
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

    def _stage_runtime(self) -> None:
        """Copy the runtime where the sandbox user can read it (not the checkout,
        which may sit in a home folder it cannot enter)."""
        self._runtime_dir.mkdir(parents=True, exist_ok=True)
        for folder in (self._options.state_dir, self._runtime_dir, self._sockets_dir.parent):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)
        # The seccomp profile is read by Podman (the sandbox user), outside any container.
        for source, staged in (
            (RUNTIME_FILE, self._runtime_dir / RUNTIME_FILE.name),
            (JUDGE_FILE, self._runtime_dir / JUDGE_FILE.name),
            (SECCOMP_PROFILE, self._seccomp_profile),
        ):
            if not staged.exists() or staged.read_bytes() != source.read_bytes():
                temporary = staged.with_suffix(f".{os.getpid()}.tmp")
                shutil.copyfile(source, temporary)
                temporary.chmod(0o644)
                temporary.replace(staged)
        shutil.rmtree(self._sockets_dir, ignore_errors=True)
        self._sockets_dir.mkdir(parents=True)
        self._sockets_dir.chmod(0o755)

    def _socket_dir(self, name: str) -> Path:
        folder = self._sockets_dir / name
        folder.mkdir(mode=0o700)
        if os.geteuid() == 0:
            uid, _, gid = self._options.container_user.partition(":")
            os.chown(
                folder,
                host_id(self._options.sandbox_user, int(uid)),
                host_id(self._options.sandbox_user, int(gid or uid), kind="gid"),
            )
        else:
            folder.chmod(0o777)  # cannot chown without root: the socket's own mode protects it
        return folder

    def _create_kwargs(self, spec: SandboxSpec, name: str, labels: dict[str, str], runtime: bool) -> dict[str, Any]:
        options = self._options
        memory = spec.memory_mib * 1024 * 1024
        # RLIMIT_NPROC counts every process of the host uid all sandboxes share:
        # as a per-sandbox limit it would let one sandbox starve the others, so it
        # is only the user-wide ceiling; pids per sandbox is the cgroup's job.
        nproc = USER_NPROC_CEILING
        kwargs: dict[str, Any] = {
            "name": name,
            "labels": labels,
            "network_mode": "none",
            "init": True,
            "user": options.container_user,
            "working_dir": options.workdir,
            "mem_limit": memory,
            "memswap_limit": memory,
            "nano_cpus": int(spec.cpus * 1e9),
            "pids_limit": spec.pids_limit,
            "ulimits": [
                {"Name": "nproc", "Soft": nproc, "Hard": nproc},
                {"Name": "nofile", "Soft": 1024, "Hard": 1024},
            ],
            "cap_drop": ["ALL"],
            # podman-py sends `security_opt` as SELinux options: these are the API's own fields.
            "no_new_privileges": True,
            "seccomp_profile_path": str(self._seccomp_profile),
            "mounts": [{"type": "tmpfs", "target": "/tmp", "size": f"{options.tmp_mib}m", "mode": "1777"}],
        }
        if runtime:
            # Exit 127 when the image has no python3: the caller falls back to exec.
            # The runtime is the container's init itself (`--init`, no catatonit): PID 1
            # cannot be signalled from inside, so it outlives whatever the agent does to
            # the runtime it serves from, and the server can tell that apart (blame.py).
            kwargs["init"] = False
            # Removal kills at once: a SIGTERM that lands while PID 1 is still starting (the
            # shell, or Python before it waits for signals) is dropped, as for any init.
            kwargs["stop_timeout"] = 0
            kwargs["command"] = [
                "/bin/sh", "-c", 'command -v python3 >/dev/null 2>&1 || exit 127; exec python3 "$@"', "sh",
                f"{RUNTIME_MOUNT}/{RUNTIME_FILE.name}", "serve", "--init",
                "--socket", f"{SOCKET_MOUNT}/{SOCKET_NAME}", "--workdir", options.workdir,
            ]  # fmt: skip
            kwargs["mounts"] += [
                {"type": "bind", "source": str(self._runtime_dir), "target": RUNTIME_MOUNT, "read_only": True},
                {"type": "bind", "source": str(self._sockets_dir / name), "target": SOCKET_MOUNT},
            ]
        else:
            kwargs["command"] = ["sleep", "infinity"]
        return kwargs

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
        name = f"prorl-{self._options.instance_id}-{secrets.token_hex(6)}"
        labels = {LABEL_MANAGED: "1", LABEL_SERVER: self._options.instance_id, **spec.labels}

        def create_and_start() -> Any:
            if runtime:
                self._socket_dir(name)
            container = self.client.containers.create(spec.image, **self._create_kwargs(spec, name, labels, runtime))
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
            container = await asyncio.shield(creation)
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
                    f"sandbox image {spec.image!r} is not built: run `make images`", reason="sandbox_image"
                ) from exc
            raise SandboxError(f"could not start a sandbox from {spec.image!r}: {message}") from exc

        async def remove() -> None:
            await self.remove(name)

        if not runtime:
            return ExecSandbox(
                container,
                run_in_thread=self.call,
                max_output_bytes=self._options.max_output_bytes,
                remove=remove,
                confinement=self._confinement(name, int(container.attrs["State"].get("Pid") or 0)),
            )
        try:
            client = await self._connect_runtime(name, container)
        except BaseException:
            await self.remove(name)
            raise
        if client is None:
            await self.remove(name)
            return None
        try:
            inspector = await self._inspector(name, int(container.attrs["State"].get("Pid") or 0))
        except BaseException:  # e.g. the job was cancelled meanwhile: the container must not outlive it
            await client.close()
            await self.remove(name)
            raise
        return RuntimeSandbox(
            name, client, max_output_bytes=self._options.max_output_bytes, remove=remove, inspector=inspector
        )

    async def _inspector(self, name: str, init_pid: int) -> HostInspector:
        """What blame looks at when a call to this sandbox's runtime fails (see blame.py)."""
        view = await self.call(lambda: HostView.find(init_pid, f"{RUNTIME_FILE.name} serve"))
        if view is None:
            log.warning("sandbox_processes_not_visible", container=name, pid=init_pid)

        async def limits_hit() -> list[str]:
            limiter = self._limiter
            return await self.call(lambda: limiter.limits_hit(name)) if limiter else []

        async def describe() -> str:
            return await self.describe(name)

        async def writable_layer_bytes() -> int:
            def size() -> int:
                response = self.client.api.get(f"/containers/{name}/json", params={"size": "true"})
                response.raise_for_status()
                return int(response.json().get("SizeRw") or 0)

            try:
                return await self.call(size)
            except Exception:  # not knowing means not blaming the agent
                return 0

        return HostInspector(
            view,
            limits_hit=limits_hit,
            describe=describe,
            writable_layer_bytes=writable_layer_bytes,
            run_in_thread=self.call,
        )

    def _confinement(self, name: str, init_pid: int) -> Confinement | None:
        """How exec'd commands enter the server-made groups; None where Podman applies the limits."""
        limiter = self._limiter
        if limiter is None:
            return None

        async def adopt(marker: bytes) -> bool:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._adopter, limiter.adopt, name, init_pid, marker)

        return Confinement(group=name, adopt=adopt)

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

    async def _connect_runtime(self, name: str, container: Any) -> RuntimeClient | None:
        """Wait for the runtime's socket; None when the image cannot run it."""
        socket_path = self._sockets_dir / name / SOCKET_NAME
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
        client = RuntimeClient(str(socket_path))
        await client.connect()
        try:
            await client.call("health")
        except BaseException:
            await client.close()
            raise
        return client

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
        await self.call(lambda: shutil.rmtree(self._sockets_dir / name, ignore_errors=True))

    async def remove(self, name: str) -> None:
        def remove() -> None:
            with contextlib.suppress(NotFound):
                self.client.containers.remove(name, force=True, v=True)
            if self._limiter is not None:
                self._limiter.remove(name)
            shutil.rmtree(self._sockets_dir / name, ignore_errors=True)

        try:
            await self.call(remove)
        finally:
            self._release(name)

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
                await self.call(lambda: shutil.rmtree(self._sockets_dir, ignore_errors=True))
            except Exception as exc:  # shutting down: report, and go on closing the rest
                log.error("sandbox_cleanup_failed", error=str(exc))
            finally:
                for name in list(self._live):
                    self._release(name)
                self._client.close()
                self._client = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._adopter.shutdown(wait=False, cancel_futures=True)
