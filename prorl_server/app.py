"""Wiring: builds every component from the settings, starts and stops them in order.

What differs between a server on its own and one of a cluster is the mode's
(modes/): its job store, job manager, services and background tasks.
Start: job store (and, with PostgreSQL, the cluster's notifications) -> Podman
API -> sandbox provider (reaps leftovers) -> LLM backends (embedded model if
none) -> job manager -> gRPC server (+ health, reflection) -> the mode's
background tasks (a cluster's coordinator: claims jobs).
Stop (idempotent): health NOT_SERVING -> stop claiming and admitting -> let
jobs finish within the grace period, cancel the rest (in a cluster: hand them
to a peer) -> stop the gRPC server -> remove this server's containers -> stop
the children.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prorl_client import v1
from prorl_server.agents.registry import HandlerRegistry, default_registry
from prorl_server.api.admin_servicer import AdminServicer
from prorl_server.api.auth import BearerTokenInterceptor
from prorl_server.api.errors import ErrorInterceptor
from prorl_server.api.rollout_servicer import RolloutServicer
from prorl_server.config import ConfigError, Settings
from prorl_server.gateway.aiohttp_adapter import GatewayServer
from prorl_server.gateway.directory import GatewayDirectory
from prorl_server.jobs.feed import Feed
from prorl_server.jobs.forks import ForkRegistry
from prorl_server.jobs.manager import JobManager
from prorl_server.jobs.phases import PhaseGate, phase_gates
from prorl_server.jobs.pipeline import Pipeline
from prorl_server.jobs.service import JobService
from prorl_server.llm.base import BackendInfo, LLMBackend
from prorl_server.llm.factory import build_backend
from prorl_server.llm.llama_cpp_backend import EMBEDDED_MODEL_NAME, LlamaCppBackend
from prorl_server.llm.router import BackendRouter
from prorl_server.metrics import Metrics
from prorl_server.modes.base import JobParts, ServerHooks, Services
from prorl_server.modes.factory import build_mode
from prorl_server.sandbox.allocator import ReusePolicy, SandboxAllocator
from prorl_server.sandbox.base import LABEL_POOL, SandboxProvider, SandboxSpec
from prorl_server.sandbox.none import NoSandboxes
from prorl_server.sandbox.podman import PodmanOptions, PodmanProvider
from prorl_server.sandbox.podman.service import PodmanService
from prorl_server.stats import PhaseLoad, ServerStats
from prorl_server.verifiers import checker_pool
from prorl_server.verifiers.judge import ModelJudge, judge_options

log = structlog.get_logger(__name__)

SERVICE_NAMES = ("prorl.v1.RolloutService", "prorl.v1.AdminService")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProrlServer:
    def __init__(
        self,
        settings: Settings,
        *,
        registry: HandlerRegistry | None = None,
        sandbox_provider: SandboxProvider | None = None,
        backends: Sequence[LLMBackend] = (),
        judge_backends: Sequence[LLMBackend] = (),
    ) -> None:
        """`sandbox_provider` replaces the Podman one the settings describe (no Podman service
        is started then); `backends` are served beside the configured ones. Both are for
        embedding the server, e.g. in the fast tests with in-process fakes; `judge_backends` are
        served beside the configured judge backends (settings `judge.*`)."""
        self.settings = settings
        self._mode = build_mode(settings)
        self._registry = registry or default_registry()
        self._podman: PodmanService | None = None
        self._provider: SandboxProvider | None = sandbox_provider
        self._extra_backends = list(backends)
        self._sandboxes: SandboxAllocator | None = None
        self._router = BackendRouter(
            health_interval_s=settings.llm.health_interval_s,
            failed_checks_to_evict=settings.llm.health_failures_to_evict,
        )
        self._extra_judge_backends = list(judge_backends)
        judge = settings.judge
        self._judge_router = (
            self._router
            if judge.use_policy_backends
            else BackendRouter(
                health_interval_s=judge.health_interval_s, failed_checks_to_evict=settings.llm.health_failures_to_evict
            )
        )
        phases = settings.phases
        self._gates: dict[v1.Phase, PhaseGate] = phase_gates(init=phases.init, run=phases.run, eval=phases.eval)
        self._gateways = GatewayDirectory()
        self._gateway_server: GatewayServer | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.manager: JobManager | None = None
        self.metrics = Metrics()
        self._feed = Feed(self._mode.store, settings.subscribe)
        self.jobs: JobService | None = None
        self._forks: ForkRegistry | None = None
        self.port = 0
        self._stopped = False
        self._holds_checkers = False

    @property
    def gateway_port(self) -> int | None:
        """The port the jobs' model gateways are served on outside the sandboxes, once started."""
        return self._gateway_server.port if self._gateway_server is not None else None

    @property
    def address(self) -> str:
        return f"{self.settings.server.host}:{self.port}"

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        settings = self.settings
        # jobs.store: SQLite, PostgreSQL or none; first, so that a store that cannot be
        # used stops the start before any sandbox or model is started.
        await self._mode.open()
        if self._provider is None:
            self._provider = await self._podman_provider() if self._mode.runs_jobs else NoSandboxes()
        await self._provider.start()
        reuse = self.settings.sandbox.reuse
        policy = ReusePolicy(
            enabled=reuse.enabled,
            max_idle=reuse.max_idle_per_pool,
            idle_s=reuse.idle_s,
            max_jobs=reuse.max_jobs_per_sandbox,
            reset_timeout_s=reuse.reset_timeout_s + 30.0,  # the proof's share on top of the runtime's
        )
        self._sandboxes = SandboxAllocator(self._provider, self._warm_pool_specs(), reuse=policy)
        self._sandboxes.start()
        await checker_pool.hold_shared_pool(settings.verifier)
        self._holds_checkers = True
        await self._start_backends()
        await self._start_judge_backends()
        if settings.server.gateway_port is not None:
            self._gateway_server = GatewayServer(
                self._gateways,
                host=settings.server.host,
                port=settings.server.gateway_port,
                body_timeout_s=settings.gateway.body_timeout_s,
                header_timeout_s=settings.gateway.header_timeout_s,
            )
            await self._gateway_server.start()
        self._forks = forks = ForkRegistry(
            Path(settings.sandbox.state_dir) / "forks" / settings.server.instance_id,
            max_snapshot_bytes=settings.jobs.fork_snapshot_max_bytes,
            max_total_bytes=settings.jobs.fork_snapshots_max_bytes,
        )
        pipeline = Pipeline(
            forks=forks,
            gates=self._gates,
            sandboxes=self._sandboxes,
            router=self._router,
            metrics=self.metrics,
            gateways=self._gateways,
            gateway_port=lambda: self.gateway_port,
            gateway_host=_host_of(settings.cluster.advertise_address) or settings.server.host,
            gateway_limits=settings.gateway,
            judge=ModelJudge(
                self._judge_router,
                judge_options(settings.judge),
                metrics=self.metrics,
                pool_name="llm.backends" if settings.judge.use_policy_backends else "judge.backends",
            ),
        )
        services = self._mode.services(
            JobParts(
                registry=self._registry,
                pipeline=pipeline,
                metrics=self.metrics,
                router=self._router,
                forks=forks,
                on_stored=self._feed.nudge,
            )
        )
        self.manager, self.jobs = services.manager, services.jobs
        await self.manager.restore()
        await self._feed.start()
        if settings.server.metrics_port is not None:
            self.metrics.watch(self.stats)
            tokens = settings.server.accepted_tokens() if settings.server.metrics_require_token else []
            await self.metrics.serve(settings.server.host, settings.server.metrics_port, tokens=tokens)
        await self._start_grpc(services)
        await self._mode.start(
            ServerHooks(stats=self.stats, address=lambda: self.address, set_serving=self._set_serving)
        )
        log.info("server_started", address=self.address, instance=settings.server.instance_id)

    async def _podman_provider(self) -> PodmanProvider:
        """Rootless Podman as the settings describe it, with its own API service unless
        sandbox.podman_socket names one."""
        settings = self.settings
        socket_url = settings.sandbox.podman_socket
        if socket_url is None:
            self._podman = PodmanService(user=settings.sandbox.sandbox_user, name=settings.server.instance_id)
            await self._podman.start()
        podman = self._podman
        box = settings.sandbox
        return PodmanProvider(
            url_factory=lambda: socket_url or (podman.url if podman else ""),
            options=PodmanOptions(
                instance_id=settings.server.instance_id,
                state_dir=Path(box.state_dir),
                sandbox_user=box.sandbox_user,
                container_user=box.container_user,
                workdir=box.workdir,
                tmp_mib=box.tmp_mib,
                max_output_bytes=box.max_output_bytes,
                threads=box.podman_threads,
                runtime_start_timeout_s=box.runtime_start_timeout_s,
                cgroup_limits=box.cgroup_limits,
                max_sandboxes=box.max_sandboxes,
                allow_exec_fallback=box.allow_exec_fallback,
                reusable=box.reuse.enabled,
                writable_paths=tuple(box.reuse.writable_paths),
                reset_timeout_s=box.reuse.reset_timeout_s,
            ),
        )

    def stats(self) -> ServerStats:
        """The server's load now: what GetStats and the metrics' gauges report."""
        manager, sandboxes, router = self.manager, self._sandboxes, self._router
        return ServerStats(
            phases=[PhaseLoad(phase, gate.queued, gate.active, gate.limit) for phase, gate in self._gates.items()],
            jobs_by_status=manager.count_by_status() if manager is not None else {},
            sandboxes_busy=sandboxes.busy if sandboxes is not None else 0,
            pools=sandboxes.stats() if sandboxes is not None else [],
            backends=router.entries(),
            policy_version=router.policy_version,
            paused=router.paused,
        )

    def _warm_pool_specs(self) -> list[tuple[SandboxSpec, int]]:
        box = self.settings.sandbox
        specs = []
        for pool in box.warm_pools:
            spec = SandboxSpec(
                image=pool.image or box.default_image,
                cpus=pool.cpus if pool.cpus is not None else box.cpus,
                memory_mib=pool.memory_mib if pool.memory_mib is not None else box.memory_mib,
                pids_limit=pool.pids_limit if pool.pids_limit is not None else box.pids_limit,
                labels={LABEL_POOL: "warm"},
            )
            specs.append((spec, pool.size))
        return specs

    async def _start_backends(self) -> None:
        llm = self.settings.llm
        for configured in llm.backends:
            self._router.add(build_backend(configured, timeout_s=llm.request_timeout_s, max_retries=llm.max_retries))
        embedded = llm.embedded
        if embedded.enabled == "always" or (embedded.enabled == "auto" and not (llm.backends or self._extra_backends)):
            self._router.add(await self._embedded_backend("embedded"), managed=True)
        for extra in self._extra_backends:
            self._router.add(extra)
        if not self._router.entries():
            log.warning(
                "no_llm_backends",
                hint="jobs fail with llm_unavailable until AddBackend; llm.embedded.enabled is 'never' and "
                "llm.backends is empty",
            )
        self._router.start()

    async def _start_judge_backends(self) -> None:
        """The judge pool: a router of its own (unless judge.use_policy_backends)."""
        judge = self.settings.judge
        if judge.use_policy_backends:
            return
        for configured in judge.backends:
            self._judge_router.add(
                build_backend(configured, timeout_s=judge.request_timeout_s, max_retries=judge.max_retries)
            )
        if judge.embedded:
            self._judge_router.add(await self._embedded_backend("judge-embedded"), managed=True)
        for extra in self._extra_judge_backends:
            self._judge_router.add(extra)
        self._judge_router.start()

    async def _embedded_backend(self, backend_id: str) -> LlamaCppBackend:
        """A started llama.cpp backend on the embedded model's settings (llm.embedded)."""
        embedded = self.settings.llm.embedded
        info = BackendInfo(
            id=backend_id,
            kind="embedded",
            base_url="in-process",
            model=EMBEDDED_MODEL_NAME,
            # One llama.cpp context: requests queue in the router, where they can be cancelled.
            max_in_flight=1,
            managed=True,
        )
        backend = LlamaCppBackend(
            info,
            model_path=Path(embedded.model_path) if embedded.model_path else None,
            context_length=embedded.context_length,
            threads=embedded.threads,
        )
        await backend.start()
        return backend

    async def _set_serving(self, serving: bool) -> None:
        """Health of every service: NOT_SERVING while the cluster's store cannot be reached."""
        if self._health is None or self._stopped:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, status)

    async def _start_grpc(self, services: Services) -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
        tokens = self.settings.server.accepted_tokens()
        if tokens:
            interceptors.insert(0, BearerTokenInterceptor(tokens))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        v1.add_RolloutServiceServicer_to_server(RolloutServicer(services.jobs, self._feed), server)
        v1.add_AdminServiceServicer_to_server(
            AdminServicer(
                self._router,
                services.administration,
                self.stats,
                server_id=self.settings.server.instance_id,
                cluster_view=services.cluster_view,
                judge_router=self._judge_router if self._judge_router is not self._router else None,
            ),
            server,
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = SERVICE_NAMES
        reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{self.settings.server.host}:{self.settings.server.port}"
        credentials = self._tls_credentials()
        if credentials is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"cannot bind {self.settings.server.host}:{self.settings.server.port}")
        await server.start()
        self._server = server
        for name in ("", *names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def _tls_credentials(self) -> grpc.ServerCredentials | None:
        conf = self.settings.server
        if not conf.tls_cert_file or not conf.tls_key_file:
            return None
        try:
            key = Path(conf.tls_key_file).read_bytes()
            chain = Path(conf.tls_cert_file).read_bytes()
            client_ca = Path(conf.tls_client_ca_file).read_bytes() if conf.tls_client_ca_file else None
        except OSError as exc:
            raise ConfigError(f"TLS files of setting 'server': {exc}") from None
        return grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = self.settings.server.shutdown_grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await self._mode.shutdown(grace)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.metrics.close()
        if self._gateway_server is not None:
            await self._gateway_server.close()
        await self._feed.close()
        await self._mode.close()
        if self._sandboxes is not None:
            await self._sandboxes.close()
        if self._forks is not None:  # the state for forks dies with the server's memory: its files too
            await self._forks.close()
        if self._holds_checkers:
            await checker_pool.release_shared_pool()
        if self._provider is not None:
            await self._provider.close()
        await self._router.close()
        if self._judge_router is not self._router:
            await self._judge_router.close()
        if self._podman is not None:
            await self._podman.stop()
        log.info("server_stopped")


def _host_of(address: str | None) -> str:
    """The host part of "host:port" ("[::1]:50051" gives "[::1]"); "" for None."""
    return address.rpartition(":")[0] if address and ":" in address else (address or "")
