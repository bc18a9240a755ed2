"""Fuzzing the live server with generated requests: no crash, no hang, every refusal
a proper status code, and a job running meanwhile is unaffected."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorl_client import RpcError, v1
from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index, user_prompt
from tests.helpers import math_request

pytestmark = pytest.mark.podman

BYSTANDER_QUESTION = "What is 6 * 7?"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "80"))
"""Generated requests per run; raise it (e.g. FUZZ_EXAMPLES=2000) for a longer hunt."""
ACCEPTABLE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,  # an image outside sandbox.allowed_images
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
json_leaf = (
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=False) | st.text(max_size=200)
)
json_value = st.recursive(
    json_leaf,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5),
    max_leaves=40,
)
instances = st.dictionaries(st.text(max_size=30), json_value, max_size=6) | st.fixed_dictionaries(
    {"question": st.text(max_size=300), "answer": json_leaf}
)


@st.composite
def requests(draw: Any) -> v1.RolloutRequest:
    request = v1.RolloutRequest(
        job_id=draw(st.text(max_size=140) | st.from_regex(r"[a-z0-9-]{1,20}", fullmatch=True)),
        handler=draw(st.sampled_from(["math", "stem", "code", "swe", "", "chess"]) | st.text(max_size=30)),
        group_id=draw(st.text(max_size=50)),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
    )
    request.instance.update(draw(instances))
    for key, value in draw(st.dictionaries(st.text(max_size=300), st.text(max_size=300), max_size=70)).items():
        request.labels[key] = value
    if draw(st.booleans()):
        request.sampling.temperature = draw(st.floats())
        request.sampling.max_tokens = draw(st.integers(-(2**31), 2**31 - 1))
        request.sampling.top_p = draw(st.floats())
    if draw(st.booleans()):
        request.limits.max_turns = draw(st.integers(-(2**31), 2**31 - 1))
        request.limits.budget.seconds = draw(st.integers(-(10**9), 10**9))
        request.limits.tool_timeout.seconds = draw(st.integers(-(10**9), 10**9))
    if draw(st.booleans()):
        request.sandbox.cpus = draw(st.floats())
        request.sandbox.memory_mib = draw(st.integers(-(2**62), 2**62))
        request.sandbox.pids_limit = draw(st.integers(-(2**31), 2**31 - 1))
        request.sandbox.image = draw(st.text(max_size=100))
    return request


@st.composite
def plausible_requests(draw: Any) -> v1.RolloutRequest:
    """Mostly valid: odd but acceptable text, so the acceptance path is fuzzed too."""
    request = v1.RolloutRequest(
        job_id=draw(st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True)),
        handler="math",
        group_id=draw(st.text(max_size=50)),
    )
    request.instance.update({"question": draw(st.text(min_size=1, max_size=2000).filter(str.strip)), "answer": "1"})
    request.limits.max_turns = 1
    return request


def slow_then_finish(messages: list[dict[str, Any]]) -> ScriptedReply:
    """The bystander works for a while; fuzzed jobs that were accepted finish at once."""
    if turn_index(messages) == 0 and user_prompt(messages) == BYSTANDER_QUESTION:
        return ScriptedReply(tool_call_text("bash", {"command": "sleep 2; echo done"}))
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


@pytest.fixture
def hypothesis_home(tmp_path: Any) -> Any:
    """Hypothesis keeps files of its own; keep them in the test's temporary folder."""
    from hypothesis import configuration

    previous = configuration.storage_directory()
    configuration.set_hypothesis_home_dir(str(tmp_path / "hypothesis"))
    yield
    configuration.set_hypothesis_home_dir(str(previous))


async def test_generated_requests_never_break_the_server(scripted_llm, start_server, hypothesis_home) -> None:
    llm = await scripted_llm(slow_then_finish)
    _, client = await start_server(llm.base_url, phases={"init": 4, "run": 8, "eval": 4})
    bystander = asyncio.create_task(
        _collect(client.rollout(math_request(BYSTANDER_QUESTION, "42", job_id="bystander")))
    )
    accepted: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request=requests() | plausible_requests())
    def check(request: v1.RolloutRequest) -> None:
        outcome = asyncio.run_coroutine_threadsafe(_submit(client, request), loop).result(timeout=30)
        if outcome is not None:
            accepted.append(outcome)

    loop = asyncio.get_running_loop()
    await asyncio.to_thread(check)

    assert accepted, "no generated request was valid: the strategy is too narrow"
    events = await asyncio.wait_for(bystander, 60)
    assert events[-1].finished.result.reward == 1.0  # the job running meanwhile was unaffected
    for job_id in accepted:  # accepted jobs are real jobs: stop them
        await client.cancel(job_id)
    stats = await client.get_stats()
    assert all(p.active == 0 for p in stats.phases)


async def _submit(client: Any, request: v1.RolloutRequest) -> str | None:
    try:
        async with asyncio.timeout(20):
            response = await client.submit(request)
    except RpcError as exc:
        assert exc.code in ACCEPTABLE, (exc.code, exc.details, request)
        assert exc.details and "Traceback" not in exc.details
        return None
    return str(response.job.job_id)


async def _collect(stream: Any) -> list[v1.RolloutEvent]:
    return [event async for event in stream]
