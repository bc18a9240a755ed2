"""Security: bearer tokens and TLS (the wrong or missing token is UNAUTHENTICATED,
health stays open), no secret in the logs, no host path inside a sandbox."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from podman import PodmanClient

from prorl_client import Client, RpcError, v1
from prorl_server.errors import ProrlError
from prorl_server.sandbox.podman import LABEL_JOB, RUNTIME_MOUNT, SOCKET_MOUNT, PodmanProvider
from prorl_server.sandbox.podman.container_spec import IMAGE_MOUNT, writable_paths
from tests.conftest import instance_id, job_containers, podman_options, small_spec
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text
from tests.helpers import ServeProcess, math_request

pytestmark = pytest.mark.podman


def finish_at_once(messages: list[dict[str, Any]]) -> ScriptedReply:
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


async def test_bearer_tokens_guard_every_rpc_but_health(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    server, anonymous = await start_server(llm.base_url, server={"auth_tokens": ["s3cret-one", "s3cret-two"]})

    for call in (anonymous.get_stats(), anonymous.list_jobs(), anonymous.submit(math_request("q", "42"))):
        with pytest.raises(RpcError) as error:
            await call
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in error.value.details
    with pytest.raises(RpcError) as error:
        _ = [e async for e in anonymous.rollout(math_request("q", "42"))]
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED

    async with Client.connect(server.address, token="wrong") as wrong:
        with pytest.raises(RpcError) as error:
            await wrong.get_stats()
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED

    async with Client.connect(server.address, token="s3cret-two") as allowed:
        events = [e async for e in allowed.rollout(math_request("What is 6 * 7?", "42"))]
        assert events[-1].finished.result.reward == 1.0

    async with grpc.aio.insecure_channel(server.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def self_signed(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "server.key", folder / "server.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


async def test_tls_serves_only_tls_clients(scripted_llm, start_server, tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path)
    llm = await scripted_llm(finish_at_once)
    server, plaintext = await start_server(
        llm.base_url, server={"tls_cert_file": str(cert), "tls_key_file": str(key), "host": "127.0.0.1"}
    )
    with pytest.raises(RpcError) as error:
        await plaintext.get_stats()
    assert error.value.code == grpc.StatusCode.UNAVAILABLE

    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    async with Client.connect(f"localhost:{server.port}", credentials=credentials) as secure:
        stats = await secure.get_stats()
        assert [b.id for b in stats.backends] == ["scripted"]
        events = [e async for e in secure.rollout(math_request("What is 6 * 7?", "42"))]
        assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED


async def test_secrets_never_reach_the_logs(scripted_llm, podman_url) -> None:
    """Bearer tokens (right and wrong ones) and a backend's API key, at debug level."""
    llm = await scripted_llm(finish_at_once)
    token, wrong, api_key = "tok-right-8f3a1c", "tok-wrong-77d2e9", "sk-backend-5b9e40"
    async with ServeProcess(
        f"server.instance_id={instance_id('secrets')}",
        f"sandbox.podman_socket={podman_url}",
        f'llm.backends=[{{"id": "scripted", "base_url": "{llm.base_url}", "api_key": "{api_key}"}}]',
        f'server.auth_tokens=["{token}"]',
        "server.log_level=debug",
        "jobs.store=false",
    ) as served:
        async with Client.connect(served.address, token=token) as client:
            events = [e async for e in client.rollout(math_request("What is 6 * 7?", "42"))]
            assert events[-1].finished.result.reward == 1.0
        async with Client.connect(served.address, token=wrong) as client:
            with pytest.raises(RpcError) as error:
                await client.get_stats()
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert wrong not in error.value.details
        assert served.process is not None
        served.process.send_signal(signal.SIGTERM)
        assert await served.wait() == 0
    assert llm.authorizations == [f"Bearer {api_key}"]  # the key was really used...
    log = "".join(served.log)
    assert "job_finished" in log or "server_stopped" in log, log[-2000:]  # ...the log is really there...
    for secret in (token, wrong, api_key):
        assert secret not in log  # ...and no secret is in it


async def _mounts(provider: PodmanProvider, podman_url: str) -> list[dict[str, Any]]:
    """The Podman-inspected mounts of a new sandbox of `provider`'s (removed again)."""
    job = uuid.uuid4().hex[:8]
    sandbox = await provider.create(small_spec(labels={LABEL_JOB: job}))
    try:
        (container,) = job_containers(podman_url, job)
        with PodmanClient(base_url=podman_url) as podman:
            mounts: list[dict[str, Any]] = podman.containers.get(container.id).inspect()["Mounts"]
        return mounts
    finally:
        await sandbox.close()


def _assert_host_binds(mounts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    binds = {m["Destination"]: m for m in mounts if m["Type"] == "bind" and m["Destination"] != IMAGE_MOUNT}
    assert set(binds) == {RUNTIME_MOUNT, SOCKET_MOUNT}
    assert not binds[RUNTIME_MOUNT]["RW"]
    state_dir = str(podman_options("x").state_dir)
    assert all(m["Source"].startswith(state_dir) for m in binds.values())
    return binds


async def test_sandboxes_mount_nothing_of_the_host_but_the_runtime(provider: PodmanProvider, podman_url) -> None:
    mounts = await _mounts(provider, podman_url)
    _assert_host_binds(mounts)
    assert {m["Destination"] for m in mounts} <= {RUNTIME_MOUNT, SOCKET_MOUNT, "/tmp"}


async def test_reusable_sandboxes_mount_nothing_of_the_host_but_the_runtime(
    reusable_provider: PodmanProvider, podman_url
) -> None:
    mounts = await _mounts(reusable_provider, podman_url)
    binds = _assert_host_binds(mounts)
    # The sandbox's own image, read-only (what a reset restores the writable paths from).
    # (Podman lists it twice: as the image, and as the overlay of it that it mounts.)
    image = [m for m in mounts if m["Destination"] == IMAGE_MOUNT]
    assert {m["Type"] for m in image} == {"image", "bind"} and not image[0]["RW"], image
    # Besides: the writable paths, each a tmpfs filled from the image.
    others = {m["Destination"]: m for m in mounts if m["Destination"] not in {*binds, IMAGE_MOUNT}}
    assert set(others) <= set(writable_paths(podman_options("x", reusable=True))), others
    assert all(m["Type"] == "tmpfs" for m in others.values()), others


async def test_file_tools_cannot_reach_host_paths(provider: PodmanProvider, tmp_path: Path) -> None:
    host_secret = Path("/var/tmp") / f"prorl-host-secret-{uuid.uuid4().hex}"
    host_secret.write_text("host only")
    escape_target = Path("/var/tmp") / f"prorl-escape-{uuid.uuid4().hex}"
    sandbox = await provider.create(small_spec())
    try:
        with pytest.raises(ProrlError):
            await sandbox.read_file(str(host_secret))
        with pytest.raises(ProrlError):
            await sandbox.read_file(f"../../../../..{host_secret}")
        viewed = await sandbox.edit("view", f"/workspace/../../..{host_secret}")
        assert viewed.is_error and "does not exist" in viewed.output
        created = await sandbox.edit("create", f"../../../../..{escape_target}", file_text="escaped?")
        assert not escape_target.exists()
        if not created.is_error:  # it landed inside the container's own file system
            assert (await sandbox.read_file(str(escape_target))) == b"escaped?"
    finally:
        await sandbox.close()
        host_secret.unlink()
