#!/usr/bin/env bash
# The one command of this example: write the per-device .npz files and the test set (first time
# only), then run FedAvg through the real services on this machine: the Fed Server, the Main Server
# and one device agent that hosts a device per file of data/devices/. Extra arguments go to the
# testbed, e.g. ./run.sh --algorithm fedbc.
#   PYTHON=...   the interpreter (default: the repository's .venv, else python3)
#   DATA_DIR=... where the files are (default: data/ next to this script)
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
files=("$data"/devices/*.npz)
exec "$PYTHON" -m testbed --config run.yaml --devices "${#files[@]}" --device-data "$data/devices" \
    --set "data.test_file=$data/test.npz" "$@"
