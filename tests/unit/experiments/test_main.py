"""``python -m experiments run`` hands its flags to the grid runner."""
from __future__ import annotations

import experiments.__main__ as cli

TINY = """
name: tiny
base: {rounds: 1}
axes:
  algorithm: [fedavg]
"""


class FakeStarter:
    """Stands in for the warm starter: the flag's effect is which starter the runner gets."""


def _run_capturing(monkeypatch, tmp_path, *flags: str) -> dict:
    seen: dict = {}

    def fake_grid(spec, cells, out, spec_text, **kwargs):
        seen.update(kwargs, cells=len(cells))
        return []

    monkeypatch.setattr(cli, "run_grid", fake_grid)
    monkeypatch.setattr(cli, "WarmStarter", FakeStarter)
    monkeypatch.setattr(cli, "render_report", lambda *args: tmp_path / "report.md")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    cli.main(["run", str(spec), "--out", str(tmp_path / "out"), *flags])
    return seen


def test_log_level_and_warm_start_reach_the_grid_runner(monkeypatch, tmp_path):
    seen = _run_capturing(monkeypatch, tmp_path, "--log-level", "INFO", "--warm-start")
    assert seen["cells"] == 1 and seen["log_level"] == "INFO" and isinstance(seen["warm"], FakeStarter)


def test_by_default_cells_start_with_exec_and_log_warnings(monkeypatch, tmp_path):
    seen = _run_capturing(monkeypatch, tmp_path)
    assert seen["log_level"] == "WARNING" and seen["warm"] is None
