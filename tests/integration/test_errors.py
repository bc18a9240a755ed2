"""Bad requests get the right status code and a message saying what to fix;
the server keeps serving."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from prorl_client import RpcError, v1
from prorl_server.llm.scripted import ScriptedReply, tool_call_text
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


BAD_SUBMISSIONS = [
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
