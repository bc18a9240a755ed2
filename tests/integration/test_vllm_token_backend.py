"""The token backend (kind `vllm`) on a REAL vLLM (CPU build, SmolLM2-135M-Instruct): math
rollouts through the real server, real Podman sandboxes, multi-turn with tools offered.

A recording pass-through in front of vLLM (tests/vllm.py RecordingProxy) keeps every
request and answer, so the checks are against what vLLM itself saw and said:
- the trajectory is the last prompt sent plus the last sampled ids; every prompt
  extends the previous prompt and its sample; the loss mask is 1 exactly on the
  sampled ids; vLLM's own `prompt_token_ids` and `token_ids` are those ids;
- the log-probs are vLLM's, and a transformers forward pass over the same weights
  (scripts/rescore_logprobs.py, in vLLM's environment) at the sampling temperature
  gives the same values within bf16 noise, while the raw (temperature 1) values do
  not: the mode on the wire (processed) is the one vLLM was started with.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest

from prorl_client import v1
from tests.vllm import MODEL, SERVED_NAME, TOOL_CALL_PARSER, RecordingProxy, VLLMServer, rescore

# The first test to use the session's vLLM waits for it to start (minutes on a busy CPU): tests/vllm.py.
pytestmark = [pytest.mark.vllm, pytest.mark.podman, pytest.mark.timeout(2400)]

TEMPERATURE = 0.7
QUESTIONS = [("What is 6 * 7?", "42"), ("What is 12 + 30?", "42"), ("What is 2 ** 5?", "32"), ("What is 81 / 9?", "9")]


def vllm_backend(base_url: str, backend_id: str = "vllm") -> dict[str, Any]:
    return {
        "id": backend_id,
        "kind": "vllm",
        "base_url": base_url,
        "model": SERVED_NAME,
        "tokenizer_path": str(MODEL),
        "tool_call_parser": TOOL_CALL_PARSER,
        "logprobs_mode": "processed",
    }


def math_job(question: str, answer: str, index: int, *, max_turns: int = 3, max_tokens: int = 48) -> v1.RolloutRequest:
    request = v1.RolloutRequest(handler="math", job_id=f"vllm-math-{index}")
    request.instance.update({"question": question, "answer": answer})
    request.sampling.temperature = TEMPERATURE
    request.sampling.max_tokens = max_tokens
    request.sampling.seed = 1000 + index
    request.limits.max_turns = max_turns
    return request


def exchanges_of(trajectory: v1.Trajectory, proxy: RecordingProxy) -> list[Any]:
    """The completions of one job: those whose prompt starts its trajectory, shortest first."""
    ids = list(trajectory.token_ids)
    mine = [e for e in proxy.completions() if ids[: len(e.request["prompt"])] == e.request["prompt"]]
    return sorted(mine, key=lambda e: len(e.request["prompt"]))


async def test_math_rollouts_on_a_real_vllm_have_exact_ids_and_its_logprobs(
    vllm: VLLMServer, start_server: Any
) -> None:
    proxy = RecordingProxy(vllm)
    await proxy.start()
    try:
        _, client = await start_server(
            None, llm={"backends": [vllm_backend(proxy.base_url)], "embedded": {"enabled": "never"}}
        )

        async def run(index: int) -> tuple[v1.RolloutResult, list[v1.ModelTurn]]:
            question, answer = QUESTIONS[index]
            events = [e async for e in client.rollout(math_job(question, answer, index))]
            return events[-1].finished.result, [e.model_turn for e in events if e.HasField("model_turn")]

        runs = await asyncio.gather(*(run(i) for i in range(len(QUESTIONS))))
    finally:
        await proxy.stop()

    sequences: list[dict[str, Any]] = []
    served: list[float] = []
    multi_turn = 0
    for result, turns in runs:
        assert result.status == v1.JOB_STATUS_SUCCEEDED, result.failure
        trajectory = result.trajectory
        ids, mask, logprobs = list(trajectory.token_ids), list(trajectory.loss_mask), list(trajectory.logprobs)
        exchanges = exchanges_of(trajectory, proxy)
        assert len(exchanges) == len(turns) == trajectory.num_turns >= 1
        multi_turn += len(turns) > 1
        prompts = [e.request["prompt"] for e in exchanges]
        samples = [
            [int(t.removeprefix("token_id:")) for t in e.response["choices"][0]["logprobs"]["tokens"]]
            for e in exchanges
        ]
        for exchange, prompt, sample, turn in zip(exchanges, prompts, samples, turns, strict=True):
            choice = exchange.response["choices"][0]
            assert choice["prompt_token_ids"] == prompt  # vLLM saw exactly the ids sent: no BOS added, no re-tokenising
            assert choice["token_ids"] == sample == list(turn.token_ids)
            assert turn.logprobs_mode == v1.LOGPROBS_MODE_PROCESSED and turn.backend_id == "vllm"
        for earlier, later, sample in zip(prompts, prompts[1:], samples, strict=False):
            assert later[: len(earlier) + len(sample)] == earlier + sample  # every prompt extends the last
        assert ids == prompts[-1] + samples[-1]
        spans = [(len(p), len(p) + len(s)) for p, s in zip(prompts, samples, strict=True)]
        assert [(s.start, s.end) for s in trajectory.turn_spans] == spans
        sampled = {i for start, end in spans for i in range(start, end)}
        assert mask == [1 if i in sampled else 0 for i in range(len(ids))]
        for (start, end), exchange in zip(spans, exchanges, strict=True):
            wire = exchange.response["choices"][0]["logprobs"]["token_logprobs"]
            assert logprobs[start:end] == pytest.approx(wire, abs=1e-6)  # vLLM's own values, as float32
        positions = sorted(sampled)
        sequences.append({"token_ids": ids, "positions": positions, "temperature": TEMPERATURE})
        served.extend(logprobs[i] for i in positions)
    assert multi_turn >= 1, "no job took a second turn: the incremental prompts were not exercised"
    assert any(t.text for _, turns in runs for t in turns)

    both = await asyncio.to_thread(rescore, MODEL, [*sequences, *({**s, "temperature": 1.0} for s in sequences)])
    processed = [value for seq in both[: len(sequences)] for value in seq]
    raw = [value for seq in both[len(sequences) :] for value in seq]
    delta = [abs(a - b) for a, b in zip(served, processed, strict=True)]
    delta_raw = [abs(a - b) for a, b in zip(served, raw, strict=True)]
    print(
        f"\nre-scored {len(delta)} sampled tokens with transformers: |Δ| median {statistics.median(delta):.4f}, "
        f"max {max(delta):.4f} (at T={TEMPERATURE}); against raw log-probs (T=1) median "
        f"{statistics.median(delta_raw):.4f}, max {max(delta_raw):.4f}"
    )
    assert statistics.median(delta) < 0.02 and max(delta) < 0.5
    assert statistics.median(delta_raw) > 3 * statistics.median(delta)  # not raw: the mode on the wire is processed
