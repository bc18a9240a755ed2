"""Starts and supervises a rootless `podman system service` for the server.

When the server runs as root (as on these machines, whose Python an
unprivileged user cannot read), the Podman API service runs as the
unprivileged sandbox user: every container is then a rootless one.
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

import aiohttp
import structlog

from prorl_server.errors import SandboxError
from prorl_server.supervisor import ChildExited, SupervisedProcess

log = structlog.get_logger(__name__)


class PodmanService:
    """One `podman system service` process listening on a private socket."""

    def __init__(self, *, user: str, name: str, startup_timeout_s: float = 30.0) -> None:
        self._user = user
        self._name = name
        self._startup_timeout_s = startup_timeout_s
        self._child: SupervisedProcess | None = None
        self.socket_path: Path | None = None

    @property
    def url(self) -> str:
        if self.socket_path is None:
            raise SandboxError("podman service not started")
        return f"unix://{self.socket_path}"

    def _command(self) -> tuple[list[str], Path]:
        command, socket_path = self._service_command()
        # The service ends with the server, even a SIGKILLed one: setpriv (util-linux)
        # asks the kernel to send SIGTERM when the server dies, and runuser passes it on.
        if shutil.which("setpriv") is not None:
            command = ["setpriv", "--pdeathsig", "SIGTERM", "--", *command]
        return command, socket_path

    def _service_command(self) -> tuple[list[str], Path]:
        if shutil.which("podman") is None:
            raise SandboxError("podman is not installed: run scripts/setup_host.sh")
        if os.geteuid() != 0:
            runtime_dir = Path(os.environ.get("XDG_RUNTIME_DIR", f"/run/user/{os.getuid()}"))
            socket_path = runtime_dir / f"prorl-{self._name}-{os.getpid()}.sock"
            return ["podman", "system", "service", "--time=0", f"unix://{socket_path}"], socket_path
        try:
            account = pwd.getpwnam(self._user)
        except KeyError:
            raise SandboxError(
                f"sandbox user {self._user!r} does not exist: run scripts/setup_host.sh or set sandbox.sandbox_user"
            ) from None
        runtime_dir = Path(f"/run/user/{account.pw_uid}")
        runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(runtime_dir, account.pw_uid, account.pw_gid)
        socket_path = runtime_dir / f"prorl-{self._name}-{os.getpid()}.sock"
        command = [
            "runuser", "-u", self._user, "--",
            "env", f"XDG_RUNTIME_DIR={runtime_dir}", f"HOME={account.pw_dir}",
            "podman", "system", "service", "--time=0", f"unix://{socket_path}",
        ]  # fmt: skip
        return command, socket_path

    async def start(self) -> None:
        command, socket_path = self._command()
        socket_path.unlink(missing_ok=True)
        self.socket_path = socket_path
        # cwd "/": the sandbox user may not be able to enter the server's cwd.
        self._child = SupervisedProcess("podman system service", command, cwd="/")
        try:
            await self._child.start(self._ready, self._startup_timeout_s)
        except (TimeoutError, ChildExited) as exc:
            raise SandboxError(f"podman system service did not start: {exc}\n{self._child.stderr_tail}") from None
        log.info("podman_service_started", socket=str(socket_path), user=self._user)

    async def _ready(self) -> bool:
        assert self.socket_path is not None
        if not self.socket_path.exists():
            return False
        try:
            connector = aiohttp.UnixConnector(path=str(self.socket_path))
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.get("http://podman/_ping") as response,
            ):
                return response.status == 200
        except aiohttp.ClientError:
            return False

    async def stop(self) -> None:
        if self._child is not None:
            await self._child.stop()
            self._child = None
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)
