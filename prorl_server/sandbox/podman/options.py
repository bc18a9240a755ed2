"""The Podman provider's settings (built by app.py from the `sandbox` config section)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PodmanOptions:
    instance_id: str
    """This server's instance id: its containers' names and LABEL_SERVER carry it."""
    state_dir: Path
    """Host folder for the staged runtime and the per-sandbox socket folders."""
    sandbox_user: str
    """The host user rootless Podman runs as (its subordinate ids own the socket folders)."""
    container_user: str
    """uid:gid the sandbox processes run as inside the container."""
    workdir: str
    """The sandbox's working directory (inside the container)."""
    tmp_mib: int
    """Size of the container's /tmp (a tmpfs)."""
    max_output_bytes: int
    """Cap on one tool call's output; its head and tail are kept."""
    threads: int
    """Threads for podman-py's blocking calls."""
    runtime_start_timeout_s: float
    cgroup_limits: bool
    """Apply the limits with cgroups the server makes (cgroup v1 hosts) where usable."""
    max_sandboxes: int = 0
    """Containers held at once, from creation until removal is done; 0: no limit."""
    allow_exec_fallback: bool = False
    """Serve images without python3 by `podman exec`; False: refuse them."""
    reusable: bool = False
    """Start runtime containers so that a reset can be proven (sandbox.reuse.enabled): a
    read-only root, the writable paths on tmpfs filled from the image, the image mounted
    read-only as the reset's source, a snapshot taken before the first job. False: the root
    is the container's own writable layer (only /tmp a tmpfs) and no sandbox is reset."""
    writable_paths: tuple[str, ...] = ("/tmp", "/var/tmp", "/home/agent", "/workspace", "/testbed")
    """With `reusable`: where a runtime container may write (each a tmpfs filled from the
    image; the root file system is read-only); /tmp and `workdir` always are."""
    reset_timeout_s: float = 30.0
    """The time a reset may take in the sandbox before it counts as failed."""
