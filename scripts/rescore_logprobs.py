"""Score given tokens of given sequences with transformers, independently of any server.

A check of a server's log-probs: the same weights, a plain forward pass of
transformers' own model code (no vLLM kernels, no KV cache), the log-softmax of
the logits divided by the temperature (what vLLM's processed_logprobs are
without top-p/top-k) at each position asked for.

Runs in vLLM's environment (it has transformers and torch):
    python scripts/rescore_logprobs.py [MODEL_DIR] < sequences.json > logprobs.json
stdin: [{"token_ids": [...], "positions": [i, ...], "temperature": 1.0, "model": DIR}, ...]
("model" only where it differs from MODEL_DIR)
stdout: one list per sequence, the log-prob of token_ids[i] given token_ids[:i] for each i.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    default = sys.argv[1] if len(sys.argv) > 1 else None
    models: dict[str, Any] = {}
    out: list[list[float]] = []
    with torch.inference_mode():
        for sequence in json.load(sys.stdin):
            folder = sequence.get("model") or default
            if folder not in models:
                models.clear()  # one at a time: the sequences come grouped by model
                models[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
            model = models[folder]
            ids = torch.tensor([sequence["token_ids"]])
            logits = model(input_ids=ids).logits[0].float() / float(sequence.get("temperature", 1.0))
            logprobs = torch.log_softmax(logits, dim=-1)
            out.append([float(logprobs[i - 1, sequence["token_ids"][i]]) for i in sequence["positions"]])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
