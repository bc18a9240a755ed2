"""What AdminService changes in the backend pool: one interface, two implementations.

`LocalAdministration` changes this server's router. In a cluster,
`ClusterAdministration` (prorl_server/cluster/admin.py) records the change in
the shared store, and every server applies it to its own router.
"""

from __future__ import annotations

from typing import Protocol

from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendEntry, BackendRouter


class Administration(Protocol):
    async def add_backend(self, settings: BackendSettings) -> BackendEntry: ...

    async def remove_backend(self, backend_id: str) -> None: ...

    async def pause(self, *, abort_in_flight: bool) -> tuple[int, int]:
        """Stop new generation; returns (requests aborted, policy version)."""
        ...

    async def resume(self, policy_version: int | None) -> int:
        """Resume under `policy_version` (None: current + 1); returns it."""
        ...


class LocalAdministration:
    def __init__(self, router: BackendRouter, *, request_timeout_s: float, max_retries: int) -> None:
        self._router = router
        self._timeout_s = request_timeout_s
        self._max_retries = max_retries

    async def add_backend(self, settings: BackendSettings) -> BackendEntry:
        backend = build_backend(settings, timeout_s=self._timeout_s, max_retries=self._max_retries)
        return self._router.add(backend)

    async def remove_backend(self, backend_id: str) -> None:
        await self._router.remove(backend_id)

    async def pause(self, *, abort_in_flight: bool) -> tuple[int, int]:
        aborted = self._router.pause(abort_in_flight=abort_in_flight)
        return aborted, self._router.policy_version

    async def resume(self, policy_version: int | None) -> int:
        return self._router.resume(policy_version)
