#!/usr/bin/env bash
# Regression through the real services on this machine, in one command: make_data.py writes the
# devices' .csv files and the test set the first time; then the testbed starts the Fed Server, the
# Main Server and one device agent hosting a device per file of data/devices/ (their number sets
# data.num_devices) and runs S2FL. Extra arguments go to the testbed, e.g. ./run.sh --algorithm fedavg.
#   PYTHON=... and DATA_DIR=... as for every example (../example_env.sh)
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../example_env.sh" "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$PYTHON" -m testbed --config run.yaml --device-data "$data/devices" --set "data.test_file=$data/test.npz" "$@"
