#!/usr/bin/env bash
# Runs a command while a CPU hog keeps every core busy: one busy loop per core (HOGS=n
# for another count), at the tests' own priority, so that a test whose outcome depends
# on how fast the machine is shows itself (`make test-loaded`). The loops end with the
# command, whatever its outcome.
set -euo pipefail
hogs="${HOGS:-$(nproc)}"
pids=()
stop_hogs() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait "${pids[@]}" 2>/dev/null || true
}
trap stop_hogs EXIT
for _ in $(seq "$hogs"); do
    (while :; do :; done) &
    pids+=("$!")
done
echo "under_load.sh: $hogs busy loops (pids ${pids[*]}) while running: $*" >&2
"$@"
