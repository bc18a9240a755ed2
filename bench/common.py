"""Helpers shared by the benchmarks: percentiles, a private Podman service and provider."""

from __future__ import annotations

import statistics
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from prorl_server.sandbox.base import SandboxSpec
from prorl_server.sandbox.podman import PodmanOptions, PodmanProvider
from prorl_server.sandbox.podman.service import PodmanService


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]


def summary_ms(samples: list[float]) -> str:
    return (
        f"p50 {percentile(samples, 50) * 1e3:8.3f} ms   p99 {percentile(samples, 99) * 1e3:8.3f} ms"
        f"   mean {statistics.fmean(samples) * 1e3:8.3f} ms   (n={len(samples)})"
    )


def default_spec(**overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "image": "localhost/prorl-python:latest",
        "cpus": 1.0,
        "memory_mib": 256,
        "pids_limit": 64,
        **overrides,
    }
    return SandboxSpec(**values)  # type: ignore[arg-type]


@asynccontextmanager
async def podman_provider(threads: int = 16) -> AsyncIterator[PodmanProvider]:
    instance = f"bench-{uuid.uuid4().hex[:8]}"
    service = PodmanService(user="prorl", name=instance)
    await service.start()
    provider = PodmanProvider(
        url_factory=lambda: service.url,
        options=PodmanOptions(
            instance_id=instance,
            state_dir=Path("/var/lib/prorl"),
            sandbox_user="prorl",
            container_user="1000:1000",
            workdir="/workspace",
            tmp_mib=64,
            max_output_bytes=64 * 1024,
            threads=threads,
            runtime_start_timeout_s=120,
            cgroup_limits=True,
        ),
    )
    await provider.start()
    try:
        yield provider
    finally:
        await provider.close()
        await service.stop()
