# Sourced by each example's run.sh with its own folder as $1: picks the interpreter, the data folder
# and the import path, and writes the example's data the first time (make_data.py --out DATA).
#   PYTHON=...   the interpreter (default: the repository's .venv, else python3)
#   DATA_DIR=... where the data are (default: data/ next to the example's run.sh)
# Leaves $here, $repo, $data and $PYTHON set, and the working directory at the example's folder.
here="$1"
repo="$(cd "$here/../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi
data="${DATA_DIR:-$here/data}"
case "$data" in /*) ;; *) data="$PWD/$data" ;; esac
cd "$here"
# model.py must be importable by every service that builds the model (run.yaml: model: model:build),
# and make_data.py imports the project.
export PYTHONPATH="$here:$repo${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$data" ] || "$PYTHON" make_data.py --out "$data"
