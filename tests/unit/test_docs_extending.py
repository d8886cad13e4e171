"""The extension guide tells the truth: its code is the shipped code, its hook table every hook of
the algorithm interfaces, and every list of plug-ins in the docs is the registry's."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from shared.algorithms.base import Algorithm, DeviceLogic
from shared.algorithms.registry import ALGORITHMS, GROUP_LOSSES, GROUPINGS

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_BLOCK = re.compile(r"<!-- shipped: (\S+) -->\n```python\n(.*?)```", re.S)


def _without_docstrings(node: ast.AST) -> str:
    """``node`` as ast.dump, every docstring left out (the guide shows code, the module documents it)."""
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            child.body = body[1:] or [ast.Pass()]
    return ast.dump(node)


def test_every_class_the_guide_shows_is_the_shipped_one():
    blocks = SHIPPED_BLOCK.findall((ROOT / "docs" / "extending.md").read_text())
    assert {path for path, _ in blocks} >= {"shared/algorithms/fedprox.py", "shared/algorithms/scaffold.py",
                                            "shared/algorithms/split_point_grouping.py"}
    for path, code in blocks:
        shipped = {n.name: n for n in ast.parse((ROOT / path).read_text()).body if isinstance(n, ast.ClassDef)}
        shown = ast.parse(code).body
        assert shown and all(isinstance(n, ast.ClassDef) for n in shown), f"{path}: the guide shows only classes"
        for cls in shown:
            assert cls.name in shipped, f"{path} has no class {cls.name}"
            assert _without_docstrings(cls) == _without_docstrings(shipped[cls.name]), \
                f"docs/extending.md's {cls.name} is not the one in {path}"


def _names_in_row(page: str, key: str) -> set[str]:
    """The backquoted names in the second column of ``page``'s table row for ``key``."""
    row = next(line for line in (ROOT / "docs" / page).read_text().splitlines() if line.startswith(f"| `{key}` |"))
    return set(re.findall(r"`([a-z_]+)`", row.split(" | ")[1]))


def test_the_plug_in_lists_are_the_registries():
    assert _names_in_row("configuration.md", "grouping.method") == set(GROUPINGS)
    registered = next(line for line in (ROOT / "docs" / "s2fl.md").read_text().splitlines()
                      if line.startswith("| `GROUPINGS` |")).split(" | ")[-1]
    assert set(re.findall(r"`([a-z_]+)` \(", registered)) == set(GROUPINGS)
    losses = next(line for line in (ROOT / "docs" / "s2fl.md").read_text().splitlines()
                  if line.startswith("| `GROUP_LOSSES` |")).split(" | ")[-1]
    assert set(re.findall(r"`([a-z_]+)`", losses)) == set(GROUP_LOSSES)


def _section(page: str, heading: str) -> list[str]:
    """The lines of ``page`` under ``heading`` up to the next heading of any level."""
    lines = (ROOT / page).read_text().splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return lines[start:end]


def _first_column_names(rows: list[str]) -> set[str]:
    """The backquoted names in the first cell of each table row (not of the header row)."""
    body = [row for row, after in zip(rows, [*rows[1:], ""]) if row.startswith("| `") and not after.startswith("|---")]
    return {name for row in body for name in re.findall(r"`([a-z0-9-]+)`", row.split(" | ")[0])}


def test_the_hook_table_names_every_public_hook_of_the_two_interfaces():
    table = _section("docs/extending.md", "## The algorithm hooks")
    shown = {name for row in table if row.startswith("| `")
             for name in re.findall(r"`([A-Za-z_]+)[(`]", row.split(" | ")[0])}
    public = {name for cls in (Algorithm, DeviceLogic) for name in vars(cls) if not name.startswith("_")}
    assert public - shown == set(), "hooks missing from docs/extending.md's table"
    assert "__init__" in shown   # where an algorithm refuses what it cannot run


def test_every_list_of_algorithms_in_the_docs_is_the_registry_s():
    registered = set(ALGORITHMS)
    assert _first_column_names(_section("README.md", "## Algorithms")) == registered
    assert _first_column_names(_section("docs/configuration.md", "### Algorithms and selection policies")) == registered
    key = next(line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
               if line.startswith("| `algorithm` |"))
    assert set(re.findall(r"`([a-z0-9-]+)`", key.split("registry.py`:")[1].split("(see")[0])) == registered
    # The regression lists: every algorithm that needs no class labels.
    label_free = {name for name, algorithm in ALGORITHMS.items() if algorithm.needs_classes is None}
    task = next(line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
                if line.startswith("| `train.task` |"))
    assert set(re.findall(r"`([a-z0-9-]+)`", task.split("needs no class labels (")[1].split(")")[0])) == label_free
    models = next(line for line in (ROOT / "docs" / "models.md").read_text().splitlines()
                  if line.startswith("- **Algorithms.**"))
    assert set(re.findall(r"`([a-z0-9-]+)`", models.split("run unchanged")[0])) == label_free
