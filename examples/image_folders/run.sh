#!/usr/bin/env bash
# The one command of this example: write the per-device image folders (first time only), then run
# S2FL through the real services (Fed Server, Main Server, one device agent per folder) on this
# machine. Extra arguments go to the testbed, e.g. ./run.sh --rounds 3 --run-dir /tmp/run.
#   PYTHON=...   the interpreter (default: the repository's .venv, else python3)
#   DATA_DIR=... where the device folders are (default: data/ next to this script)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi
data="${DATA_DIR:-$here/data}"
case "$data" in /*) ;; *) data="$PWD/$data" ;; esac
cd "$here"
# model.py must be importable by every service that builds the model (run.yaml: model: model:build).
export PYTHONPATH="$here:$repo${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$data" ] || "$PYTHON" make_data.py --out "$data"
folders=("$data"/device-*)
device_args=()
for folder in "${folders[@]}"; do device_args+=(--device-data "$folder"); done
exec "$PYTHON" -m testbed --config run.yaml --devices "${#folders[@]}" "${device_args[@]}" "$@"
