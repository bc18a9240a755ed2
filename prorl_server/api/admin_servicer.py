"""AdminService: the backends jobs are routed to, pause/resume, and the server's load."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from prorl_client import v1
from prorl_server.api.backend_messages import backend_to_proto, settings_from_proto
from prorl_server.errors import InvalidArgument
from prorl_server.llm.administration import Administration, WeightUpdate
from prorl_server.llm.router import BackendRouter
from prorl_server.stats import ServerStats

ClusterView = Callable[[], Awaitable[tuple[list[v1.ServerSummary], dict[int, int]]]]
"""Every server of the cluster and the cluster's jobs by status."""


class AdminServicer(v1.AdminServiceServicer):
    def __init__(
        self,
        router: BackendRouter,
        administration: Administration,
        stats: Callable[[], ServerStats],
        *,
        server_id: str = "",
        cluster_view: ClusterView | None = None,
        judge_router: BackendRouter | None = None,
    ) -> None:
        """`judge_router`: the judges' own pool, listed beside the policy's (None: the judges share
        the policy's pool, or there are none)."""
        self._router = router
        self._judge_router = judge_router
        self._admin = administration
        self._stats = stats
        self._server_id = server_id
        self._cluster_view = cluster_view

    async def AddBackend(  # noqa: N802
        self, request: v1.AddBackendRequest, context: grpc.aio.ServicerContext
    ) -> v1.AddBackendResponse:
        entry = await self._admin.add_backend(settings_from_proto(request.backend))
        return v1.AddBackendResponse(backend=backend_to_proto(entry))

    async def RemoveBackend(  # noqa: N802
        self, request: v1.RemoveBackendRequest, context: grpc.aio.ServicerContext
    ) -> v1.RemoveBackendResponse:
        await self._admin.remove_backend(request.backend_id)
        return v1.RemoveBackendResponse()

    async def ListBackends(  # noqa: N802
        self, request: v1.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> v1.ListBackendsResponse:
        return v1.ListBackendsResponse(
            backends=[backend_to_proto(e) for e in self._router.entries()], judge_backends=self._judge_backends()
        )

    def _judge_backends(self) -> list[v1.Backend]:
        if self._judge_router is None:
            return []
        return [backend_to_proto(e) for e in self._judge_router.entries()]

    async def Pause(  # noqa: N802
        self, request: v1.PauseRequest, context: grpc.aio.ServicerContext
    ) -> v1.PauseResponse:
        aborted, version = await self._admin.pause(abort_in_flight=request.abort_in_flight)
        return v1.PauseResponse(aborted=aborted, policy_version=version)

    async def Resume(  # noqa: N802
        self, request: v1.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> v1.ResumeResponse:
        return v1.ResumeResponse(policy_version=await self._admin.resume(_policy_version(request)))

    async def UpdateWeights(  # noqa: N802
        self, request: v1.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> v1.UpdateWeightsResponse:
        update = WeightUpdate(request.model_path, tuple(request.backend_ids), _policy_version(request), request.resume)
        done = await self._admin.update_weights(update)
        response = v1.UpdateWeightsResponse(policy_version=done.policy_version, resumed=done.resumed)
        for backend_id, seconds in done.loaded:
            loaded = response.backends.add(backend_id=backend_id)
            loaded.load_time.FromNanoseconds(int(seconds * 1e9))
        return response

    async def GetStats(  # noqa: N802
        self, request: v1.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> v1.GetStatsResponse:
        stats = self._stats()
        response = v1.GetStatsResponse(
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
            judge_backends=self._judge_backends(),
            policy_version=stats.policy_version,
            paused=stats.paused,
            server_id=self._server_id,
        )
        if request.include_cluster and self._cluster_view is not None:
            servers, jobs = await self._cluster_view()
            response.servers.extend(servers)
            response.cluster_jobs.extend(
                v1.JobStatusCount(status=status, count=count)  # type: ignore[arg-type]
                for status, count in sorted(jobs.items())
            )
        return response


def _policy_version(request: v1.ResumeRequest | v1.UpdateWeightsRequest) -> int | None:
    """The request's policy version; None when unset."""
    if not request.HasField("policy_version"):
        return None
    if request.policy_version < 0:
        raise InvalidArgument(f"policy_version must not be negative, got {request.policy_version}")
    return request.policy_version
