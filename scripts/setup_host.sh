#!/usr/bin/env bash
# Prepare this machine for rootless Podman sandboxes (Debian 12, run as root).
#
# Idempotent: safe to run again. Creates the unprivileged sandbox user, its
# subordinate id ranges, its runtime directory and the containers.conf
# settings this kernel needs (see docs/operations.md for why each is there).
set -euo pipefail

SANDBOX_USER="${PRORL_SANDBOX_USER:-prorl}"
APT_PACKAGES=(podman runc debootstrap uidmap slirp4netns fuse-overlayfs catatonit)
# git: the SWE images' repositories are committed on the host (sandbox_images/swe).
APT_PACKAGES+=(git)
# The project's virtual environment (Debian's python3 refuses pip installs) and the headers
# llama-cpp-python builds against. PRORL_SETUP=demo (make demo) stops there: only what the
# demo needs; the default (make setup) adds the CI toolchain below.
APT_PACKAGES+=(python3-venv python3-dev)
if [[ "${PRORL_SETUP:-full}" != demo ]]; then
    # The Go and C++ example clients (examples/), built from proto/ offline.
    APT_PACKAGES+=(golang-go protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev golang-google-protobuf-dev
                   protobuf-compiler protobuf-compiler-grpc libgrpc++-dev g++ pkg-config openssl)

    # chromium: the viewer's browser test.
    APT_PACKAGES+=(chromium)

    # The PostgreSQL job store's tests (marker `postgres`) start a throwaway cluster of their
    # own with these server binaries (tests/postgres.py); the system cluster this package
    # starts is not used by them.
    APT_PACKAGES+=(postgresql)
    # deploy/: a single-node Slurm of the tests' own runs the sbatch script (munge comes with it); shellcheck checks the scripts.
    APT_PACKAGES+=(slurm-wlm shellcheck)

    # npx runs buf (the contract's linter) from the npm registry.
    command -v npx >/dev/null 2>&1 || APT_PACKAGES+=(npm)
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup-host: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! id "$SANDBOX_USER" >/dev/null 2>&1; then
    echo "setup-host: creating user $SANDBOX_USER"
    useradd --create-home --shell /usr/sbin/nologin "$SANDBOX_USER"
fi
uid="$(id -u "$SANDBOX_USER")"
home="$(getent passwd "$SANDBOX_USER" | cut -d: -f6)"

# Subordinate ids: 65536 of them, so images with their own users map cleanly.
for file in /etc/subuid /etc/subgid; do
    touch "$file"
    if ! grep -q "^${SANDBOX_USER}:" "$file"; then
        start=$(( (uid - 900) * 65536 + 100000 ))
        ((start < 100000)) && start=100000
        echo "${SANDBOX_USER}:${start}:65536" >> "$file"
    fi
done

runtime_dir="/run/user/${uid}"
install -d -m 0700 -o "$SANDBOX_USER" -g "$SANDBOX_USER" "$runtime_dir"

conf_dir="${home}/.config/containers"
install -d -m 0755 -o "$SANDBOX_USER" -g "$SANDBOX_USER" "${home}/.config" "$conf_dir"
cat > "${conf_dir}/containers.conf" <<CONF
# Written by prorl scripts/setup_host.sh.
[containers]
# The host's hard nofile limit is below Podman's default of 1048576. nproc counts the
# processes of all sandboxes together (they share one host uid): 1,000 idle ones are 3,000.
default_ulimits = ["nofile=1024:1024", "nproc=16384:16384"]
# No systemd user session here: no journald, no systemd cgroup manager.
log_driver = "k8s-file"
# runc gives every container a kernel session keyring under the sandbox user's uid;
# the kernel's per-user key quota (kernel.keys.maxkeys, 200 by default) then fails
# container starts ("unable to create session key: disk quota exceeded") once that
# many run at once. Sandboxes have no use for a keyring.
keyring = false

[engine]
# crun 1.8 refuses this kernel's hybrid cgroup layout; runc accepts it.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
cat > "${conf_dir}/storage.conf" <<CONF
# Written by prorl scripts/setup_host.sh.
[storage]
driver = "overlay"
CONF
chown "$SANDBOX_USER:$SANDBOX_USER" "${conf_dir}/containers.conf" "${conf_dir}/storage.conf"

# Folder for files bind-mounted into sandboxes: readable by the sandbox user.
install -d -m 0755 -o "$SANDBOX_USER" -g "$SANDBOX_USER" /var/lib/prorl

echo "setup-host: user=$SANDBOX_USER uid=$uid runtime_dir=$runtime_dir podman=$(podman --version)"
