"""The mutation tool's report (tools/mutation.py): the score is dated by the commit it was taken at,
marked when the mutated modules or their tests differ from that commit."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools" / "mutation.py")
assert _spec is not None and _spec.loader is not None
mutation = importlib.util.module_from_spec(_spec)
sys.modules["mutation_tool"] = mutation   # its dataclasses look their module up there
_spec.loader.exec_module(mutation)


def test_the_commit_is_head_and_says_when_the_files_differ_from_it():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}", head)
    committed = next(p for p in ("README.md", "Makefile", "pyproject.toml")
                     if not subprocess.run(["git", "status", "--porcelain", "--", p], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip())
    assert mutation.tested_commit([committed]) == head
    this = str(Path(__file__).relative_to(ROOT))
    changed = subprocess.run(["git", "status", "--porcelain", "--", this], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    assert mutation.tested_commit([this]) == head + ("+changes" if changed else "")


def test_the_report_names_the_commit_and_every_survivor():
    survivor = mutation.Mutant("m.py", "core/NumberReplacer", 0, 3, "x = 1", "x = 2", "survived")
    killed = mutation.Mutant("m.py", "core/AddNot", 0, 4, "if a:", "if not a:", "killed")
    rows = [mutation.score_row("m.py", [survivor, killed])]
    report = mutation.render(rows, [survivor, killed], 7, 60, "abc123+changes")
    assert "Commit abc123+changes." in report and "seed 7" in report
    assert "| `m.py` | 2 | 1 | 1 | 0 | 50.0 % |" in report
    assert "- `m.py:3` core/NumberReplacer: `x = 1` -> `x = 2`" in report and "if not a:" not in report
