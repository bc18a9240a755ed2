"""Fixtures: a real Podman API socket, a scripted fake LLM, real servers on real ports.

All tests share one event loop (pytest.ini sets session loop scope), so the
session's Podman service and its stderr drain keep running between tests.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from podman import PodmanClient

from prorl_client import Client
from prorl_server.app import ProrlServer
from prorl_server.config import Settings, VerifierSettings, load_settings
from prorl_server.errors import ConsumerTooSlow
from prorl_server.sandbox.base import LABEL_JOB, LABEL_MANAGED, LABEL_SERVER, SandboxSpec
from prorl_server.sandbox.podman import PodmanOptions, PodmanProvider
from prorl_server.sandbox.podman.service import PodmanService
from prorl_server.verifiers import checker_pool
from tests.fakes.sandbox_provider import FakeSandboxProvider
from tests.fakes.scripted_llm import Script, ScriptedLLMServer
from tests.vllm import VLLMServer
from tests.vllm import missing as vllm_missing

SANDBOX_USER = os.environ.get("PRORL_TEST_SANDBOX_USER", "prorl")
# Where providers stage the runtime: two checkouts testing at once on one host each
# set their own, so neither runs the other's in-sandbox code.
TEST_STATE_DIR = Path(os.environ.get("PRORL_TEST_STATE_DIR", "/var/lib/prorl"))
# Every server and provider of this test session has an instance id with this
# prefix, so the leftover checks look at this session's containers only.
SESSION = f"t{uuid.uuid4().hex[:6]}"


def instance_id(kind: str) -> str:
    return f"{SESSION}-{kind}-{uuid.uuid4().hex[:8]}"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def podman_url() -> AsyncIterator[str]:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run `make setup`")
    service = PodmanService(user=SANDBOX_USER, name="tests")
    await service.start()
    yield service.url
    try:
        with PodmanClient(base_url=service.url) as client:
            leftovers = [
                c
                for c in client.containers.list(all=True, filters={"label": f"{LABEL_MANAGED}=1"})
                if c.labels.get(LABEL_SERVER, "").startswith(SESSION)
            ]
            names = [c.name for c in leftovers]
            for container in leftovers:
                container.remove(force=True)
    finally:
        await service.stop()
    assert not names, f"tests left containers behind: {names}"
    groups = leftover_cgroups()
    assert not groups, f"tests left cgroups behind: {groups}"


def leftover_cgroups() -> list[str]:
    return [str(p) for c in ("memory", "pids", "cpu") for p in Path("/sys/fs/cgroup", c).rglob(f"prorl-{SESSION}*")]


def job_containers(podman_url: str, job_id: str) -> list[Any]:
    with PodmanClient(base_url=podman_url) as client:
        return list(client.containers.list(all=True, filters={"label": f"{LABEL_JOB}={job_id}"}))


def server_containers(podman_url: str, instance_id: str) -> list[Any]:
    with PodmanClient(base_url=podman_url) as client:
        return list(client.containers.list(all=True, filters={"label": f"{LABEL_SERVER}={instance_id}"}))


@pytest_asyncio.fixture(scope="session", loop_scope="session", autouse=True)
async def checker_processes() -> AsyncIterator[None]:
    """One pool of checker processes (math and STEM checks) for the whole session, so that a
    server stopping does not make the next test start them again; stopped at the end."""
    await checker_pool.hold_shared_pool(VerifierSettings())
    yield
    await checker_pool.release_shared_pool()


@pytest_asyncio.fixture
async def scripted_llm() -> AsyncIterator[Callable[[Script], Awaitable[ScriptedLLMServer]]]:
    servers: list[ScriptedLLMServer] = []

    async def start(script: Script) -> ScriptedLLMServer:
        server = ScriptedLLMServer(script)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMServer]:
    """One real vLLM server (CPU build, SmolLM2-135M) for the whole run, stopped after it
    (tests/vllm.py); tests that change its weights put the original ones back."""
    why = vllm_missing()
    if why:
        pytest.fail(why)
    server = VLLMServer()
    if attach := os.environ.get("PRORL_TEST_VLLM_PORT"):  # one started by hand, while developing
        server.port = int(attach)
        yield server
        return
    await server.start(tmp_path_factory.mktemp("vllm") / "vllm.log")
    yield server
    await server.stop()


def make_settings(podman_url: str, llm_url: str | None, **sections: dict[str, Any]) -> Settings:
    overrides: dict[str, Any] = {
        "server": {
            "port": 0,
            "instance_id": instance_id("server"),
            "shutdown_grace_s": 0,
            "log_level": "warning",
        },
        "sandbox": {"podman_socket": podman_url, "tmp_mib": 64, "state_dir": str(TEST_STATE_DIR)},
        "jobs": {"store": False},
        "llm": {
            "backends": [{"id": "scripted", "base_url": llm_url}] if llm_url else [],
            "embedded": {"enabled": "never" if llm_url else "always"},
            "max_retries": 1,
        },
    }
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return load_settings(None, environ={}, overrides=overrides)


ServerFactory = Callable[..., Awaitable[tuple[ProrlServer, Client]]]


@pytest_asyncio.fixture
async def start_server(podman_url: str) -> AsyncIterator[ServerFactory]:
    """Start a real ProrlServer on a free port and a client connected to it."""
    started: list[tuple[ProrlServer, Client]] = []

    async def start(llm_url: str | None, **sections: dict[str, Any]) -> tuple[ProrlServer, Client]:
        server = ProrlServer(make_settings(podman_url, llm_url, **sections))
        await server.start()
        client = Client.connect(server.address)
        started.append((server, client))
        return server, client

    yield start
    for server, client in started:
        await client.close()
        await server.stop()
        assert not server_containers(podman_url, server.settings.server.instance_id)


def podman_options(instance_id: str, **overrides: Any) -> PodmanOptions:
    values: dict[str, Any] = {
        "instance_id": instance_id,
        "state_dir": TEST_STATE_DIR,
        "sandbox_user": SANDBOX_USER,
        "container_user": "1000:1000",
        "workdir": "/workspace",
        "tmp_mib": 64,
        "max_output_bytes": 16 * 1024,
        "threads": 8,
        "runtime_start_timeout_s": 30.0,
        "cgroup_limits": True,
        **overrides,
    }
    return PodmanOptions(**values)


def small_spec(image: str = "localhost/prorl-python:latest", **overrides: Any) -> SandboxSpec:
    values: dict[str, Any] = {"image": image, "cpus": 1.0, "memory_mib": 256, "pids_limit": 64, **overrides}
    return SandboxSpec(**values)


@pytest_asyncio.fixture
async def provider(podman_url: str) -> AsyncIterator[PodmanProvider]:
    """A real Podman provider of its own (unique instance id), closed after the test."""
    instance = instance_id("sandbox")
    provider = PodmanProvider(url_factory=lambda: podman_url, options=podman_options(instance))
    await provider.start()
    yield provider
    await provider.close()
    assert not server_containers(podman_url, instance)


@pytest_asyncio.fixture
async def reusable_provider(podman_url: str) -> AsyncIterator[PodmanProvider]:
    """Like `provider`, starting sandboxes that can be reset (sandbox.reuse.enabled)."""
    instance = instance_id("reuse")
    provider = PodmanProvider(url_factory=lambda: podman_url, options=podman_options(instance, reusable=True))
    await provider.start()
    yield provider
    await provider.close()
    assert not server_containers(podman_url, instance)


@pytest_asyncio.fixture
async def exec_provider(podman_url: str) -> AsyncIterator[PodmanProvider]:
    """Like `provider`, with the `podman exec` fallback for images without python3 allowed."""
    instance = instance_id("exec")
    provider = PodmanProvider(
        url_factory=lambda: podman_url, options=podman_options(instance, allow_exec_fallback=True)
    )
    await provider.start()
    yield provider
    await provider.close()
    assert not server_containers(podman_url, instance)


@pytest_asyncio.fixture
async def fake_provider() -> AsyncIterator[FakeSandboxProvider]:
    """A provider without Podman: the real runtime in local processes (tests/fakes/sandbox_provider.py)."""
    provider = FakeSandboxProvider(instance_id=instance_id("fake"))
    await provider.start()
    yield provider
    await provider.close()
    assert provider.busy == 0


@pytest.fixture
def too_slow_endings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The messages of the Subscribe streams this process's servers end as too slow."""
    endings: list[str] = []
    original = ConsumerTooSlow.__init__

    def counted(self: ConsumerTooSlow, message: str, **kwargs: Any) -> None:
        endings.append(message)
        original(self, message, **kwargs)

    monkeypatch.setattr(ConsumerTooSlow, "__init__", counted)
    return endings
