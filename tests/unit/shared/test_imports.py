"""Import structure of shared/: every module imports on its own (no cycles that only work in one
import order), and the config schema stays below the algorithms."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SHARED_MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for path in (ROOT / "shared").rglob("*.py")
)


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the repository first on the path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_module_list_is_not_empty():
    assert {"shared.config", "shared.data.spec", "shared.data.device_transforms", "shared.run_config"} \
        <= set(SHARED_MODULES)


# One interpreter loads the third-party libraries once, then forks a child per module that
# imports only that module: each child starts with none of the project's modules loaded, as a
# fresh interpreter would (cycles are among the project's modules), at a fraction of the cost of
# one interpreter and one torch import per module.
_FORK_EACH = """
import importlib, json, os, sys, traceback
import torch, numpy, pydantic, msgpack, yaml, httpx, prometheus_client
assert not [m for m in sys.modules if m.split('.')[0] == 'shared']
results = {}
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = ''
        except BaseException:
            message = traceback.format_exc()
        os.write(write, message.encode() or b'ok')
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    out = b''.join(chunks).decode()
    results[name] = None if out == 'ok' else (out or 'the child died')
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def isolated_imports() -> dict[str, str | None]:
    """Each shared/ module imported alone: module -> None, or the traceback of its failure."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", _FORK_EACH, json.dumps(SHARED_MODULES)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", SHARED_MODULES)
def test_module_imports_alone(module, isolated_imports):
    assert isolated_imports[module] is None, isolated_imports[module]


def _loaded_after(code: str) -> list[str]:
    result = _run(f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_config_schema_does_not_import_the_algorithms():
    # Building and dumping a config runs every validator of the schema, lazy imports included.
    loaded = _loaded_after("from shared.config import RunConfig\nRunConfig().model_dump()")
    assert "shared.config" in loaded
    assert [name for name in loaded if name.startswith("shared.algorithms")] == []


def test_data_spec_does_not_import_the_transforms():
    loaded = _loaded_after("from shared.data.spec import DataSpec\n"
                           "DataSpec(device_transform='rotation', device_transform_params={'angles': [0, 30]})")
    # (shared/data/__init__.py imports the dataset code, which needs the spec; the reverse must not happen.)
    assert "shared.data.spec" in loaded and "shared.data.device_transforms" not in loaded


def test_full_loading_does_import_them():
    # The positive control: the same probe sees the algorithms once the full loader is used.
    loaded = _loaded_after("from shared.run_config import load_run_config\nload_run_config({})")
    assert "shared.algorithms.registry" in loaded and "shared.data.device_transforms" in loaded
