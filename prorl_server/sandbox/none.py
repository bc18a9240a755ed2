"""The provider of a server that runs no jobs (a cluster's front: cluster.run_jobs = false).

Such a server never claims a job, so nothing asks it for a sandbox; it needs no
Podman. Should anything ask, the answer says why there is none.
"""

from __future__ import annotations

from prorl_server.errors import SandboxError
from prorl_server.sandbox.base import SandboxProvider, SandboxSpec
from prorl_server.sandbox.sandbox import Sandbox


class NoSandboxes(SandboxProvider):
    async def start(self) -> None:
        return None

    async def create(self, spec: SandboxSpec) -> Sandbox:
        raise SandboxError(
            "this server runs no sandboxes (cluster.run_jobs = false): its peers run the jobs",
            reason="sandbox_start",
        )

    @property
    def busy(self) -> int:
        return 0

    async def close(self) -> None:
        return None
