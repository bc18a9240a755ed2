"""AdminService: the backends jobs are routed to, pause/resume, and the server's load."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from prorl_client import v1
from prorl_server.api.backend_messages import backend_to_proto, settings_from_proto
from prorl_server.errors import InvalidArgument
from prorl_server.llm.factory import build_backend
from prorl_server.llm.router import BackendRouter
from prorl_server.stats import ServerStats


class AdminServicer(v1.AdminServiceServicer):
    def __init__(
        self,
        router: BackendRouter,
        stats: Callable[[], ServerStats],
        *,
        request_timeout_s: float,
        max_retries: int,
    ) -> None:
        self._router = router
        self._stats = stats
        self._timeout_s = request_timeout_s
        self._max_retries = max_retries

    async def AddBackend(  # noqa: N802
        self, request: v1.AddBackendRequest, context: grpc.aio.ServicerContext
    ) -> v1.AddBackendResponse:
        settings = settings_from_proto(request.backend)
        backend = build_backend(settings, timeout_s=self._timeout_s, max_retries=self._max_retries)
        entry = self._router.add(backend)
        return v1.AddBackendResponse(backend=backend_to_proto(entry))

    async def RemoveBackend(  # noqa: N802
        self, request: v1.RemoveBackendRequest, context: grpc.aio.ServicerContext
    ) -> v1.RemoveBackendResponse:
        await self._router.remove(request.backend_id)
        return v1.RemoveBackendResponse()

    async def ListBackends(  # noqa: N802
        self, request: v1.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> v1.ListBackendsResponse:
        return v1.ListBackendsResponse(backends=[backend_to_proto(e) for e in self._router.entries()])

    async def Pause(  # noqa: N802
        self, request: v1.PauseRequest, context: grpc.aio.ServicerContext
    ) -> v1.PauseResponse:
        pool = self._router
        aborted = pool.pause(abort_in_flight=request.abort_in_flight)
        return v1.PauseResponse(aborted=aborted, policy_version=pool.policy_version)

    async def Resume(  # noqa: N802
        self, request: v1.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> v1.ResumeResponse:
        version = request.policy_version if request.HasField("policy_version") else None
        if version is not None and version < 0:
            raise InvalidArgument(f"policy_version must not be negative, got {version}")
        return v1.ResumeResponse(policy_version=self._router.resume(version))

    async def GetStats(  # noqa: N802
        self, request: v1.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> v1.GetStatsResponse:
        stats = self._stats()
        return v1.GetStatsResponse(
            phases=[
                v1.PhaseStats(phase=load.phase, queued=load.queued, active=load.active, limit=load.limit)
                for load in stats.phases
            ],
            sandboxes_busy=stats.sandboxes_busy,
            pools=[
                v1.SandboxPoolStats(
                    image=p.image,
                    cpus=p.cpus,
                    memory_mib=p.memory_mib,
                    pids_limit=p.pids_limit,
                    warm=p.warm,
                    busy=p.busy,
                    target=p.target,
                )
                for p in stats.pools
            ],
            jobs=[
                v1.JobStatusCount(status=status, count=count) for status, count in sorted(stats.jobs_by_status.items())
            ],
            backends=[backend_to_proto(e) for e in stats.backends],
            policy_version=stats.policy_version,
            paused=stats.paused,
        )
