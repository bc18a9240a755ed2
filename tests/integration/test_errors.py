"""Bad requests get the right status code and a message saying what to fix;
the server keeps serving."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from prorl_client import RpcError, v1
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text
from tests.helpers import math_request

pytestmark = pytest.mark.podman


def finish_at_once(messages: list[dict[str, Any]]) -> ScriptedReply:
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


def with_handler(name: str) -> v1.RolloutRequest:
    request = math_request("q")
    request.handler = name
    return request


def missing_question() -> v1.RolloutRequest:
    request = v1.RolloutRequest(handler="math")
    request.instance.update({"answer": "1"})
    return request


def zero_budget() -> v1.RolloutRequest:
    request = math_request("q")
    request.limits.budget.seconds = -1
    return request


def infinite_number() -> v1.RolloutRequest:
    request = math_request("q")
    request.instance.update({"answer": float("inf")})  # found by the fuzzer: was INTERNAL
    return request


def oversized(field: str) -> v1.RolloutRequest:
    """Fields that are stored or sent on have sizes (an attacker sent a 30 MiB group_id)."""
    request = math_request("q")
    if field == "group_id":
        request.group_id = "g" * 300
    elif field == "model":
        request.sampling.model = "m" * 300
    elif field == "stop":
        request.sampling.stop.append("s" * 300)
    elif field == "stops":
        request.sampling.stop.extend(["x"] * 17)
    elif field == "tool_timeout":
        request.limits.budget.seconds = 60
        request.limits.tool_timeout.seconds = 10**11  # was an OverflowError in the sandbox, blamed on infrastructure
    return request


BAD_SUBMISSIONS = [
    (oversized("group_id"), "group_id is 300 characters; at most 256"),
    (oversized("model"), "sampling.model is 300 characters"),
    (oversized("stop"), "sampling.stop strings must be 1-256 characters"),
    (oversized("stops"), "sampling.stop holds 17 strings"),
    (oversized("tool_timeout"), "exceeds the job's budget of 60s"),
    (with_handler("chess"), "unknown handler 'chess'"),
    (with_handler(""), "handler is empty"),
    (missing_question(), "'question'"),
    (zero_budget(), "limits.budget must be positive"),
    (math_request("q", max_turns=0), "limits.max_turns"),
    (math_request("q", job_id="spaces are bad"), "job_id"),
    (infinite_number(), "JSON cannot represent"),
]


@pytest.mark.parametrize(("request_", "expected"), BAD_SUBMISSIONS, ids=[b[1] for b in BAD_SUBMISSIONS])
async def test_bad_submissions_are_invalid_argument(scripted_llm, start_server, request_, expected) -> None:
    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url)

    for call in (client.submit(request_), _first_event(client.rollout(request_))):
        with pytest.raises(RpcError) as error:
            await call
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in error.value.details

    # The server keeps serving.
    events = [e async for e in client.rollout(math_request("What is 6 * 7?", "42"))]
    assert events[-1].finished.result.reward == 1.0


async def _first_event(stream: Any) -> Any:
    async for event in stream:
        return event
    return None


async def test_unknown_job_ids_are_not_found(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url)

    for call in (client.get_job("nope"), client.cancel("nope"), _first_event(client.watch("nope"))):
        with pytest.raises(RpcError) as error:
            await call
        assert error.value.code == grpc.StatusCode.NOT_FOUND
        assert "no job with id 'nope'" in error.value.details

    with pytest.raises(RpcError) as error:
        await _first_event(client.watch("nope", after_seq=-1))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    events = [e async for e in client.rollout(math_request("What is 6 * 7?", "42"))]
    assert events[-1].finished.result.status == v1.JOB_STATUS_SUCCEEDED


async def test_zero_budget_duration_is_refused(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url)
    request = math_request("q")
    request.limits.budget.SetInParent()  # present, but 0 seconds

    with pytest.raises(RpcError) as error:
        await client.submit(request)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "limits.budget must be positive, got 0s" in error.value.details


async def test_an_oversized_cancel_reason_is_invalid_argument(scripted_llm, start_server) -> None:
    llm = await scripted_llm(finish_at_once)
    _, client = await start_server(llm.base_url)
    await client.submit(math_request("q", job_id="reasoned"))
    with pytest.raises(RpcError) as error:
        await client.cancel("reasoned", reason="r" * 2000)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 1024" in error.value.details


async def test_rollout_stream_ends_with_a_status_when_its_request_side_is_unreadable(
    scripted_llm, start_server
) -> None:
    """Frames that are not protobuf: the stream ends with INVALID_ARGUMENT at once
    (it used to hang until the client gave up), and the server keeps serving."""
    llm = await scripted_llm(finish_at_once)
    server, client = await start_server(llm.base_url)
    good = v1.RolloutStreamRequest(rollout=math_request("What is 6 * 7?", "42", job_id="before-junk"))

    async def frames() -> Any:
        yield good.SerializeToString()
        yield b"\xff\xff\xff\xff not a protobuf message"

    async with grpc.aio.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/prorl.v1.RolloutService/RolloutStream",
            request_serializer=lambda raw: raw,
            response_deserializer=v1.RolloutStreamResponse.FromString,
        )(frames())
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async with asyncio.timeout(30):
                async for _ in call:
                    pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be read" in (error.value.details() or "")
    # The job it had submitted goes on and can be watched to its end.
    events = [e async for e in client.watch("before-junk")]
    assert events[-1].finished.result.reward == 1.0
