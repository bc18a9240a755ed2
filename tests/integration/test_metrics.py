"""The Prometheus endpoint after a few rollouts agrees with what ran."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.scripted_llm import ScriptedReply, tool_call_text, turn_index
from tests.helpers import math_request

pytestmark = pytest.mark.podman


def python_then_finish(messages: list[dict[str, Any]]) -> ScriptedReply:
    if turn_index(messages) == 0:
        return ScriptedReply(tool_call_text("python", {"code": "print(6 * 7)"}))
    return ScriptedReply(tool_call_text("finish", {"answer": "42"}))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_counters_match_the_jobs_run(scripted_llm, start_server) -> None:
    llm = await scripted_llm(python_then_finish)
    server, client = await start_server(
        llm.base_url, server={"metrics_port": 0}, sandbox={"allowed_images": ["localhost/prorl-*"]}
    )
    for i in range(3):
        events = [e async for e in client.rollout(math_request("What is 6 * 7?", "42", job_id=f"m{i}"))]
        assert events[-1].finished.result.reward == 1.0
    bad = math_request("q", "1", job_id="bad")
    bad.sandbox.image = "localhost/prorl-no-such-image:latest"
    _ = [e async for e in client.rollout(bad)]

    url = f"http://127.0.0.1:{server.metrics.port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        scraped = samples(await response.text())

    def value(name: str, **labels: str) -> float:
        return scraped[(name, tuple(sorted(labels.items())))]

    assert value("prorl_jobs_submitted_total", handler="math") == 4
    assert value("prorl_jobs_finished_total", handler="math", status="succeeded") == 3
    assert value("prorl_jobs_finished_total", handler="math", status="failed") == 1
    assert value("prorl_jobs", status="succeeded") == 3 and value("prorl_jobs", status="failed") == 1
    assert value("prorl_llm_requests_total", backend="scripted") == 6
    assert value("prorl_llm_request_seconds_count", backend="scripted") == 6
    assert value("prorl_llm_tokens_total", backend="scripted", kind="completion") > 0
    assert value("prorl_tool_call_seconds_count", tool="python") == 3
    assert value("prorl_tool_call_seconds_count", tool="finish") == 3
    assert value("prorl_phase_seconds_count", phase="init") == 4
    assert value("prorl_phase_seconds_count", phase="run") == 3
    assert value("prorl_phase_seconds_count", phase="eval") == 3
    assert value("prorl_queue_wait_seconds_count", phase="init") == 4
    assert all(value("prorl_phase_active", phase=p) == 0 for p in ("init", "run", "eval"))
    assert value("prorl_backend_in_flight", backend="scripted") == 0
    assert value("prorl_backend_healthy", backend="scripted") == 1
