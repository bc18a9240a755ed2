"""A llama-architecture GGUF checkpoint (SmolLM2) as a PyTorch model, and back to GGUF.

The torch model keeps llama.cpp's own tensor names and layout, so nothing is
renamed or permuted on the way in or out. In particular the Q and K weights
stay as llama.cpp stores them: convert_hf_to_gguf.py permutes the rows of each
head from Hugging Face's "rotate half" RoPE layout to interleaved pairs, and
this model applies RoPE to interleaved pairs (x[2i], x[2i+1]) as llama.cpp
does for the llama architecture (LLAMA_ROPE_TYPE_NORM). A Hugging Face
checkpoint would need that permutation undone; this one never leaves llama.cpp's
layout.

Loading dequantizes every tensor to float32 (gguf.quants). Saving copies every
metadata key of the template file (tokenizer, chat template, hyper-parameters)
and writes each trained tensor as F16 or F32, while frozen tensors keep their
original bytes (Q4_1, Q8_0): a checkpoint that trains a few layers stays close
to the original in size and speed, and the untrained part is bit-identical.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (the usual name)
from torch import nn

TensorDType = Literal["f16", "f32"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    rope_base: float
    norm_eps: float
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader) -> LlamaConfig:
        def value(key: str) -> float:
            field = reader.get_field(key)
            if field is None:
                raise ValueError(f"the GGUF file has no {key!r}")
            return float(field.contents())

        arch_field = reader.get_field("general.architecture")
        arch = str(arch_field.contents()) if arch_field is not None else ""
        if arch != "llama":
            raise ValueError(f"only the llama architecture is supported, this file is {arch!r}")
        embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
        return cls(
            n_layers=int(value("llama.block_count")),
            dim=int(value("llama.embedding_length")),
            ffn_dim=int(value("llama.feed_forward_length")),
            n_heads=int(value("llama.attention.head_count")),
            n_kv_heads=int(value("llama.attention.head_count_kv")),
            rope_base=value("llama.rope.freq_base"),
            norm_eps=value("llama.attention.layer_norm_rms_epsilon"),
            vocab_size=int(embedding.shape[1]),
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (llama.cpp's NORM mode); x is (batch, time, heads, head_dim)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        kv_dim = config.n_kv_heads * config.head_dim
        self.config = config
        self.attn_norm = nn.Parameter(torch.ones(config.dim))
        self.attn_q = nn.Linear(config.dim, config.dim, bias=False)
        self.attn_k = nn.Linear(config.dim, kv_dim, bias=False)
        self.attn_v = nn.Linear(config.dim, kv_dim, bias=False)
        self.attn_output = nn.Linear(config.dim, config.dim, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(config.dim))
        self.ffn_gate = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.ffn_up = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.ffn_down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, time, _ = x.shape
        h = _rms_norm(x, self.attn_norm, c.norm_eps)
        q = _rope(self.attn_q(h).view(batch, time, c.n_heads, c.head_dim), cos, sin)
        k = _rope(self.attn_k(h).view(batch, time, c.n_kv_heads, c.head_dim), cos, sin)
        v = self.attn_v(h).view(batch, time, c.n_kv_heads, c.head_dim)
        repeat = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
        x = x + self.attn_output(attended.reshape(batch, time, c.dim))
        h = _rms_norm(x, self.ffn_norm, c.norm_eps)
        out: torch.Tensor = x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))
        return out


class Llama(nn.Module):
    """A llama-architecture decoder whose parameters map one to one onto GGUF tensors."""

    inv_freq: torch.Tensor

    def __init__(self, config: LlamaConfig, *, tied_output: bool = True) -> None:
        super().__init__()
        self.config = config
        self.token_embd = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.output_norm = nn.Parameter(torch.ones(config.dim))
        self.output = None if tied_output else nn.Linear(config.dim, config.vocab_size, bias=False)
        half = config.head_dim // 2
        inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """The final normed hidden state at every position of `ids` (batch, time)."""
        positions = torch.arange(ids.shape[1], dtype=torch.float64)
        angles = torch.outer(positions, self.inv_freq)[None, :, None, :]  # (1, time, 1, head_dim / 2)
        cos, sin = angles.cos().float(), angles.sin().float()
        x = self.token_embd(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return _rms_norm(x, self.output_norm, self.config.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.token_embd.weight if self.output is None else self.output.weight
        return hidden @ weight.T

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(ids))

    def gguf_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(GGUF tensor name, parameter) for every tensor of the checkpoint."""
        yield "token_embd.weight", self.token_embd.weight
        for index, block in enumerate(self.blocks):
            for name, parameter in block.named_parameters():
                yield f"blk.{index}.{name.removesuffix('.weight')}.weight", parameter
        yield "output_norm.weight", self.output_norm
        if self.output is not None:
            yield "output.weight", self.output.weight

    def train_top_layers(self, count: int) -> list[torch.Tensor]:
        """Freeze everything but the last `count` blocks and the final norm; return what trains."""
        self.requires_grad_(False)
        trained: list[torch.Tensor] = [
            p for block in self.blocks[len(self.blocks) - count :] for p in block.parameters()
        ]
        trained.append(self.output_norm)
        for parameter in trained:
            parameter.requires_grad_(True)
        return trained


def _as_float32(tensor: gguf.ReaderTensor) -> np.ndarray:
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(tensor.data, dtype=np.float32)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def load_gguf(path: Path) -> Llama:
    """The checkpoint at `path` as a float32 torch model in eval mode, every parameter trainable."""
    reader = gguf.GGUFReader(path)
    config = LlamaConfig.from_reader(reader)
    tensors = {t.name: t for t in reader.tensors}
    model = Llama(config, tied_output="output.weight" not in tensors)
    expected = dict(model.gguf_parameters())
    if set(expected) != set(tensors):
        raise ValueError(f"{path}: unexpected tensors {sorted(set(tensors) ^ set(expected))[:5]}")
    with torch.no_grad():
        for name, parameter in expected.items():
            values = torch.from_numpy(_as_float32(tensors[name]).copy())
            if values.shape != parameter.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(values.shape)}, expected {tuple(parameter.shape)}")
            parameter.copy_(values)
    return model.eval()


def save_gguf(model: Llama, path: Path, *, template: Path, dtype: TensorDType = "f16") -> None:
    """Write `model` to `path` as a GGUF file llama.cpp loads in place of `template`.

    Every metadata key of `template` is copied. Parameters that require grad are
    written as `dtype` (norms always as F32, which llama.cpp requires of 1-D
    tensors); frozen ones keep the template's bytes. The file appears atomically
    (written beside, then renamed), so a reader never sees half of it.
    """
    reader = gguf.GGUFReader(template)
    originals = {t.name: t for t in reader.tensors}
    arch_field = reader.get_field("general.architecture")
    assert arch_field is not None
    partial = path.with_name(f".{path.name}.partial")
    writer = gguf.GGUFWriter(partial, str(arch_field.contents()))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for name, parameter in model.gguf_parameters():
        original = originals[name]
        if not parameter.requires_grad:
            writer.add_tensor(name, original.data, raw_shape=original.data.shape, raw_dtype=original.tensor_type)
            continue
        values = parameter.detach().cpu().numpy()
        as_f16 = dtype == "f16" and values.ndim > 1
        writer.add_tensor(name, values.astype(np.float16 if as_f16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)


def token_logprobs(model: Llama, ids: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-prob of ids[b, t] given ids[b, :t] for each (b, t) in `targets` (n, 2), under
    softmax(logits / temperature) as the embedded model reports them (plain softmax at 0)."""
    hidden = model.hidden_states(ids)
    rows, positions = targets[:, 0], targets[:, 1]
    logits = model.logits(hidden[rows, positions - 1]).float()
    if temperature > 0 and not math.isclose(temperature, 1.0):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[rows, positions][:, None]).squeeze(-1)
