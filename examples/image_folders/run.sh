#!/usr/bin/env bash
# The one command of this example: write the per-device image folders (first time only), then run
# S2FL through the real services (Fed Server, Main Server, one device agent per folder) on this
# machine. Extra arguments go to the testbed, e.g. ./run.sh --rounds 3 --run-dir /tmp/run.
#   PYTHON=...   the interpreter (default: the repository's .venv, else python3)
#   DATA_DIR=... where the device folders are (default: data/ next to this script)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../example_env.sh
source "$here/../example_env.sh" "$here"
folders=("$data"/device-*)
device_args=()
for folder in "${folders[@]}"; do device_args+=(--device-data "$folder"); done
exec "$PYTHON" -m testbed --config run.yaml --devices "${#folders[@]}" "${device_args[@]}" "$@"
