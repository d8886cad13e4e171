#!/usr/bin/env bash
# The one command of this example: write the per-device .npz files and the test set (first time
# only), then run FedAvg through the real services on this machine: the Fed Server, the Main Server
# and one device agent that hosts a device per file of data/devices/. Extra arguments go to the
# testbed, e.g. ./run.sh --algorithm fedbc.
#   PYTHON=...   the interpreter (default: the repository's .venv, else python3)
#   DATA_DIR=... where the files are (default: data/ next to this script)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../example_env.sh
source "$here/../example_env.sh" "$here"
files=("$data"/devices/*.npz)
exec "$PYTHON" -m testbed --config run.yaml --devices "${#files[@]}" --device-data "$data/devices" \
    --set "data.test_file=$data/test.npz" "$@"
