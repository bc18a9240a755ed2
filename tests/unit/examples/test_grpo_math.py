"""The GRPO example's arithmetic (examples/grpo): advantages, masking, clipping, GGUF round trip.

No model, no server: a tiny random llama checkpoint written with gguf-py. Skipped where
the `train` extra (torch, gguf) is not installed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from examples.grpo.checkpoint import Llama, LlamaConfig, _rope, load_gguf, save_gguf, token_logprobs  # noqa: E402
from examples.grpo.grpo import advantages, clipped_loss, grpo_update, pack  # noqa: E402
from examples.grpo.rollouts import Sample  # noqa: E402


def sample(group: str, reward: float, *, infra: bool = False, mask: tuple[int, ...] = (0, 0, 1, 1)) -> Sample:
    return Sample(
        job_id=f"{group}-{reward}",
        task_id=group,
        group_id=group,
        reward=reward,
        infrastructure_failure=infra,
        token_ids=tuple(range(1, len(mask) + 1)),
        loss_mask=mask,
        logprobs=tuple(-0.5 if m else 0.0 for m in mask),
        policy_versions=(0,),
        answer=None,
        text="",
    )


def test_advantages_are_normalised_within_each_group() -> None:
    scored = advantages([sample("a", 1.0), sample("a", 0.0), sample("b", 1.0), sample("b", 1.0), sample("b", 0.0)])
    by_group: dict[str, list[float]] = {}
    for s, value in scored:
        by_group.setdefault(s.group_id, []).append(value)
    assert by_group["a"] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert sum(by_group["b"]) == pytest.approx(0.0, abs=1e-6)
    assert by_group["b"][0] > 0 > by_group["b"][2]


def test_infrastructure_failures_are_masked_out_not_scored_as_zero() -> None:
    # Counted as reward 0 the failure would push the 0.0 sample above the group's mean.
    scored = advantages([sample("a", 1.0), sample("a", 0.0), sample("a", 0.0, infra=True)])
    assert [(s.reward, s.infrastructure_failure) for s, _ in scored] == [(1.0, False), (0.0, False)]
    assert [v for _, v in scored] == pytest.approx([1.0, -1.0], abs=1e-5)


def test_groups_with_equal_rewards_and_samples_without_sampled_tokens_teach_nothing() -> None:
    assert advantages([sample("a", 1.0), sample("a", 1.0), sample("b", 0.0), sample("b", 0.0)]) == []
    scored = advantages([sample("a", 1.0), sample("a", 0.0), sample("a", 1.0, mask=(0, 0, 0, 0))])
    assert len(scored) == 2


def test_pack_targets_only_loss_masked_tokens() -> None:
    first = dataclasses.replace(sample("a", 1.0, mask=(0, 1, 0, 1)), token_ids=(5, 6, 7, 8))
    second = dataclasses.replace(sample("a", 0.0, mask=(0, 0, 1)), token_ids=(9, 10, 11))
    batch = pack([(first, 1.0), (second, -1.0)])
    assert batch.ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert batch.targets.tolist() == [[0, 1], [0, 3], [1, 2]]
    assert batch.old_logprobs.tolist() == [-0.5, -0.5, -0.5]
    assert batch.advantages.tolist() == [1.0, 1.0, -1.0]


def test_clipped_loss_stops_the_gradient_beyond_the_clip_range() -> None:
    old = torch.zeros(4)
    new = torch.tensor([0.0, 0.5, 0.0, -0.5], requires_grad=True)  # ratios 1, 1.65, 1, 0.61
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    clipped_loss(new, old, adv, 0.2).sum().backward()
    assert new.grad is not None
    # Inside the range the gradient follows the advantage; a ratio already past the clip in
    # the advantage's direction gets none.
    assert new.grad.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0])


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        n_layers=2, dim=64, ffn_dim=96, n_heads=4, n_kv_heads=2, rope_base=10000.0, norm_eps=2**-17, vocab_size=40
    )


def write_template(path: Path, config: LlamaConfig) -> None:
    """A tiny llama GGUF: metadata like a real one, F32 norms, Q8_0 matrices."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(config.dim)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    for name, parameter in Llama(config).gguf_parameters():
        values = rng.normal(0, 0.2, tuple(parameter.shape)).astype(np.float32)
        if values.ndim == 1:
            writer.add_tensor(name, 1 + values)
        else:
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_checkpoint_round_trip_keeps_metadata_weights_and_frozen_bytes(tmp_path: Path) -> None:
    template = tmp_path / "template.gguf"
    write_template(template, tiny_config())
    model = load_gguf(template)
    assert model.config == tiny_config()
    model.train_top_layers(1)
    with torch.no_grad():
        model.blocks[1].attn_q.weight.add_(0.01)
    out = tmp_path / "trained.gguf"
    save_gguf(model, out, template=template, dtype="f32")
    assert not list(tmp_path.glob(".*partial"))

    original, written = gguf.GGUFReader(template), gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in original.fields.items() if not k.startswith("GGUF.")}
    assert {k: f.contents() for k, f in written.fields.items() if not k.startswith("GGUF.")} == fields
    types = {t.name: t.tensor_type for t in written.tensors}
    assert types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0  # frozen: the template's bytes
    frozen = next(t for t in written.tensors if t.name == "blk.0.attn_q.weight")
    source = next(t for t in original.tensors if t.name == "blk.0.attn_q.weight")
    assert bytes(frozen.data) == bytes(source.data)

    reloaded = load_gguf(out)
    for (name, before), (_, after) in zip(model.gguf_parameters(), reloaded.gguf_parameters(), strict=True):
        assert torch.equal(before, after), name
    ids = torch.tensor([[1, 5, 7, 9, 3]])
    assert torch.allclose(model(ids), reloaded(ids))


def test_interleaved_rope_on_gguf_weights_equals_rotate_half_on_hf_weights() -> None:
    """Why no permutation is needed: llama.cpp's Q/K rows (convert_hf_to_gguf's permute) with
    RoPE on interleaved pairs give the attention scores of Hugging Face's rotate-half RoPE."""
    heads, head_dim, dim, time = 2, 8, 16, 5
    torch.manual_seed(0)
    w_q, w_k, x = torch.randn(heads * head_dim, dim), torch.randn(heads * head_dim, dim), torch.randn(1, time, dim)

    def permute(w: torch.Tensor) -> torch.Tensor:  # convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape)

    angles = torch.outer(torch.arange(time).float(), 10000.0 ** (-torch.arange(head_dim // 2) * 2 / head_dim))

    def hf_rope(v: torch.Tensor) -> torch.Tensor:
        cos, sin = torch.cat([angles.cos()] * 2, -1)[None, :, None], torch.cat([angles.sin()] * 2, -1)[None, :, None]
        half = torch.cat([-v[..., head_dim // 2 :], v[..., : head_dim // 2]], -1)
        return v * cos + half * sin

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthd,bshd->bhts", q, k)

    split = (1, time, heads, head_dim)
    hf = scores(hf_rope((x @ w_q.T).view(split)), hf_rope((x @ w_k.T).view(split)))
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    ours = scores(_rope((x @ permute(w_q).T).view(split), cos, sin), _rope((x @ permute(w_k).T).view(split), cos, sin))
    assert torch.allclose(hf, ours, atol=1e-4)


def test_one_update_raises_the_log_prob_of_a_positive_advantage_sample(tmp_path: Path) -> None:
    template = tmp_path / "template.gguf"
    write_template(template, tiny_config())
    model = load_gguf(template)
    model.requires_grad_(True)
    good = dataclasses.replace(sample("a", 1.0, mask=(0, 0, 1, 1, 1)), token_ids=(1, 2, 3, 4, 5))
    bad = dataclasses.replace(sample("a", 0.0, mask=(0, 0, 1, 1, 1)), token_ids=(1, 2, 6, 7, 8))

    def logprobs(s: Sample) -> list[float]:
        with torch.no_grad():
            batch = pack([(s, 0.0)])
            return [float(v) for v in token_logprobs(model, batch.ids, batch.targets, 0.7)]

    def logprob(s: Sample) -> float:
        return sum(logprobs(s))

    # The service's log-probs, as if it had sampled from exactly these weights.
    good, bad = (dataclasses.replace(s, logprobs=(0.0, 0.0, *logprobs(s))) for s in (good, bad))
    before = logprob(good), logprob(bad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = grpo_update(model, optimizer, advantages([good, bad]), temperature=0.7)
    assert stats is not None and stats.samples == 2 and stats.tokens == 6
    assert stats.mismatch_max_abs < 1e-5  # old log-probs were the trainer's own
    assert logprob(good) > before[0] and logprob(bad) < before[1]
