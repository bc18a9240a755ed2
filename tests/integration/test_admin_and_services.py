"""AdminService, health, reflection, and cleanup of this server's containers only."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from podman import PodmanClient

from prorl_client import RpcError, v1
from prorl_server.app import ProrlServer
from prorl_server.sandbox.podman import LABEL_MANAGED, LABEL_SERVER
from tests.conftest import make_settings
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text
from tests.helpers import assert_eventually, math_request

pytestmark = pytest.mark.podman


def finish_at_once(messages: list[dict[str, Any]]) -> ScriptedReply:
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


async def test_health_serving_and_reflection_lists_services(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    server, _ = await start_server(llm.base_url)
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "prorl.v1.RolloutService", "prorl.v1.AdminService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"prorl.v1.RolloutService", "prorl.v1.AdminService"} <= names


async def test_health_watch_streams_the_serving_status(scripted_llm, start_server) -> None:
    """grpc.health.v1.Health/Watch works (it failed with INTERNAL: the error
    interceptor took its coroutine handler for an async generator)."""
    llm = await scripted_llm(finish_at_once)
    server, _ = await start_server(llm.base_url)
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service, expected in (
            ("prorl.v1.RolloutService", health_pb2.HealthCheckResponse.SERVING),
            ("no.such.Service", health_pb2.HealthCheckResponse.SERVICE_UNKNOWN),
        ):
            call = health.Watch(health_pb2.HealthCheckRequest(service=service))
            async with asyncio.timeout(10):
                first = await call.read()
            call.cancel()
            assert first.status == expected


async def test_backends_can_be_added_listed_and_removed(scripted_llm, start_server) -> None:
    first = await scripted_llm(finish_at_once)
    second = await scripted_llm(finish_at_once)
    _, client = await start_server(first.base_url)

    added = await client.add_backend(
        v1.Backend(id="second", kind=v1.BACKEND_KIND_OPENAI_CHAT, base_url=second.base_url, api_key="s3cret")
    )
    assert added.id == "second" and added.api_key == ""  # write-only
    assert sorted(b.id for b in await client.list_backends()) == ["scripted", "second"]

    with pytest.raises(RpcError) as error:
        await client.add_backend(v1.Backend(id="second", kind=v1.BACKEND_KIND_OPENAI_CHAT, base_url=second.base_url))
    assert error.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(RpcError) as error:
        await client.add_backend(v1.Backend(id="third", base_url=second.base_url))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "kind" in error.value.details
    with pytest.raises(RpcError) as error:
        await client.add_backend(v1.Backend(id="third", kind=v1.BACKEND_KIND_OPENAI_CHAT, base_url="ftp://x"))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "base_url" in error.value.details

    await client.remove_backend("scripted")
    events = [e async for e in client.rollout(math_request("What is 6 * 7?", "42"))]
    assert events[-1].finished.result.reward == 1.0
    assert len(second.requests) == 1 and len(first.requests) == 0
    turn = next(e.model_turn for e in events if e.HasField("model_turn"))
    assert turn.backend_id == "second"
    with pytest.raises(RpcError) as error:
        await client.remove_backend("scripted")
    assert error.value.code == grpc.StatusCode.NOT_FOUND


async def test_stats_report_phases_jobs_and_backends(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url, phases={"init": 3, "run": 5, "eval": 2})
    for i in range(3):
        _ = [e async for e in client.rollout(math_request("What is 6 * 7?", "42", job_id=f"s-{i}"))]

    stats = await client.get_stats()

    limits = {p.phase: p.limit for p in stats.phases}
    assert limits == {v1.PHASE_INIT: 3, v1.PHASE_RUN: 5, v1.PHASE_EVAL: 2}
    assert all(p.active == 0 and p.queued == 0 for p in stats.phases)
    assert {c.status: c.count for c in stats.jobs} == {v1.JOB_STATUS_SUCCEEDED: 3}
    assert stats.sandboxes_busy == 0
    (backend,) = stats.backends
    assert backend.id == "scripted" and backend.state.requests_total == 3 and backend.state.in_flight == 0


async def test_start_and_stop_remove_only_this_servers_containers(scripted_llm, podman_url) -> None:
    llm = await scripted_llm(finish_at_once)
    settings = make_settings(podman_url, llm.base_url)
    ours = settings.server.instance_id
    with PodmanClient(base_url=podman_url) as podman:
        leftover = podman.containers.create(
            "localhost/prorl-python:latest", command=["true"], labels={LABEL_MANAGED: "1", LABEL_SERVER: ours}
        )
        foreign = podman.containers.create(
            "localhost/prorl-python:latest", command=["true"], labels={LABEL_MANAGED: "1", LABEL_SERVER: "someone-else"}
        )
    server = ProrlServer(settings)
    try:
        await server.start()
        with PodmanClient(base_url=podman_url) as podman:
            remaining = {c.id for c in podman.containers.list(all=True)}
        assert leftover.id not in remaining
        assert foreign.id in remaining
    finally:
        await server.stop()
        with PodmanClient(base_url=podman_url) as podman:
            assert foreign.id in {c.id for c in podman.containers.list(all=True)}
            podman.containers.remove(foreign.id, force=True)


async def test_pause_and_resume_stamp_turns_with_the_policy_version(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url)
    before = [e async for e in client.rollout(math_request("What is 6 * 7?", "42", job_id="v0"))]
    assert before[-1].finished.result.trajectory.turn_policy_versions == [0]

    paused = await client.pause()
    assert paused.policy_version == 0 and (await client.get_stats()).paused
    await client.submit(math_request("What is 6 * 7?", "42", job_id="v1"))

    async def waiting_for_resume() -> bool:
        job = await client.get_job("v1")
        return job.phase == v1.PHASE_RUN

    await assert_eventually(waiting_for_resume)
    assert len(llm.requests) == 1  # nothing was generated while paused
    assert await client.resume() == 1
    after = [e async for e in client.watch("v1")]
    turn = next(e.model_turn for e in after if e.HasField("model_turn"))
    assert turn.policy_version == 1
    assert after[-1].finished.result.trajectory.turn_policy_versions == [1]
    stats = await client.get_stats()
    assert stats.policy_version == 1 and not stats.paused
    with pytest.raises(RpcError) as error:
        await client.resume(policy_version=0)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_vllm_backend_added_at_run_time_gives_token_trajectories(scripted_llm, start_server, tmp_path) -> None:
    from tests.fakes.token_servers import FakeVLLM, write_tiny_tokenizer

    folder = write_tiny_tokenizer(tmp_path / "tok")
    replies = iter([tool_call_text("python", {"code": "print(6 * 7)"}), tool_call_text("finish", {"answer": "42"})])
    fake = FakeVLLM(folder, lambda prompt: next(replies))
    await fake.start()
    try:
        chat = await scripted_llm(finish_at_once)
        _, client = await start_server(chat.base_url)
        await client.remove_backend("scripted")
        added = await client.add_backend(
            v1.Backend(id="vllm-0", kind=v1.BACKEND_KIND_VLLM, base_url=fake.base_url, tokenizer_path=str(folder))
        )
        assert added.kind == v1.BACKEND_KIND_VLLM and added.tokenizer_path == str(folder)

        events = [e async for e in client.rollout(math_request("What is 6 * 7?", "42"))]

        result = events[-1].finished.result
        assert result.reward == 1.0
        trajectory = result.trajectory
        last_prompt = fake.requests[-1]["prompt"]
        last_turn = [e.model_turn for e in events if e.HasField("model_turn")][-1]
        assert list(trajectory.token_ids) == last_prompt + list(last_turn.token_ids)
        assert sum(trajectory.loss_mask) == sum(len(e.model_turn.token_ids) for e in events if e.HasField("model_turn"))
        assert len(trajectory.logprobs) == len(trajectory.token_ids)
    finally:
        await fake.stop()
