"""`prorl-server serve` as a process: serves, and on SIGTERM drains, cleans up and exits 0."""

from __future__ import annotations

import signal
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prorl_client import Client, v1
from prorl_server.llm.scripted import ScriptedReply, tool_call_text
from tests.conftest import instance_id, server_containers
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
