#!/bin/bash
# Saves the sandbox images (built by scripts/build_images.sh in the sandbox user's Podman)
# as archives in deploy/container/images/, which deploy/container/Containerfile copies into
# the server image. Run as root on the machine that ran `make images`. Every image matching
# PATTERN (default localhost/prorl-*) is saved: leave out those sandbox.allowed_images does
# not allow in the cluster, e.g. PATTERN='localhost/prorl-python*'.
set -euo pipefail

user="${PRORL_SANDBOX_USER:-prorl}"
pattern="${1:-localhost/prorl-*}"
out="$(cd "$(dirname "$0")" && pwd)/images"
uid="$(id -u "$user")"
as_user=(runuser -u "$user" -- env XDG_RUNTIME_DIR="/run/user/$uid")

# The sandbox user may not be able to write into the checkout: it saves into a folder of its own.
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
chown "$user:" "$staging"
cd /
mapfile -t images < <("${as_user[@]}" podman images --filter "reference=$pattern" --format '{{.Repository}}:{{.Tag}}' | sort -u)
if ((${#images[@]} == 0)); then
    echo "save-images: no image matches $pattern (run make images first)" >&2
    exit 1
fi
for image in "${images[@]}"; do
    name="${image#localhost/}"
    name="${name//[:\/]/_}"
    echo "save-images: $image -> $out/$name.tar"
    "${as_user[@]}" podman save --quiet --format docker-archive --output "$staging/$name.tar" "$image"
    mv "$staging/$name.tar" "$out/$name.tar"
done
