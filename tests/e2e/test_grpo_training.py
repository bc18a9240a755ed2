"""The RL loop closed on the CPU: GRPO steps (examples/grpo) against a real server whose
embedded model (SmolLM2-135M) gets the trained weights back through UpdateWeights."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from examples.grpo.checkpoint import load_gguf, save_gguf, token_logprobs  # noqa: E402
from examples.grpo.grpo import advantages, grpo_update, pack  # noqa: E402
from examples.grpo.rollouts import Sample, Sampling, collect, requests  # noqa: E402
from examples.grpo.tasks import answer_task  # noqa: E402
from prorl_client import Client  # noqa: E402
from prorl_server.llm.llama_cpp_backend import default_model_path  # noqa: E402

pytestmark = pytest.mark.e2e

TEXT = (
    b"<|im_start|>user\nWhat is 17 + 25? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"
    b"The answer is 42. Seventeen plus twenty-five makes forty-two."
)


def llama_cpp_logprobs(path: Path, ids: list[int]) -> np.ndarray:
    """Next-token log-probs of ids[1:] as llama.cpp computes them from the file at `path`."""
    from llama_cpp import Llama

    llama = Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    try:
        llama.eval(ids)
        logits = np.array(llama.scores[: len(ids)], dtype=np.float64)
    finally:
        llama.close()
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return np.array([logprobs[i - 1, ids[i]] for i in range(1, len(ids))])


def test_checkpoint_round_trip_matches_llama_cpp(tmp_path: Path) -> None:
    from llama_cpp import Llama

    source = default_model_path()
    vocab = Llama(model_path=str(source), vocab_only=True, verbose=False)
    ids = vocab.tokenize(TEXT, special=True)
    vocab.close()
    model = load_gguf(source)
    with torch.no_grad():
        targets = torch.tensor([[0, i] for i in range(1, len(ids))])
        ours = token_logprobs(model, torch.tensor([ids]), targets, 1.0).double().numpy()

    # The original Q4_1 file: llama.cpp quantizes activations to 8 bits for its Q4_1 products,
    # hence a small difference from the dequantized float32 weights (measured: 0.04 mean).
    original = np.abs(llama_cpp_logprobs(source, ids) - ours)
    assert original.mean() < 0.1 and original.max() < 0.5
    # Written back, every tensor trained (F32, or F16 matrices): llama.cpp computes what torch does.
    model.requires_grad_(True)
    for dtype, tolerance in (("f32", 0.01), ("f16", 0.05)):
        path = tmp_path / f"model-{dtype}.gguf"
        save_gguf(model, path, template=source, dtype=dtype)
        written = np.abs(llama_cpp_logprobs(path, ids) - ours)
        assert written.max() < tolerance, (dtype, written.max())
        path.unlink()


def sum_logprobs(sample: Sample) -> float:
    return sum(lp for lp, mask in zip(sample.logprobs, sample.loss_mask, strict=True) if mask)


async def push(client: Client, model: torch.nn.Module, path: Path) -> int:
    await asyncio.to_thread(save_gguf, model, path, template=default_model_path())
    await client.pause()
    response = await client.update_weights(str(path), resume=True)
    assert response.resumed and [b.backend_id for b in response.backends] == ["embedded"]
    return response.policy_version


@pytest.mark.podman
async def test_two_grpo_steps_move_the_service_log_probs_the_way_the_advantage_says(
    start_server, tmp_path: Path
) -> None:
    _, client = await start_server(None)
    model = load_gguf(default_model_path())
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0)
    probe = answer_task("probe", "What is 2 + 3?", "5")
    greedy = Sampling(temperature=0.0, max_tokens=24)

    # Version 1: the trainer's own starting weights, so the service computes what it computes.
    assert await push(client, model, tmp_path / "policy-1.gguf") == 1
    (before,) = (await collect(client, requests([probe], 1, greedy, run_id="probe1"))).samples
    assert before.policy_versions == (1,) and any(before.loss_mask)

    # Step 1: a group where the greedy reply has a positive advantage over samples at
    # temperature 1 (whose log-probs are the greedy ones' plain softmax too).
    sampled = await collect(client, requests([probe], 3, Sampling(1.0, 24, seed=7), run_id="step1"))
    others = [s for s in sampled.samples if s.token_ids != before.token_ids]
    assert others, "every sample at temperature 1 repeated the greedy reply"
    group = [dataclasses.replace(before, group_id="g", reward=1.0)]
    group += [dataclasses.replace(s, group_id="g", reward=0.0) for s in others]
    scored = advantages(group)
    assert scored[0][1] > 0 > scored[1][1]
    negative = others[0]
    with torch.no_grad():
        batch = pack([(negative, 0.0)])
        negative_before = float(token_logprobs(model, batch.ids, batch.targets, 1.0).sum())
    stats = await asyncio.to_thread(grpo_update, model, optimizer, scored, temperature=1.0)
    assert stats is not None and stats.samples == len(group)
    assert stats.mismatch_mean_abs < 0.02  # the service sampled from the trainer's weights (F16)
    assert await push(client, model, tmp_path / "policy-2.gguf") == 2

    (after,) = (await collect(client, requests([probe], 1, greedy, run_id="probe2"))).samples
    assert after.policy_versions == (2,)
    assert after.token_ids == before.token_ids  # still the greedy reply, now more likely
    assert sum_logprobs(after) > sum_logprobs(before) + 0.05, (sum_logprobs(before), sum_logprobs(after))
    with torch.no_grad():
        assert float(token_logprobs(model, batch.ids, batch.targets, 1.0).sum()) < negative_before
    job = await client.get_job(after.job_id)
    assert dict(job.result.trajectory.turns_by_policy_version) == {2: 1}

    # Step 2: real rewards from the math verifier, rollouts only from version 2 on.
    step2 = await collect(
        client, requests([probe], 4, Sampling(0.7, 24, seed=11), run_id="step2", min_policy_version=2)
    )
    assert len(step2.samples) == 4 and not any(s.infrastructure_failure for s in step2.samples)
    assert all(s.policy_versions == (2,) for s in step2.samples)
    await asyncio.to_thread(grpo_update, model, optimizer, advantages(step2.samples), temperature=0.7)
    assert await push(client, model, tmp_path / "policy-3.gguf") == 3
    (last,) = (await collect(client, requests([probe], 1, greedy, run_id="probe3"))).samples
    assert last.policy_versions == (3,)
