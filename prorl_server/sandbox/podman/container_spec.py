"""The container a sandbox runs in: podman-py's `containers.create` arguments.

Every container runs with no network, no capabilities, `no_new_privileges`
(setuid binaries gain nothing), the seccomp profile staged beside the runtime
(staging.py), a tmpfs /tmp, and the spec's memory, cpu and pids limits.

A reusable runtime container (PodmanOptions.reusable, i.e. sandbox.reuse.enabled)
has a read-only root file system: it can write only to its writable paths
(PodmanOptions.writable_paths, each a tmpfs filled from the image when the
container starts), /dev/shm and /dev/mqueue. Its own image is
mounted read-only at IMAGE_MOUNT as well, the copy a reset restores those
paths from (sandbox/podman/reset_check.py, prorl_sandbox_runtime/reset.py `reset_runtime`).

A runtime container starts the in-sandbox runtime (bind-mounted read-only) as
its init, listening on a Unix socket in the per-sandbox folder the server
made; an exec container (images without python3) only sleeps, and each call
is a `podman exec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prorl_server.sandbox.base import SandboxSpec
from prorl_server.sandbox.podman.host_limits import USER_NPROC_CEILING
from prorl_server.sandbox.podman.options import PodmanOptions
from prorl_server.sandbox.podman.staging import SOCKET_NAME, RuntimeStaging
from prorl_server.sandbox.runtime import RUNTIME_FILE

RUNTIME_MOUNT = "/opt/prorl"
SOCKET_MOUNT = "/run/prorl"
IMAGE_MOUNT = "/opt/prorl-image"
"""The sandbox's image, read-only: what a reset restores the writable paths from."""
NOT_RESET = frozenset({SOCKET_MOUNT, RUNTIME_MOUNT, IMAGE_MOUNT})
"""Mounts a reset leaves alone: the socket folder is checked on the host, the others are read-only."""
WORLD_WRITABLE = frozenset({"/tmp", "/var/tmp"})
"""Writable paths owned by root with mode 1777; the others belong to the container user."""
# Exit code of a shell that could not find the command (no python3 in the image).
COMMAND_NOT_FOUND = 127
RUNTIME_MARKER = f"{RUNTIME_FILE.name} serve"
"""In the command line of the container's init and of the runtime it forks (see blame.HostView)."""


def container_kwargs(
    spec: SandboxSpec,
    *,
    name: str,
    labels: Mapping[str, str],
    runtime: bool,
    options: PodmanOptions,
    staging: RuntimeStaging,
) -> dict[str, Any]:
    memory = spec.memory_mib * 1024 * 1024
    # RLIMIT_NPROC counts every process of the host uid all sandboxes share:
    # as a per-sandbox limit it would let one sandbox starve the others, so it
    # is only the user-wide ceiling; pids per sandbox is the cgroup's job.
    nproc = USER_NPROC_CEILING
    kwargs: dict[str, Any] = {
        "name": name,
        "labels": dict(labels),
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
        "seccomp_profile_path": str(staging.seccomp_profile),
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
        binds = [
            {"type": "bind", "source": str(staging.runtime_dir), "target": RUNTIME_MOUNT, "read_only": True},
            {"type": "bind", "source": str(staging.socket_dir(name)), "target": SOCKET_MOUNT},
        ]
        if options.reusable:  # /tmp is among the writable paths (writable_mounts)
            kwargs["mounts"] = binds
            kwargs["read_only"] = True
            kwargs["image_volumes"] = [{"source": spec.image, "destination": IMAGE_MOUNT, "rw": False}]
        else:
            kwargs["mounts"] += binds
    else:
        kwargs["command"] = ["sleep", "infinity"]
    return kwargs


def writable_mounts(spec: SandboxSpec, options: PodmanOptions) -> list[dict[str, Any]]:
    """The tmpfs mounts of a runtime container's writable paths, in the Podman API's form
    (podman-py cannot say `exec` or the owner). Each is filled from the image (Podman's
    tmpcopyup); its size is bounded by the container's memory limit, which tmpfs pages count
    against."""
    mounts = []
    for path in writable_paths(options):
        if path in WORLD_WRITABLE:
            owner = ["mode=1777", f"size={options.tmp_mib}m"]
        else:
            owner = ["mode=0755", "U", f"size={spec.memory_mib}m"]  # U: owned by the container user
        mounts.append(
            {
                "type": "tmpfs",
                "source": "tmpfs",
                "destination": path,
                "options": ["rw", "exec", "nosuid", "nodev", *owner],
            }
        )
    return mounts


def writable_paths(options: PodmanOptions) -> list[str]:
    """The writable paths, /tmp and the workdir always among them, each once."""
    paths = ["/tmp", options.workdir, *options.writable_paths]
    return sorted({path.rstrip("/") or "/" for path in paths})


def reset_mode(path: str) -> int:
    """The mode a writable path's top gets back on reset (the one it was mounted with)."""
    return 0o1777 if path in WORLD_WRITABLE else 0o755
