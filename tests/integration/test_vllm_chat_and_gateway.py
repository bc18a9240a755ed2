"""The chat backend (kind `openai_chat`) and the model gateway (`command` family) on a REAL
vLLM (CPU build, SmolLM2-135M-Instruct, started with --enable-auto-tool-choice
--tool-call-parser hermes): rollouts complete through the real server and Podman.

- openai_chat: math rollouts, multi-turn; vLLM's hermes parser reads the calls the model
  writes; a conversation with a tool call and its result goes back to vLLM and is taken.
- command: an agent program (examples/grpo/answer_agent.py, the OpenAI chat API inside
  its sandbox) calls the job's gateway, whose turns go to vLLM as exact token ids (kind
  `vllm`): the job's chain is the last prompt vLLM saw plus its sample.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from examples.grpo.tasks import answer_task
from prorl_client import v1
from prorl_server.llm.backend_settings import BackendSettings
from prorl_server.llm.base import Sampling
from prorl_server.llm.factory import build_backend
from prorl_server.llm.openai_chat import OpenAIChatBackend
from tests.integration.test_vllm_token_backend import math_job, vllm_backend
from tests.vllm import SERVED_NAME, RecordingProxy, VLLMServer

# The first test to use the session's vLLM waits for it to start (minutes on a busy CPU): tests/vllm.py.
pytestmark = [pytest.mark.vllm, pytest.mark.podman, pytest.mark.timeout(2400)]

FINISH = {
    "type": "function",
    "function": {
        "name": "finish",
        "description": "Submit the final answer.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}


def chat_backend(base_url: str) -> dict[str, Any]:
    return {"id": "vllm-chat", "kind": "openai_chat", "base_url": base_url, "model": SERVED_NAME}


async def test_math_rollouts_on_vllm_chat_completions(vllm: VLLMServer, start_server: Any) -> None:
    _, client = await start_server(
        None, llm={"backends": [chat_backend(vllm.base_url)], "embedded": {"enabled": "never"}}
    )

    async def run(index: int) -> tuple[v1.RolloutResult, list[v1.ModelTurn]]:
        events = [e async for e in client.rollout(math_job("What is 6 * 7?", "42", 50 + index))]
        return events[-1].finished.result, [e.model_turn for e in events if e.HasField("model_turn")]

    runs = await asyncio.gather(*(run(i) for i in range(2)))
    for result, turns in runs:
        assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
        assert turns and all(t.backend_id == "vllm-chat" and t.completion_token_count > 0 for t in turns)
        assert all(t.finish_reason in ("stop", "length", "tool_calls") for t in turns)
        assert not result.trajectory.token_ids  # a chat backend gives no ids
        assert result.trajectory.num_turns == len(turns)


async def test_a_tool_call_round_trips_through_vllm_chat(vllm: VLLMServer) -> None:
    """vLLM's hermes parser turns the model's <tool_call> into the API's tool_calls (forced here
    with tool_choice, which vLLM meets by constrained decoding), the backend reads them, and the
    call with its result goes back to vLLM for the next turn."""
    settings = BackendSettings(id="vllm-chat", kind="openai_chat", base_url=vllm.base_url, model=SERVED_NAME)
    backend = build_backend(settings, timeout_s=600, max_retries=0)
    assert isinstance(backend, OpenAIChatBackend)
    sampling = Sampling(max_tokens=64, temperature=0.0, model=SERVED_NAME)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7? Submit it with finish."}]
    try:
        payload = backend._payload(messages, [FINISH], sampling, native_tools=True)
        payload["tool_choice"] = {"type": "function", "function": {"name": "finish"}}
        body = await backend._http.post("/chat/completions", payload)
        result = backend._parse(body, 0.0)
        assert [call.name for call in result.tool_calls] == ["finish"] and result.tool_calls[0].id
        call = result.tool_calls[0]
        messages += [
            {
                "role": "assistant",
                "content": result.text,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "accepted"},
        ]
        after = await backend.chat(messages, [FINISH], sampling, native_tools=True)
        assert after.finish_reason in ("stop", "length", "tool_calls") and after.completion_tokens > 0
    finally:
        await backend.close()


async def test_an_agent_program_on_the_gateway_runs_on_vllm_with_exact_ids(vllm: VLLMServer, start_server: Any) -> None:
    proxy = RecordingProxy(vllm)
    await proxy.start()
    try:
        _, client = await start_server(
            None, llm={"backends": [vllm_backend(proxy.base_url)], "embedded": {"enabled": "never"}}
        )
        task = answer_task("gateway-0", "What is 3 + 4?", "7")
        request = v1.RolloutRequest(handler="command", job_id="vllm-gateway")
        request.instance.update(task.instance)
        request.sampling.temperature = 0.7
        request.sampling.max_tokens = 48
        events = [e async for e in client.rollout(request)]
    finally:
        await proxy.stop()
    result = events[-1].finished.result
    assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
    turns = [e.model_turn for e in events if e.HasField("model_turn")]
    assert len(turns) == 1 and turns[0].backend_id == "vllm"
    (exchange,) = proxy.completions()
    chain = result.trajectory.chains[-1]
    sample = exchange.response["choices"][0]["token_ids"]
    assert list(chain.token_ids) == exchange.request["prompt"] + sample == list(result.trajectory.token_ids)
    assert list(chain.loss_mask) == [0] * len(exchange.request["prompt"]) + [1] * len(sample)
    assert result.reward in (0.0, 1.0)  # judged by the math verifier on the reply's last line
