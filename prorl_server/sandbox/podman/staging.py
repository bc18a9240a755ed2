"""What the server prepares on the host for its containers to mount.

Under `state_dir`: the in-sandbox program, the runtime and its judging harness
(`runtime/`: the two entry scripts and the package prorl_sandbox_runtime beside them,
mounted read-only at RUNTIME_MOUNT), the seccomp profile (read by Podman, outside any
container), and one socket folder per sandbox (`sockets/<instance id>/<name>`,
mounted at SOCKET_MOUNT), where the runtime creates its socket.

Every method blocks (file copies, chown): the provider calls them in its threads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prorl_server.sandbox import runtime
from prorl_server.sandbox.idmap import host_id

SECCOMP_PROFILE = Path(__file__).parent.parent / "seccomp.json"
"""Podman's default profile, except that no user namespace can be created inside
(unshare/clone with CLONE_NEWUSER fail with EPERM, clone3 with ENOSYS so that libc
falls back to clone), and no kernel key can be touched (keyctl fails with ENOSYS, as add_key
and request_key do in Podman's profile too): a user's keyrings are shared by every sandbox of
the same uid and outlive them, a channel between jobs no reset could close."""
SOCKET_NAME = "rt.sock"


class RuntimeStaging:
    def __init__(self, state_dir: Path, instance_id: str, *, sandbox_user: str, container_user: str) -> None:
        self.state_dir = state_dir
        self.runtime_dir = state_dir / "runtime"
        self.seccomp_profile = state_dir / SECCOMP_PROFILE.name
        self.sockets_dir = state_dir / "sockets" / instance_id
        self._sandbox_user = sandbox_user
        self._container_user = container_user

    def stage(self) -> None:
        """Copy the in-sandbox program where the sandbox user can read it (not the checkout,
        which may sit in a home folder it cannot enter), and start with no socket folders."""
        for folder in (self.state_dir, self.sockets_dir.parent):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)
        runtime.stage(self.runtime_dir)
        if not self.seccomp_profile.exists() or self.seccomp_profile.read_bytes() != SECCOMP_PROFILE.read_bytes():
            temporary = self.seccomp_profile.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(SECCOMP_PROFILE, temporary)
            temporary.chmod(0o644)
            temporary.replace(self.seccomp_profile)
        shutil.rmtree(self.sockets_dir, ignore_errors=True)
        self.sockets_dir.mkdir(parents=True)
        self.sockets_dir.chmod(0o755)

    def socket_dir(self, name: str) -> Path:
        return self.sockets_dir / name

    def socket_path(self, name: str) -> Path:
        return self.sockets_dir / name / SOCKET_NAME

    def make_socket_dir(self, name: str) -> Path:
        """The folder the sandbox `name`'s runtime creates its socket in, owned by the
        container user (or open to all, where the server cannot chown)."""
        folder = self.socket_dir(name)
        folder.mkdir(mode=0o700)
        if os.geteuid() == 0:
            uid, _, gid = self._container_user.partition(":")
            os.chown(
                folder,
                host_id(self._sandbox_user, int(uid)),
                host_id(self._sandbox_user, int(gid or uid), kind="gid"),
            )
        else:
            folder.chmod(0o777)  # cannot chown without root: the socket's own mode protects it
        return folder

    def remove_socket_dir(self, name: str) -> None:
        shutil.rmtree(self.socket_dir(name), ignore_errors=True)

    def remove_socket_dirs(self) -> None:
        shutil.rmtree(self.sockets_dir, ignore_errors=True)
