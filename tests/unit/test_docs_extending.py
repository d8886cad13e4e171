"""The extension guide tells the truth: its code is the shipped code, its hook table every hook of
the algorithm interfaces, and every list of plug-in names in the docs is the registry's (or, for a
list of the plug-ins with some property, the registry's plug-ins with that property), on a page
the guide's checklist names."""
from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.algorithms import registry
from shared.algorithms.plugin_table import PluginTable
from shared.algorithms.registry import (
    AGGREGATION_RULES, ALGORITHMS, GROUP_LOSSES, GROUPINGS, PRIVACY_DEFENCES, SELECTORS,
)
from shared.algorithms.two_phase import two_phase
from shared.config import RunConfig
from shared.run_config import ConfigError, load_run_config
from shared.algorithms.base import Algorithm, DeviceLogic

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_BLOCK = re.compile(r"<!-- shipped: (\S+) -->\n```python\n(.*?)```", re.S)
#: A plug-in name as the docs quote it: `name` or `"name"` (dotted keys and paths are not names).
NAME = re.compile(r'`"?([a-z][a-z0-9_-]*)"?`')


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
                                            "shared/algorithms/split_point_grouping.py", "shared/algorithms/speed_grouping.py"}
    for path, code in blocks:
        shipped = {n.name: n for n in ast.parse((ROOT / path).read_text()).body if isinstance(n, ast.ClassDef)}
        shown = ast.parse(code).body
        assert shown and all(isinstance(n, ast.ClassDef) for n in shown), f"{path}: the guide shows only classes"
        for cls in shown:
            assert cls.name in shipped, f"{path} has no class {cls.name}"
            assert _without_docstrings(cls) == _without_docstrings(shipped[cls.name]), \
                f"docs/extending.md's {cls.name} is not the one in {path}"


# --- the docs' lists of plug-in names -------------------------------------------------------------

def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _names(text: str) -> set[str]:
    return set(NAME.findall(text))


def _row(page: str, key: str) -> list[str]:
    """The cells of ``page``'s table row whose first cell is ```key```."""
    row = next(line for line in _text(page).splitlines() if line.startswith(f"| `{key}` |"))
    return [cell.strip() for cell in row.strip("|").split(" | ")]


def _cells(page: str, header: str, column: int = 0) -> list[str]:
    """One column of the table of ``page`` whose header row starts with ``header``."""
    lines = _text(page).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2   # past the --- row
    cells = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells.append(line.strip("|").split(" | ")[column].strip())
    return cells


def _column(page: str, header: str, column: int = 0) -> set[str]:
    """The names in one column of a table (:func:`_cells`)."""
    return _names(" ".join(_cells(page, header, column)))


def _paragraph(page: str, marker: str) -> str:
    """The paragraph (blank line to blank line) of ``page`` that holds ``marker``, on one line."""
    return " ".join(next(p for p in _text(page).split("\n\n") if marker in p).split())


def _between(page: str, marker: str, start: str, end: str) -> set[str]:
    """The names between ``start`` and the next ``end`` in the paragraph holding ``marker``."""
    text = _paragraph(page, marker)
    return _names(text[text.index(start) + len(start):].split(end, 1)[0])


def _split_mode(name: str) -> str:
    return ALGORITHMS[name](RunConfig(algorithm=name, data={"public_samples": 100})).split_mode()


def _where(table: PluginTable, holds: Callable[[str], bool]) -> set[str]:
    return {name for name in table if holds(name)}


@dataclass(frozen=True)
class DocList:
    """A list in the docs: its page, the kind of plug-in the checklist files it under, how to read
    its names, and the names it must hold."""

    page: str
    kind: str
    what: str
    names: Callable[[], set[str]]
    expected: Callable[[], set[str]]


ZERO = lambda: _where(ALGORITHMS, lambda n: _split_mode(n) == "zero")  # noqa: E731
NEED_CLASSES = lambda: _where(ALGORITHMS, lambda n: ALGORITHMS[n].needs_classes is not None)  # noqa: E731

DOC_LISTS = [
    DocList("README.md", "algorithm", "the Algorithms table", lambda: _column("README.md", "| name | what |"),
            lambda: set(ALGORITHMS)),
    DocList("docs/configuration.md", "algorithm", "the `algorithm` key",
            lambda: _names(_row("docs/configuration.md", "algorithm")[3]), lambda: set(ALGORITHMS)),
    DocList("docs/configuration.md", "algorithm", "the Algorithms and selection policies table",
            lambda: _column("docs/configuration.md", "| `algorithm` | split |"), lambda: set(ALGORITHMS)),
    DocList("docs/configuration.md", "algorithm", "the algorithms without parameters",
            lambda: _between("docs/configuration.md", "the algorithm's own hyperparameters", "errors).", "take none"),
            lambda: _where(ALGORITHMS, lambda n: not ALGORITHMS[n].Params.model_fields)),
    DocList("docs/configuration.md", "algorithm", "the algorithms with S2FL's two mechanisms",
            lambda: _between("docs/configuration.md", "switch the two S2FL", "mechanisms for", "only"),
            lambda: set(ALGORITHMS) - ZERO()),
    DocList("docs/configuration.md", "algorithm", "which algorithms use the aggregation rule",
            lambda: _names(_paragraph("docs/configuration.md", "**Which algorithms use it.**")) & set(ALGORITHMS),
            lambda: set(ALGORITHMS)),
    DocList("docs/models.md", "algorithm", "the split-depth-zero algorithms a model without split points runs",
            lambda: _between("docs/models.md", "`split_points=[]`", "split-depth-zero algorithms (", ")"), ZERO),
    DocList("docs/models.md", "algorithm", "the algorithms a regression run refuses",
            lambda: _between("docs/models.md", "run unchanged", "classification.", "need class labels"),
            NEED_CLASSES),
    DocList("docs/models.md", "algorithm", "the algorithms a regression run takes",
            lambda: _between("docs/models.md", "run unchanged", "**Algorithms.**", "run unchanged"),
            lambda: set(ALGORITHMS) - NEED_CLASSES()),
    DocList("docs/api.md", "algorithm", "the round of the split modes",
            lambda: _between("docs/api.md", "### One round, split mode", "split mode (", ")"),
            lambda: set(ALGORITHMS) - ZERO()),
    DocList("docs/api.md", "algorithm", "the round of split depth zero",
            lambda: _between("docs/api.md", "### One round, split depth zero", "split depth zero (", ")"), ZERO),
    DocList("README.md", "selection policy", "the selection sentence",
            lambda: _names(_paragraph("README.md", "Device selection is a separate policy")), lambda: set(SELECTORS)),
    DocList("docs/configuration.md", "selection policy", "the `selection` key",
            lambda: _names(_row("docs/configuration.md", "selection")[3]), lambda: set(SELECTORS)),
    DocList("docs/configuration.md", "selection policy", "the selection policies sentence",
            lambda: _between("docs/configuration.md", "Selection policies:", "Selection policies:", "("),
            lambda: set(SELECTORS)),
    DocList("docs/models.md", "selection policy", "the selection policies a regression run refuses",
            lambda: set(re.findall(r"`selection: ([a-z_-]+)`", _paragraph("docs/models.md", "run unchanged"))),
            lambda: _where(SELECTORS, lambda n: SELECTORS[n].needs_classes is not None)),
    DocList("docs/configuration.md", "aggregation rule", "the `aggregation.rule` key",
            lambda: _names(_row("docs/configuration.md", "aggregation.rule")[3]), lambda: set(AGGREGATION_RULES)),
    DocList("docs/configuration.md", "aggregation rule", "the table of rules",
            lambda: _column("docs/configuration.md", "| rule | params besides the bounds |"),
            lambda: set(AGGREGATION_RULES)),
    DocList("docs/s2fl.md", "aggregation rule", "the rules beside Algorithm 1",
            lambda: _names(_paragraph("docs/s2fl.md", "Algorithm 1 as written is the aggregation rule")),
            lambda: set(AGGREGATION_RULES)),
    DocList("docs/security.md", "aggregation rule", "the default rule and its alternatives",
            lambda: _names(_paragraph("docs/security.md", "The default aggregation rule, ")),
            lambda: set(AGGREGATION_RULES)),
    DocList("docs/configuration.md", "grouping", "the `grouping.method` key",
            lambda: _names(_row("docs/configuration.md", "grouping.method")[1]), lambda: set(GROUPINGS)),
    DocList("docs/s2fl.md", "grouping", "the split-learning registries",
            lambda: _names(_row("docs/s2fl.md", "GROUPINGS")[2]), lambda: set(GROUPINGS)),
    DocList("docs/api.md", "grouping", "the round plan's `grouping`",
            lambda: _names(_row("docs/api.md", "grouping")[1]), lambda: set(GROUPINGS)),
    DocList("docs/configuration.md", "group loss", "the `grouping.group_loss` key",
            lambda: _names(_row("docs/configuration.md", "grouping.group_loss")[1]), lambda: set(GROUP_LOSSES)),
    DocList("docs/s2fl.md", "group loss", "the split-learning registries",
            lambda: _names(_row("docs/s2fl.md", "GROUP_LOSSES")[2]), lambda: set(GROUP_LOSSES)),
    DocList("docs/api.md", "group loss", "the round plan's `group_loss`",
            lambda: _names(_row("docs/api.md", "group_loss")[1]), lambda: set(GROUP_LOSSES)),
    DocList("docs/configuration.md", "privacy defence", "the `split_privacy.defences` key",
            lambda: _names(_row("docs/configuration.md", "split_privacy.defences")[1]), lambda: set(PRIVACY_DEFENCES)),
    DocList("docs/split-privacy.md", "privacy defence", "the table of defences",
            lambda: {NAME.findall(cell)[0] for cell in _cells("docs/split-privacy.md", "| name | what it does |")},
            lambda: set(PRIVACY_DEFENCES)),
]


@pytest.mark.parametrize("doc", DOC_LISTS, ids=lambda doc: f"{doc.page}: {doc.what}")
def test_each_list_in_the_docs_is_the_registrys(doc):
    assert doc.names() == doc.expected(), f"{doc.page}, {doc.what}: fix the list (docs/extending.md, Checklist)"


def test_the_guide_names_every_registry_table():
    tables = {name for name, value in vars(registry).items() if isinstance(value, PluginTable)}
    assert set(re.findall(r"`([A-Z_]+)`", " ".join(_cells("docs/extending.md", "| to add |", 2)))) == tables


def test_the_error_the_configuration_page_shows_is_the_loaders():
    line = next(line for line in _text("docs/configuration.md").splitlines()
                if line.startswith("config error: unknown algorithm "))
    name = re.search(r"unknown algorithm '([^']+)'", line).group(1)
    with pytest.raises(ConfigError) as refused:
        load_run_config({"algorithm": name})
    assert [f"config error: {problem}" for problem in refused.value.lines] == [line]


def test_the_checklist_names_every_page_a_list_is_on():
    kinds = _cells("docs/extending.md", "| a new |")
    pages = _cells("docs/extending.md", "| a new |", 1)
    for doc in DOC_LISTS:
        row = next(where for kind, where in zip(kinds, pages) if kind.endswith(doc.kind))
        assert f"]({Path(doc.page).name}" in row or f"](../{doc.page}" in row, \
            f"the checklist's row for {doc.kind} does not link {doc.page}"


def test_the_algorithms_table_says_each_ones_split_mode_and_whether_it_reports():
    rows = zip(_cells("docs/configuration.md", "| `algorithm` | split |"),
               _cells("docs/configuration.md", "| `algorithm` | split |", 1),
               _cells("docs/configuration.md", "| `algorithm` | split |", 3))
    for name, split, reports in rows:
        name = name.strip("`")
        assert re.split(r"\W", split)[0] == _split_mode(name), name
        assert reports.startswith("yes" if two_phase(ALGORITHMS[name]) is not None else "no"), name


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
