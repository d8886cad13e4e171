"""Import structure of shared/: every module imports on its own (no cycles that only work in one
import order), and the config schema stays below the algorithms."""
from __future__ import annotations

import ast
import json
import os
import shutil
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


# --- the algorithm registry ---------------------------------------------------------------------

ALGORITHM_MODULES = sorted((ROOT / "shared" / "algorithms").glob("*.py"))
#: What building FedAvg needs: its module, the interfaces and the default aggregation rule's.
FEDAVG_NEEDS = {"shared.algorithms", "shared.algorithms.aggregation", "shared.algorithms.base",
                "shared.algorithms.fedavg", "shared.algorithms.plugin_params", "shared.algorithms.plugin_table",
                "shared.algorithms.registry", "shared.algorithms.robust_aggregation"}


def test_building_an_algorithm_imports_no_other_plug_in():
    loaded = _loaded_after("from shared.algorithms.fedavg import FedAvg\nfrom shared.config import RunConfig\n"
                           "FedAvg(RunConfig())")
    assert {name for name in loaded if name.startswith("shared.algorithms")} == FEDAVG_NEEDS


def test_the_registry_imports_none_of_the_algorithms_it_lists():
    loaded = _loaded_after("import shared.algorithms.registry")
    assert "shared.algorithms.base" not in loaded and "shared.algorithms.fedavg" not in loaded


@pytest.mark.parametrize("first", ["import shared.algorithms.random_grouping",
                                   "import shared.algorithms.registry"])
def test_a_listed_plug_in_that_imports_the_registry_at_module_level_loads(tmp_path, first):
    # The shipped package with one listed plug-in (the random grouping) importing the registry at
    # the top, as a plug-in that builds another grouping would; imported first, or the registry first.
    shutil.copytree(ROOT / "shared", tmp_path / "shared", ignore=shutil.ignore_patterns("__pycache__"))
    plug_in = tmp_path / "shared" / "algorithms" / "random_grouping.py"
    source = plug_in.read_text()
    head, sep, rest = source.partition("from __future__ import annotations\n")
    plug_in.write_text(head + sep + "from shared.algorithms.registry import GROUPINGS, build_grouping\n" + rest)
    code = f"{first}\nfrom shared.algorithms.registry import build_grouping\nprint(type(build_grouping('random')).__name__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["RandomGrouping"]


@pytest.mark.parametrize("path", ALGORITHM_MODULES, ids=lambda path: path.name)
def test_no_function_local_import_of_the_registry_or_the_interfaces(path):
    # Such an import closes an import cycle at call time, where nothing checks it.
    local = [node for function in ast.walk(ast.parse(path.read_text()))
             if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(function) if isinstance(node, ast.ImportFrom)
             and node.module in ("shared.algorithms.registry", "shared.algorithms.base")]
    assert [f"line {node.lineno}: from {node.module} import ..." for node in local] == []
