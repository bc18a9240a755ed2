"""Bearer tokens and TLS: the wrong or missing token is UNAUTHENTICATED, health stays open."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorl_client import Client, RpcError, v1
from prorl_server.llm.scripted import ScriptedReply, tool_call_text
from tests.helpers import math_request

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
