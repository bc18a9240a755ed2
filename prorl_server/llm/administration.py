"""What AdminService changes in the backend pool: one interface, two implementations.

`LocalAdministration` changes this server's router. In a cluster,
`ClusterAdministration` (prorl_server/cluster/admin.py) records the change in
the shared store, and every server applies it to its own router.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prorl_server.errors import FailedPrecondition, InvalidArgument
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
        """Resume under `policy_version` (None: the staged version, else current + 1); returns it."""
        ...

    async def update_weights(self, request: WeightUpdate) -> WeightsUpdated:
        """Load a checkpoint into the backends while paused and stage its version."""
        ...


@dataclass(frozen=True)
class WeightUpdate:
    model_path: str
    backend_ids: tuple[str, ...] = ()
    policy_version: int | None = None
    resume: bool = False


@dataclass(frozen=True)
class WeightsUpdated:
    policy_version: int
    loaded: list[tuple[str, float]]
    """(backend id, seconds to load), in the order loaded."""
    resumed: bool


def new_weights_version(request: WeightUpdate, current: int) -> int:
    """The version UpdateWeights gives the new weights: the one asked for, else current + 1."""
    if not request.model_path:
        raise InvalidArgument("model_path is required: the checkpoint the backends should load")
    if request.policy_version is None:
        return current + 1
    if request.policy_version <= current:
        raise FailedPrecondition(
            f"policy version {request.policy_version} is not newer than the current {current}: "
            "new weights need a new version"
        )
    return request.policy_version


async def tell_version(entries: Sequence[BackendEntry], version: int) -> None:
    """Each backend that loaded the weights records their version (vLLM's /update_weight_version),
    while generation is still paused: no request is sampled between the load and the record."""
    await asyncio.gather(*(entry.backend.set_weights_version(version) for entry in entries))


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

    async def update_weights(self, request: WeightUpdate) -> WeightsUpdated:
        version = new_weights_version(request, self._router.policy_version)
        targets = self._router.weight_targets(request.backend_ids)
        loaded = await self._router.load_weights(targets, request.model_path)
        await tell_version(targets, version)
        self._router.stage(version)
        if request.resume:
            self._router.resume(version)
        return WeightsUpdated(version, loaded, request.resume)
