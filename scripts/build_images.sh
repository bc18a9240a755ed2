#!/usr/bin/env bash
# Build the sandbox images offline into the sandbox user's rootless storage.
#
# No image registry is reachable here, so the base image is bootstrapped from
# Debian's package archive with debootstrap and imported; every other image
# is a Containerfile under sandbox_images/ built FROM it with no network.
# Idempotent: an image is rebuilt only when what it is built from changed
# (or FORCE=1).
set -euo pipefail

SANDBOX_USER="${PRORL_SANDBOX_USER:-prorl}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
uid="$(id -u "$SANDBOX_USER")"
export XDG_RUNTIME_DIR="/run/user/${uid}"
install -d -m 0700 -o "$SANDBOX_USER" -g "$SANDBOX_USER" "$XDG_RUNTIME_DIR"

as_user() {
    # cd: the sandbox user cannot enter root's home, where the checkout may be.
    (cd / && runuser -u "$SANDBOX_USER" -- env XDG_RUNTIME_DIR="$XDG_RUNTIME_DIR" HOME="$(getent passwd "$SANDBOX_USER" | cut -d: -f6)" "$@")
}
# Every image carries the digest of what it is built from (label prorl.digest,
# which covers its parent's digest too); an image is rebuilt when that changes.
digest_of() { sha256sum | cut -c1-16; }
built() { as_user podman image inspect --format '{{index .Labels "prorl.digest"}}' "$1" 2>/dev/null || true; }
stale() { [[ "${FORCE:-0}" == 1 || "$(built "$1")" != "$2" ]]; }

BASE=localhost/prorl-base:bookworm
# git and pytest: the SWE images check out repositories and run their tests offline.
BASE_PACKAGES=python3,git,python3-pytest
base_digest="$(echo "bookworm minbase $BASE_PACKAGES" | digest_of)"
if stale "$BASE" "$base_digest"; then
    echo "build-images: debootstrap $BASE (about a minute)"
    rootfs="$(mktemp -d /var/tmp/prorl-rootfs.XXXXXX)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | as_user podman import --quiet --change "LABEL prorl.digest=$base_digest" - "$BASE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
fi

# The project's venv (make exports PYTHON): Debian's python3 has no pip for `pip download`.
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"

# Python packages an image installs (its folder's requirements.txt: one pin,
# name==version, a line) are wheels downloaded on the host from PyPI into a
# cache, for the python of the base image (CPython 3.11, glibc 2.36, x86_64,
# binaries only); the build gets them in its context, as wheels/.
WHEEL_CACHE="${PRORL_WHEEL_CACHE:-/var/cache/prorl-wheels}"
# pip 23 does not count an older glibc's wheels as fitting a newer one: list them all.
WHEEL_PLATFORMS=(manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64)
for glibc_minor in $(seq 17 36); do WHEEL_PLATFORMS+=("manylinux_2_${glibc_minor}_x86_64"); done
cached_wheels() {  # LOCK: the cached wheel of each pin, one a line; fails when one is missing
    "$PYTHON" - "$1" "$WHEEL_CACHE" <<'PY'
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

lock, cache = Path(sys.argv[1]), Path(sys.argv[2])
cached = {parse_wheel_filename(wheel.name)[:2]: wheel for wheel in cache.glob("*.whl")}
missing = 0
for line in lock.read_text().splitlines():
    if line.split("#")[0].strip():
        pin = Requirement(line.split("#")[0])
        (version,) = (spec.version for spec in pin.specifier if spec.operator == "==")
        wheel = cached.get((canonicalize_name(pin.name), Version(version)))
        print(wheel or f"missing: {pin}")
        missing += wheel is None
sys.exit(1 if missing else 0)
PY
}
fetch_wheels() {  # LOCK DEST: the lock's wheels into DEST, downloading those the cache lacks
    install -d -m 0755 "$WHEEL_CACHE"
    if ! cached_wheels "$1" >/dev/null; then
        echo "build-images: downloading the wheels of ${1#"$ROOT"/} into $WHEEL_CACHE"
        # --no-deps: the lock pins every dependency. -qq: errors only (not this host's pip config warnings).
        "$PYTHON" -m pip download -qq --disable-pip-version-check --no-deps --only-binary=:all: \
            --implementation cp --python-version 3.11 --abi cp311 "${WHEEL_PLATFORMS[@]/#/--platform=}" \
            --dest "$WHEEL_CACHE" --requirement "$1"
    fi
    local wheels
    if ! wheels="$(cached_wheels "$1")"; then
        echo "build-images: wheels still missing after the download:" >&2
        grep '^missing' <<<"$wheels" >&2
        exit 1
    fi
    mkdir -p "$2"
    xargs -d '\n' cp -t "$2" <<<"$wheels"
}

# Containerfiles build from a copy of their folder the sandbox user can read.
for dir in "$ROOT"/sandbox_images/*/; do
    name="$(basename "$dir")"
    [[ -f "$dir/Containerfile" ]] || continue
    [[ "$name" != harnesses ]] || continue  # built FROM prorl-python, below, when asked for
    tag="localhost/prorl-${name}:latest"
    digest="$( (echo "$base_digest"; cd "$dir" && find . -type f | sort | xargs sha256sum) | digest_of)"
    if stale "$tag" "$digest"; then
        echo "build-images: $tag"
        ctx="$(mktemp -d /var/tmp/prorl-ctx.XXXXXX)"
        cp -r "$dir". "$ctx"
        if [[ -f "${dir}requirements.txt" ]]; then fetch_wheels "${dir}requirements.txt" "$ctx/wheels"; fi
        chown -R "$SANDBOX_USER:$SANDBOX_USER" "$ctx"
        as_user podman build --quiet --network none --pull-never --label "prorl.digest=$digest" -t "$tag" "$ctx" >/dev/null
        rm -rf "$ctx"
    fi
done

# SWE tasks: one image per task, holding a real project's repository at the
# task's base commit; the sources come from PyPI (pip download) on the host.
swe() { PYTHONPATH="$ROOT" "$PYTHON" -m prorl_server.datasets.swe "$@"; }
for task in "$ROOT"/sandbox_images/swe/tasks/*/; do
    [[ -f "$task/task.json" ]] || continue
    tag="$(swe image "$task")"
    digest="$( (built localhost/prorl-python:latest; swe digest "$task") | digest_of)"
    if stale "$tag" "$digest"; then
        echo "build-images: $tag"
        ctx="$(mktemp -d /var/tmp/prorl-ctx.XXXXXX)"
        swe prepare "$task" "$ctx"
        chown -R "$SANDBOX_USER:$SANDBOX_USER" "$ctx"
        as_user podman build --quiet --network none --pull-never --label "prorl.digest=$digest" -t "$tag" "$ctx" >/dev/null
        rm -rf "$ctx"
    fi
done
# Harbor / Terminal-Bench tasks: each task's environment/Dockerfile, translated
# by `prorl import-harbor` into a Containerfile built FROM a local image
# (sandbox_images/terminal/tasks; docs/handlers.md, "Harbor / Terminal-Bench tasks").
harbor() { PYTHONPATH="$ROOT/prorl_client/src:$ROOT" "$PYTHON" -m prorl_client.harbor_import "$@"; }
for task in "$ROOT"/sandbox_images/terminal/tasks/*/; do
    [[ -f "$task/task.toml" ]] || continue
    ctx="$(mktemp -d /var/tmp/prorl-ctx.XXXXXX)"
    tag="$(harbor context "$task" "$ctx")"
    digest="$( (built localhost/prorl-python:latest; cd "$ctx" && find . -type f | sort | xargs sha256sum) | digest_of)"
    if stale "$tag" "$digest"; then
        echo "build-images: $tag"
        chown -R "$SANDBOX_USER:$SANDBOX_USER" "$ctx"
        as_user podman build --quiet --network none --pull-never --label "prorl.digest=$digest" \
            -f "$ctx/Containerfile" -t "$tag" "$ctx" >/dev/null
    fi
    rm -rf "$ctx"
done
# The coding-agent CLIs (sandbox_images/harnesses), only with PRORL_HARNESSES=1
# (`make images-harnesses`): about 1.4 GB of npm packages, so `make images`
# leaves them out. Their npm tree is installed on the host from the lock
# (tarballs cached in PRORL_NPM_CACHE) into the build context; the build has
# no network. Then one image per SWE task with the CLIs: the task's own build
# context FROM localhost/prorl-harnesses, as localhost/prorl-harnesses-swe-<id>;
# PRORL_HARNESS_TASKS (task ids, space-separated) builds only those (the harness
# suite uses one: more-itertools__more-itertools-10.8.0).
if [[ "${PRORL_HARNESSES:-0}" == 1 ]]; then
    NPM_CACHE="${PRORL_NPM_CACHE:-/var/cache/prorl-npm}"
    dir="$ROOT/sandbox_images/harnesses/"
    harnesses=localhost/prorl-harnesses:latest
    digest="$( (built localhost/prorl-python:latest; cd "$dir" && find . -type f | sort | xargs sha256sum) | digest_of)"
    if stale "$harnesses" "$digest"; then
        command -v npm >/dev/null || { echo "build-images: the harness image needs npm on the host" >&2; exit 1; }
        echo "build-images: $harnesses (npm packages from the lock; a few minutes)"
        ctx="$(mktemp -d /var/tmp/prorl-ctx.XXXXXX)"
        cp -r "$dir". "$ctx"
        install -d -m 0755 "$NPM_CACHE"
        # --ignore-scripts: the Containerfile does what the packages' install scripts would.
        (cd "$ctx" && npm install --ignore-scripts --no-audit --no-fund --no-update-notifier --prefer-offline \
            --loglevel=error --cache "$NPM_CACHE" >/dev/null)
        chown -R "$SANDBOX_USER:$SANDBOX_USER" "$ctx"
        as_user podman build --quiet --network none --pull-never --label "prorl.digest=$digest" -t "$harnesses" "$ctx" >/dev/null
        rm -rf "$ctx"
    fi
    for task in "$ROOT"/sandbox_images/swe/tasks/*/; do
        [[ -f "$task/task.json" ]] || continue
        if [[ -n "${PRORL_HARNESS_TASKS:-}" && " $PRORL_HARNESS_TASKS " != *" $(basename "$task") "* ]]; then
            continue
        fi
        tag="$(swe image "$task" | sed 's|^localhost/prorl-swe-|localhost/prorl-harnesses-swe-|')"
        digest="$( (built "$harnesses"; swe digest "$task") | digest_of)"
        if stale "$tag" "$digest"; then
            echo "build-images: $tag"
            ctx="$(mktemp -d /var/tmp/prorl-ctx.XXXXXX)"
            swe prepare "$task" "$ctx"
            sed -i "s|^FROM localhost/prorl-python:latest\$|FROM $harnesses|" "$ctx/Containerfile"
            grep -q "^FROM $harnesses\$" "$ctx/Containerfile"
            chown -R "$SANDBOX_USER:$SANDBOX_USER" "$ctx"
            as_user podman build --quiet --network none --pull-never --label "prorl.digest=$digest" -t "$tag" "$ctx" >/dev/null
            rm -rf "$ctx"
        fi
    done
fi
as_user podman image prune --force >/dev/null
as_user podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep prorl
