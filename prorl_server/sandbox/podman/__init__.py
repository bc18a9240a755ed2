"""Sandboxes as rootless Podman containers.

    provider.py        PodmanProvider: create, remove, reap; threads and slots
    options.py         PodmanOptions, its settings
    container_spec.py  the containers' create arguments: limits, seccomp, mounts, the runtime's command
    staging.py         what containers mount from the host: the runtime, the profile, socket folders
    container.py       PodmanContainer, the handle a Sandbox is removed (or reset) through
    reset_check.py     the host's proof that a reset left nothing of the previous job
    exec_runtime.py    ExecRuntime, `podman exec` for images without python3

The labels are provider-neutral (sandbox/base.py); they are re-exported here
for the code that still imports them from this package.
"""

from prorl_server.sandbox.base import LABEL_JOB, LABEL_MANAGED, LABEL_POOL, LABEL_SERVER
from prorl_server.sandbox.podman.container import PodmanContainer
from prorl_server.sandbox.podman.container_spec import RUNTIME_MOUNT, SOCKET_MOUNT
from prorl_server.sandbox.podman.exec_runtime import Confinement, ExecRuntime
from prorl_server.sandbox.podman.options import PodmanOptions
from prorl_server.sandbox.podman.provider import PodmanProvider
from prorl_server.sandbox.podman.staging import SECCOMP_PROFILE, SOCKET_NAME

__all__ = [
    "LABEL_JOB",
    "LABEL_MANAGED",
    "LABEL_POOL",
    "LABEL_SERVER",
    "RUNTIME_MOUNT",
    "SECCOMP_PROFILE",
    "SOCKET_MOUNT",
    "SOCKET_NAME",
    "Confinement",
    "ExecRuntime",
    "PodmanContainer",
    "PodmanOptions",
    "PodmanProvider",
]
