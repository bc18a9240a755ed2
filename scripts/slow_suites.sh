#!/usr/bin/env bash
# Every test beyond the fast suite, as two pytest runs side by side:
#   containers: the Podman and PostgreSQL suites (integration, adversarial, deploy), which
#               spend most of their time waiting for containers and servers;
#   models:     the suites on a real model (the embedded llama.cpp model, vLLM), which
#               spend theirs computing.
# Together they take about as long as the longer one instead of the sum. Each has its own
# temporary folder and sandbox state folder (a pytest run removes the older temporary
# folders of its user, and would remove the other's). The models run's output is printed
# after the containers run's; the exit status is non-zero if either failed.
#   PYTEST   how to run pytest (default: python -m pytest)
set -uo pipefail
read -r -a pytest <<<"${PYTEST:-python -m pytest}"
base="$(mktemp -d /tmp/prorl-slow.XXXXXX)"
state_b="${PRORL_TEST_STATE_DIR:-/var/lib/prorl}-models"
install -d -m 0755 -o prorl -g prorl "$state_b"
trap 'rm -rf "$base"' EXIT

PRORL_TEST_STATE_DIR="$state_b" "${pytest[@]}" -m "(e2e or vllm) and not harnesses" -q --durations=15 \
    -p no:cacheprovider --basetemp="$base/models" >"$base/models.log" 2>&1 &
models=$!
"${pytest[@]}" -m "(podman or slow or postgres) and not e2e and not vllm and not harnesses" -q \
    --durations=25 -p no:cacheprovider --basetemp="$base/containers"
containers=$?
wait "$models"
models_status=$?
echo "=== the suites on a real model (run beside the ones above) ==="
cat "$base/models.log"
echo "slow suites: containers exit $containers, models exit $models_status"
(( containers == 0 && models_status == 0 ))
