"""The extension guide tells the truth: its code is the shipped code, its plug-in lists the registries'."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from shared.algorithms.registry import GROUP_LOSSES, GROUPINGS

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
    assert {path for path, _ in blocks} >= {"shared/algorithms/fedprox.py", "shared/algorithms/split_point_grouping.py"}
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
