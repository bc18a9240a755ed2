#!/usr/bin/env bash
# Runs a command where the podman, conmon, crun and runc commands cannot run: in a
# private mount namespace, each is covered by an empty file without execute
# permission. Shows that the fast suite needs no Podman (make test-without-podman).
set -euo pipefail
if [[ "$(id -u)" != 0 ]]; then
    echo "without_podman.sh needs root (unshare --mount); run the command directly instead" >&2
    exit 2
fi
blank="$(mktemp)"
trap 'rm -f "$blank"' EXIT
chmod 0644 "$blank"
unshare --mount --propagation private -- bash -c '
    set -euo pipefail
    blank=$1; shift
    for name in podman conmon crun runc; do
        for path in $(type -ap "$name" 2>/dev/null || true); do
            mount --bind "$blank" "$path"
            if [[ -x "$path" ]]; then echo "$path is still executable" >&2; exit 1; fi
        done
    done
    echo "podman, conmon, crun and runc hidden: running $*" >&2
    "$@"
' bash "$blank" "$@"
