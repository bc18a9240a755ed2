#!/usr/bin/env bash
# Every test of `make test-all`, as three lanes side by side, each one pytest run after another:
#   containers: the Podman and PostgreSQL suites of tests/integration, which spend much of
#               their time waiting for containers and servers; the longest, so it starts
#               first and its output is printed as it runs;
#   models:     the suites on a real model (the embedded llama.cpp model, vLLM), which
#               spend theirs computing;
#   fast:       the linters, the fast suite with the podman command hidden
#               (scripts/without_podman.sh: it must need no Podman), then the Podman suites
#               of tests/adversarial and tests/deploy (so that no lane runs alone at the end:
#               the machine is CPU-bound, and a lone lane leaves a core idle).
# Together they take about as long as the longest instead of the sum. Each pytest run has its
# own temporary folder and each lane its own sandbox state folder (a pytest run removes the
# older temporary folders of its user, and would remove another's). The other two lanes'
# output is printed after the containers lane's; the exit status is non-zero if any failed.
#   PYTEST        how to run pytest (default: python -m pytest)
#   FAST_MARKERS  the fast suite's marker expression (the Makefile's)
#   LINT          the linters' command, run before the fast suite (default: none)
set -uo pipefail
cd "$(dirname "$0")/.." || exit
read -r -a pytest <<<"${PYTEST:-python -m pytest}"
fast_markers="${FAST_MARKERS:?set FAST_MARKERS to the marker expression of the fast suite}"
base="$(mktemp -d /tmp/prorl-suites.XXXXXX)"
state="${PRORL_TEST_STATE_DIR:-/var/lib/prorl}"
for lane in models fast; do
    install -d -m 0755 -o prorl -g prorl "$state-$lane"
done
# The Podman and PostgreSQL suites; those of these folders run in the fast lane.
container_markers="(podman or slow or postgres) and not e2e and not vllm and not harnesses"
apart=(tests/adversarial tests/deploy)
lanes=()
trap 'kill "${lanes[@]}" 2>/dev/null; rm -rf "$base"' EXIT

# The machine's CPU time, busy and idle (jiffies, every core): the suites are mostly CPU-bound,
# and the share left idle says whether running more side by side could still help.
cpu() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6 }' /proc/stat; }
read -r busy_before idle_before < <(cpu)

(
    PRORL_TEST_STATE_DIR="$state-models" "${pytest[@]}" -m "(e2e or vllm) and not harnesses" -q --durations=15 \
        -p no:cacheprovider --basetemp="$base/models"
    status=$?
    echo "the real-model suites took ${SECONDS} s"
    exit "$status"
) >"$base/models.log" 2>&1 &
models=$!
lanes+=("$models")
(
    if [[ -n "${LINT:-}" ]]; then
        bash -c "$LINT" || exit
    fi
    PRORL_TEST_STATE_DIR="$state-fast" bash scripts/without_podman.sh "${pytest[@]}" -m "$fast_markers" -q \
        --durations=10 -p no:cacheprovider --basetemp="$base/fast"
    status=$?
    echo "the linters and the fast suite took ${SECONDS} s"
    PRORL_TEST_STATE_DIR="$state-fast" "${pytest[@]}" -m "$container_markers" -q --durations=15 \
        -p no:cacheprovider --basetemp="$base/adversarial" "${apart[@]}"
    (( $? == 0 && status == 0 ))
    status=$?
    echo "... then the Podman suites of ${apart[*]}: ${SECONDS} s"
    exit "$status"
) >"$base/fast.log" 2>&1 &
fast=$!
lanes+=("$fast")
"${pytest[@]}" -m "$container_markers" -q --durations=25 -p no:cacheprovider --basetemp="$base/containers" \
    "${apart[@]/#/--ignore=}"
containers=$?
echo "the container suites took ${SECONDS} s"
wait "$fast"
fast_status=$?
wait "$models"
models_status=$?
lanes=()
echo "=== the linters, the fast suite without Podman, the adversarial and deploy suites (run beside) ==="
cat "$base/fast.log"
echo "=== the suites on a real model (run beside the ones above) ==="
cat "$base/models.log"
read -r busy_after idle_after < <(cpu)
busy=$((busy_after - busy_before)) idle=$((idle_after - idle_before))
echo "test suites: ${SECONDS} s; the CPUs were busy $((100 * busy / (busy + idle > 0 ? busy + idle : 1)))% of it"
echo "test suites: containers exit $containers, fast exit $fast_status, models exit $models_status"
(( containers == 0 && fast_status == 0 && models_status == 0 ))
