"""Prometheus metrics, served over HTTP (aiohttp) on `server.metrics_port`.

Counters and histograms are fed by the job pipeline; live values (queue
depth, sandboxes, backend load) are read at scrape time. Each server has its
own registry, so several servers in one process never mix their figures.

Exposure: the endpoint tells whoever reaches it the job counts by handler and
status, the phases' queues, the sandboxes per image and the backends' ids,
load and health (no job ids, keys or content). By default it asks for no
token, even when the gRPC port does (server.auth_tokens): a Prometheus
scraper on a private network is the usual reader. With
server.metrics_require_token it asks for one of the same tokens
(`authorization: Bearer <token>`) and answers 401 without one.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from prorl_client import v1
from prorl_server.stats import ServerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs_submitted = Counter("prorl_jobs_submitted", "Jobs accepted", ["handler"], registry=r)
        self.jobs_finished = Counter("prorl_jobs_finished", "Jobs finished", ["handler", "status"], registry=r)
        self.phase_seconds = Histogram(
            "prorl_phase_seconds", "Time inside a phase", ["phase"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            "prorl_queue_wait_seconds", "Wait for a phase slot", ["phase"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.llm_requests = Counter("prorl_llm_requests", "Model turns", ["backend"], registry=r)
        self.llm_seconds = Histogram(
            "prorl_llm_request_seconds", "Model turn latency", ["backend"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.llm_tokens = Counter("prorl_llm_tokens", "Tokens", ["backend", "kind"], registry=r)
        self.tool_seconds = Histogram(
            "prorl_tool_call_seconds", "Tool call latency", ["tool"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.judgements = Counter("prorl_judgements", "Model judgements", ["verdict"], registry=r)
        self.judge_seconds = Histogram(
            "prorl_judge_seconds", "Latency of one model judgement", buckets=LATENCY_BUCKETS, registry=r
        )
        self.judge_tokens = Counter("prorl_judge_tokens", "Tokens of the judge pool", ["kind"], registry=r)
        self._runner: web.AppRunner | None = None
        self.port = 0

    def watch(self, read: Callable[[], ServerStats]) -> None:
        """Register live gauges, computed from `read()` at each scrape."""

        class Live(Collector):
            def collect(self) -> Iterator[GaugeMetricFamily]:
                return live_gauges(read())

        self.registry.register(Live())

    # --- what the pipeline reports ---------------------------------------------------

    def model_turn(self, backend: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.llm_requests.labels(backend).inc()
        self.llm_seconds.labels(backend).observe(seconds)
        self.llm_tokens.labels(backend, "prompt").inc(prompt_tokens)
        self.llm_tokens.labels(backend, "completion").inc(completion_tokens)

    def judgement(self, verdict: str, seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        """One model judgement (verifiers/judge.py); the judge's latency only when it was asked."""
        self.judgements.labels(verdict).inc()
        if prompt_tokens or completion_tokens or seconds:
            self.judge_seconds.observe(seconds)
        self.judge_tokens.labels("prompt").inc(prompt_tokens)
        self.judge_tokens.labels("completion").inc(completion_tokens)

    def tool_call(self, tool: str, seconds: float) -> None:
        self.tool_seconds.labels(tool or "unknown").observe(seconds)

    # --- the endpoint ----------------------------------------------------------

    async def serve(self, host: str, port: int, *, tokens: Sequence[str] = ()) -> None:
        """Serve /metrics; with `tokens`, only to a request bearing one of them."""
        accepted = [token.encode() for token in tokens]

        def allowed(request: web.Request) -> bool:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                return False
            token = given.strip().encode()
            return any(hmac.compare_digest(token, known) for known in accepted)

        async def scrape(request: web.Request) -> web.Response:
            if accepted and not allowed(request):
                return web.Response(
                    status=401,
                    text="metrics need a bearer token (server.metrics_require_token): authorization: Bearer <token>\n",
                    headers={"www-authenticate": "Bearer"},
                )
            return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", scrape)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def gauge(
    name: str, documentation: str, labels: list[str], samples: list[tuple[list[str], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


def live_gauges(stats: ServerStats) -> Iterator[GaugeMetricFamily]:
    """The gauges of one reading of the server's load (GetStats reports the same reading)."""
    phases = [(v1.Phase.Name(load.phase).removeprefix("PHASE_").lower(), load) for load in stats.phases]
    yield gauge("prorl_phase_queued", "Jobs waiting for a phase slot", ["phase"], [([n], p.queued) for n, p in phases])
    yield gauge("prorl_phase_active", "Jobs in a phase", ["phase"], [([n], p.active) for n, p in phases])
    pools = stats.pools
    yield gauge("prorl_sandboxes_warm", "Warm sandboxes", ["image"], [([p.image], p.warm) for p in pools])
    yield gauge("prorl_sandboxes_busy", "Sandboxes held by jobs", ["image"], [([p.image], p.busy) for p in pools])
    entries = stats.backends
    yield gauge(
        "prorl_backend_in_flight", "LLM requests in flight", ["backend"], [([e.id], e.in_flight) for e in entries]
    )
    yield gauge("prorl_backend_healthy", "1 when healthy", ["backend"], [([e.id], float(e.healthy)) for e in entries])
    samples: list[tuple[list[str], float]] = [
        ([v1.JobStatus.Name(s).removeprefix("JOB_STATUS_").lower()], c) for s, c in stats.jobs_by_status.items()
    ]
    yield gauge("prorl_jobs", "Jobs known to the server, by status", ["status"], samples)
