"""`prorl-server serve` as a process: says where it listens, serves, and on SIGTERM drains,
cleans up and exits 0."""

from __future__ import annotations

import asyncio
import signal
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorl_client import Client, v1
from tests.conftest import instance_id, server_containers
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text
from tests.helpers import ServeProcess, math_request

pytestmark = pytest.mark.podman


def slow_finish(messages: list[dict[str, Any]]) -> ScriptedReply:
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}), delay_s=0.5)


async def test_serve_then_sigterm_exits_cleanly(scripted_llm, podman_url) -> None:
    llm = await scripted_llm(slow_finish)
    instance = instance_id("serve")
    async with ServeProcess(
        f"server.instance_id={instance}",
        f"sandbox.podman_socket={podman_url}",
        f'llm.backends=[{{"id": "scripted", "base_url": "{llm.base_url}"}}]',
        "server.shutdown_grace_s=20",
        "jobs.store=false",
    ) as served:
        async with Client.connect(served.address) as client:
            await client.submit(math_request("What is 6 * 7?", "42", job_id="drain-1"))
            async with grpc.aio.insecure_channel(served.address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            watch = client.watch("drain-1")
            first = await anext(watch)
            assert first.HasField("queued")

            assert served.process is not None
            served.process.send_signal(signal.SIGTERM)

            rest = [event async for event in watch]
        # The running job was allowed to finish within the grace period.
        assert rest[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED
        assert await served.wait() == 0
        assert not server_containers(podman_url, instance)


async def test_port_zero_prints_the_ports_it_bound(podman_url) -> None:
    # ServeProcess runs `serve --port 0`; the metrics port is left to the kernel as well.
    async with ServeProcess(
        f"server.instance_id={instance_id('port0')}",
        f"sandbox.podman_socket={podman_url}",
        "server.metrics_port=0",
        "llm.embedded.enabled=never",
        "jobs.store=false",
    ) as served:
        host, port = served.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, served.address
        async with grpc.aio.insecure_channel(served.address) as channel:  # the printed port is the one serving
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # The metrics line comes before the gRPC one, which a script waits for.
        listening = next(i for i, line in enumerate(served.log) if line.startswith("prorl-server listening on "))
        metrics = [line.split()[-1] for line in served.log[:listening] if line.startswith("prorl-server metrics on ")]
        assert len(metrics) == 1 and metrics[0].startswith("http://127.0.0.1:"), served.log
        assert int(metrics[0].rsplit(":", 1)[1].removesuffix("/metrics")) > 0
        with await asyncio.to_thread(urllib.request.urlopen, metrics[0], timeout=10) as response:
            assert "prorl_jobs" in response.read().decode()
