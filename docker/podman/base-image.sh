#!/usr/bin/env bash
# The local stand-in for python:3.11-slim where no image registry can be reached: Debian bookworm
# (python3 3.11, python3-venv, ca-certificates) from Debian's packages with debootstrap, imported
# into podman. Built only when the image is missing. Usage: base-image.sh [IMAGE]
set -euo pipefail
eval "$("$(dirname "$0")/setup.sh")"

IMAGE=${1:-localhost/sfl-base:bookworm-amd64}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$IMAGE"; then
    echo "base image $IMAGE cached" >&2
    exit 0
fi
root=$(mktemp -d "$SFL_PODMAN_DIR/rootfs.XXXX")
trap 'rm -rf "$root"' EXIT
start=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" >&2
# Slim like python:3.11-slim: no apt lists, caches or docs in the image.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/usr/share/doc/* "$root"/usr/share/man/*
# An imported image has no environment: PATH and LANG as python:3.11-slim sets them.
tar -C "$root" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' - "$IMAGE" >&2
echo "base image $IMAGE built in $(( $(date +%s) - start )) s" >&2
