# One entry point per task. `make setup` prepares a fresh Debian 12 machine (as root).
# Everything runs in a virtual environment made from Debian's own python3
# (which refuses pip installs, PEP 668): `make setup-python` creates it.
VENV ?= $(CURDIR)/.venv
SYSTEM_PYTHON ?= /usr/bin/python3
PYTHON ?= $(VENV)/bin/python
PIP ?= $(PYTHON) -m pip
PYTEST ?= $(PYTHON) -m pytest
export PYTHON
# vLLM's CPU build and the model it serves, in an environment of their own (scripts/setup_vllm.sh);
# the tests marked `vllm` and `make serve-vllm` use them.
VLLM_VENV ?= $(CURDIR)/.venv-vllm
export PRORL_VLLM_VENV := $(VLLM_VENV)
# The embedded model's OpenMP threads wait without spinning: they share the
# CPUs with sandboxes and tests (see prorl_server/cli.py).
export OMP_WAIT_POLICY ?= PASSIVE
# The fast suite: no Podman, no PostgreSQL, no real model (fakes of each).
FAST_MARKERS := not podman and not e2e and not slow and not postgres and not vllm

.PHONY: setup setup-demo setup-host setup-python images images-harnesses test-harnesses proto proto-check lint lint-proto test test-loaded test-without-podman test-integration test-e2e test-all test-vllm setup-vllm serve-vllm demo train-demo clean-containers bench bench-sandbox bench-llm bench-vllm bench-load bench-cluster bench-feed bench-verification bench-throughput bench-fork bench-live

setup: setup-host setup-python images

setup-host:
	bash scripts/setup_host.sh

setup-python: $(VENV)/.installed

# Reinstalls only when the venv is missing or what it is installed from changed.
$(VENV)/.installed: pyproject.toml prorl_client/pyproject.toml scripts/setup_python.sh
	VENV=$(VENV) SYSTEM_PYTHON=$(SYSTEM_PYTHON) bash scripts/setup_python.sh
	@touch $@

images:
	bash scripts/build_images.sh

# The coding-agent CLIs' image (sandbox_images/harnesses: Codex, Claude Code, Gemini CLI, OpenCode,
# Qwen Code; about 1.4 GB of npm packages) and its SWE task images; not part of `setup`.
images-harnesses:
	PRORL_HARNESSES=1 bash scripts/build_images.sh

# Each CLI end to end in a network-less sandbox, driven by a scripted model on the fake vLLM.
test-harnesses: setup images-harnesses
	$(PYTEST) -m harnesses -q --durations=10

# Quick once done (a stamp in the venv; the model folder is made once).
setup-vllm:
	VLLM_VENV=$(VLLM_VENV) SYSTEM_PYTHON=$(SYSTEM_PYTHON) bash scripts/setup_vllm.sh

proto:
	$(PYTHON) scripts/gen_proto.py

# Fails when the generated code under prorl_client/ is not what `make proto` makes.
proto-check: proto
	@git diff --exit-code --stat -- prorl_client/src/prorl_client/_proto prorl_client/src/prorl_client/v1 \
	  || (echo "generated code is stale: run 'make proto' and commit" && exit 1)
	@test -z "$$(git status --porcelain -- prorl_client/src/prorl_client/_proto prorl_client/src/prorl_client/v1)" \
	  || (echo "untracked generated files: run 'make proto' and commit" && exit 1)

# The contract's style (Buf's STANDARD rules); buf comes from the npm registry.
BUF ?= npx --yes @bufbuild/buf@1.75.0

lint-proto:
	$(BUF) lint

lint: lint-proto
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

# Fast, and runs without Podman or PostgreSQL: the core (job manager, pipeline, tool loop, every
# family, a real gRPC server) against the fake sandbox provider and scripted LLMs.
test:
	$(PYTEST) -m "$(FAST_MARKERS)" -q

# The same fast suite while a CPU hog keeps every core busy (scripts/under_load.sh): no
# test may depend on how fast the machine is. Not run by test-all: it doubles the suite's time.
test-loaded:
	bash scripts/under_load.sh $(PYTEST) -m "$(FAST_MARKERS)" -q

# The same fast suite on this machine with the podman command hidden (a private
# mount namespace): proves `make test` needs no Podman.
test-without-podman:
	bash scripts/without_podman.sh $(PYTEST) -m "$(FAST_MARKERS)" -q

# The integration layer: real rootless Podman sandboxes, scripted fake LLM; and the
# PostgreSQL job store against a throwaway cluster of its own (tests/postgres.py).
test-integration:
	$(PYTEST) -m "(podman or postgres) and not e2e and not slow and not harnesses" -q

# Against a real vLLM (CPU build, SmolLM2-135M): one server started for the run (tests/vllm.py).
test-vllm: setup setup-vllm
	$(PYTEST) -m vllm -q

# Slow: end to end with the real embedded model, and the long integration runs.
test-e2e:
	$(PYTEST) -m "e2e or slow" -q

# Everything CI runs: set-up, generated-code check, then side by side (scripts/test_suites.sh):
# the integration suites on Podman, the real-model suites, and the linters followed by the fast
# suite without Podman and the adversarial and deploy suites (the slowest tests listed: how far
# they are from pytest's timeout).
test-all: setup setup-vllm proto-check
	PYTEST="$(PYTEST)" FAST_MARKERS="$(FAST_MARKERS)" LINT="$(MAKE) --no-print-directory lint" \
	  bash scripts/test_suites.sh

# Benchmarks print ratios measured side by side in one run; figures go to docs/benchmarks.md.
bench: bench-sandbox bench-llm bench-load bench-cluster bench-feed bench-verification bench-throughput bench-fork bench-live

bench-sandbox: setup
	$(PIP) install --quiet -e '.[bench]'
	$(PYTHON) bench/sandbox.py

# 100, 300 and 1,000 sandboxes alive at once: command latency, CPU per command, memory, what stops it.
bench-live: setup
	$(PYTHON) bench/live_sandboxes.py

bench-llm: setup
	$(PYTHON) bench/llm.py
	$(PYTHON) bench/gateway_relay.py --provider podman

# Two real vLLM servers under the router: prefix-cache hit rate sticky vs per-turn least-loaded,
# and turns/s through prorl against the same prompts posted to vLLM directly.
bench-vllm: setup setup-vllm
	$(PYTHON) bench/vllm_prefix.py

# 1,000 jobs through one RolloutStream, 64 sandboxes at once; fails unless the server gets back to its baseline.
bench-load: setup
	$(PYTHON) bench/load.py

bench-cluster: setup
	$(PYTHON) bench/cluster.py

# ForkJob: a branch at turn k against a fresh rollout replaying k turns (math sandbox, Django SWE task).
bench-fork: setup
	$(PYTHON) bench/fork.py

# Subscribe: a finished-only and an every-event consumer side by side, a catch-up read, and the
# server's RSS without a subscriber and with a slow one (no Podman: fake sandboxes, scripted LLM).
bench-feed: setup
	$(PYTHON) bench/feed.py

# GetStats latency, right answers' job time and server RSS with 20 hostile math answers being
# verified, beside the same right answers alone (no Podman: fake sandboxes, scripted LLM).
bench-verification: setup
	$(PYTHON) bench/verification.py

# prorl-server with a real vLLM (CPU build, SmolLM2-135M) as its only backend instead of the
# embedded model: vLLM on 127.0.0.1:8000, prorl's gRPC on 127.0.0.1:50051 (docs/llm.md).
serve-vllm: setup setup-vllm
	$(PYTHON) scripts/serve_vllm.py

# Jobs/s with and without sandbox reuse, against Podman's container floor in the same run.
bench-throughput: setup
	$(PYTHON) bench/throughput.py

# The demo's own set-up is lighter than `setup`: Podman, the venv with the server and the embedded
# model only (no Go, C++, PostgreSQL, Slurm, chromium, torch or test tools), and the images.
demo: setup-demo
	$(PYTHON) -m prorl_server demo --out demo_trajectories.jsonl

setup-demo:
	PRORL_SETUP=demo bash scripts/setup_host.sh
	@$(MAKE) --no-print-directory $(VENV)/.installed-demo
	bash scripts/build_images.sh

# The full venv (`setup-python`) holds everything the demo's does.
$(VENV)/.installed-demo: pyproject.toml prorl_client/pyproject.toml scripts/setup_python.sh
	@if [ -f $(VENV)/.installed ] && [ $(VENV)/.installed -nt scripts/setup_python.sh ]; then :; \
	else VENV=$(VENV) SYSTEM_PYTHON=$(SYSTEM_PYTHON) PROFILE=demo bash scripts/setup_python.sh; fi
	@touch $@

# GRPO on the CPU (13 minutes here): trains the embedded model on rollouts served by a real
# prorl-server, pushing the weights back every step; figures and the reward curve go to docs/training/.
train-demo: setup
	$(PIP) install --quiet -e '.[train]'
	$(PYTHON) -m examples.grpo.train --out docs/training

# Removes every container any prorl server left (all instances).
clean-containers:
	cd / && runuser -u prorl -- env XDG_RUNTIME_DIR=/run/user/$$(id -u prorl) \
	  podman rm -f --filter label=prorl.managed=1 2>/dev/null || true
