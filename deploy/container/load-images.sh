#!/bin/bash
# The init container of deploy/kubernetes/prorl.yaml (installed as prorl-load-images): loads
# the sandbox images baked into the server image (/opt/prorl/images/*.tar, podman save
# archives) into the sandbox user's Podman storage, an emptyDir volume shared with the
# server container. Run as root in the pod.
set -euo pipefail

user="${PRORL_SANDBOX_USER:-prorl}"
archives_dir="${PRORL_IMAGE_ARCHIVES:-/opt/prorl/images}"
uid="$(id -u "$user")"
home="$(getent passwd "$user" | cut -d: -f6)"

# A fresh emptyDir belongs to root: the storage must be the sandbox user's own.
install -d -m 0755 -o "$user" -g "$user" "$home/.local/share/containers"
install -d -m 0700 -o "$user" -g "$user" "/run/user/$uid"

shopt -s nullglob
archives=("$archives_dir"/*.tar)
if ((${#archives[@]} == 0)); then
    echo "prorl-load-images: no image archives in $archives_dir (see deploy/container/save-images.sh)" >&2
    exit 1
fi
cd /
for archive in "${archives[@]}"; do
    echo "prorl-load-images: loading $archive"
    runuser -u "$user" -- env XDG_RUNTIME_DIR="/run/user/$uid" HOME="$home" \
        podman load --quiet --input "$archive"
done
runuser -u "$user" -- env XDG_RUNTIME_DIR="/run/user/$uid" HOME="$home" \
    podman images --format '{{.Repository}}:{{.Tag}}'
