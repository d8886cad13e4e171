#!/usr/bin/env bash
# Podman set up to run this project's containers on a host without a Docker engine (CI here).
# Idempotent; prints the environment lines that the other scripts source (`eval "$(setup.sh)"`).
#
# * Packages: podman, runc, podman-compose, debootstrap (the local base image), the CNI dnsname
#   plugin (without it compose services cannot reach each other by name), slirp4netns, uidmap.
# * Its own containers.conf and storage.conf under $SFL_PODMAN_DIR, selected through
#   CONTAINERS_CONF / CONTAINERS_STORAGE_CONF, so the host's podman settings and images are left
#   alone: runtime runc (crun refuses this kernel's hybrid cgroups), default_ulimits = [] (else
#   setrlimit is refused in a container), storage overlay when the kernel mounts it, else vfs.
set -euo pipefail

SFL_PODMAN_DIR=${SFL_PODMAN_DIR:-/var/tmp/sfl-containers}
mkdir -p "$SFL_PODMAN_DIR"

packages=(podman runc podman-compose debootstrap golang-github-containernetworking-plugin-dnsname
          containernetworking-plugins slirp4netns uidmap fuse-overlayfs iptables)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    echo "installing ${missing[*]}" >&2
    $SUDO apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

conf="$SFL_PODMAN_DIR/containers.conf"
cat > "$conf.new" <<CONF
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "cni"
CONF
mv "$conf.new" "$conf"

# Storage driver: overlay when a test mount works here (kernel overlayfs), else vfs (slow: every
# layer is a full copy). Decided once and remembered, since switching needs a fresh graph root.
storage="$SFL_PODMAN_DIR/storage.conf"
if [ ! -f "$storage" ]; then
    driver=vfs
    probe=$(mktemp -d "$SFL_PODMAN_DIR/probe.XXXX")
    mkdir -p "$probe"/{lower,upper,work,merged}
    if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" 2>/dev/null; then
        umount "$probe/merged"
        driver=overlay
    fi
    rm -rf "$probe"
    cat > "$storage" <<CONF
[storage]
driver = "$driver"
graphroot = "$SFL_PODMAN_DIR/storage"
runroot = "$SFL_PODMAN_DIR/run"
CONF
fi

echo "export SFL_PODMAN_DIR=$SFL_PODMAN_DIR"
echo "export CONTAINERS_CONF=$conf"
echo "export CONTAINERS_STORAGE_CONF=$storage"
