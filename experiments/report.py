"""The rendered report of a grid: ``report.md`` with tables of the results and the PNG plots."""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.plots import write_plots
from experiments.results import CellResult, write_results
from experiments.spec import ExperimentSpec

_PLOT_TITLES = {
    "accuracy_vs_round": "Test accuracy vs round",
    "accuracy_vs_time": "Test accuracy vs wall-clock time",
    "accuracy_vs_bytes": "Test accuracy vs bytes moved",
    "device_round_times": "Per-device round time by device kind and split point",
}


def _pct(mean: Any, std: Any) -> str:
    """A fraction as a percentage (mean ± std)."""
    return _num(None if mean is None else 100 * mean, 100 * std if std else std, digits=2)


def _num(mean: Any, std: Any, scale: float = 1.0, digits: int = 1) -> str:
    if mean is None:
        return "—"
    text = f"{mean / scale:.{digits}f}"
    return f"{text} ± {std / scale:.{digits}f}" if std else text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def summary_table(summary: Sequence[dict], spec: ExperimentSpec) -> list[str]:
    """Headline figures per grid point: accuracy (final, last-k, best), round time, totals."""
    keys = [a for a in spec.axes if a != spec.repeat_axis]
    last = f"last{spec.report.last_k}_accuracy"
    header = keys + ["n", "final acc (%)", f"mean of last {spec.report.last_k} (%)", "best acc (%)",
                     "median round (s)", "total time (s)", "MB moved"]
    header += spec.report.metrics
    rows = []
    for s in summary:
        row = [str(s[k]) for k in keys] + [f"{s['n']}/{s['cells']}"]
        row += [_pct(s.get("final_accuracy_mean"), s.get("final_accuracy_std")),
                _pct(s.get(f"{last}_mean"), s.get(f"{last}_std")),
                _pct(s.get("best_accuracy_mean"), s.get("best_accuracy_std")),
                _num(s.get("median_round_time_s_mean"), s.get("median_round_time_s_std"), digits=2),
                _num(s.get("total_time_s_mean"), s.get("total_time_s_std")),
                _num(s.get("total_bytes_mean"), s.get("total_bytes_std"), scale=1e6, digits=0)]
        row += [_num(s.get(f"{m}_mean"), s.get(f"{m}_std"), digits=4) for m in spec.report.metrics]
        rows.append(row)
    return _table(header, rows)


def target_table(summary: Sequence[dict], spec: ExperimentSpec) -> list[str]:
    """Rounds, wall time and bytes to each target accuracy (mean over the cells that reached it)."""
    keys = [a for a in spec.axes if a != spec.repeat_axis]
    header = keys + ["target", "reached", "rounds", "time (s)", "MB moved"]
    rows = []
    for target in spec.targets:
        t = f"{round(100 * target):g}"
        for s in summary:
            n = s.get(f"time_to_{t}_s_n", 0)
            rows.append([str(s[k]) for k in keys] + [f"{t}%", f"{n}/{s['n']}",
                        _num(s.get(f"rounds_to_{t}_mean"), s.get(f"rounds_to_{t}_std")),
                        _num(s.get(f"time_to_{t}_s_mean"), s.get(f"time_to_{t}_s_std")),
                        _num(s.get(f"bytes_to_{t}_mean"), s.get(f"bytes_to_{t}_std"), scale=1e6, digits=0)])
    return _table(header, rows)


def _machine_line(out: Path) -> str:
    try:
        m = json.loads((out / "machine.json").read_text())
    except (OSError, ValueError):
        return "unknown (no machine.json)"
    return (f"{m.get('cpu_model')}, {m.get('cpus_usable')} usable cores, {m.get('memory_gib')} GiB, "
            f"{m.get('platform')}, Python {m.get('python')}, torch {m.get('torch')}; "
            f"load average at the start {m.get('load_average_at_start')}; first cell started {m.get('date_utc')}")


def _machines_of_cells(results: Sequence[CellResult]) -> list[str]:
    """A line naming each machine the finished cells ran on, when there was more than one.

    Float results differ between CPUs, so a reader comparing two cells bit for bit (FedAvg vs
    SFL, say) needs to know whether they shared a machine; results.csv names each cell's.
    """
    unrecorded = "not recorded (cells older than per-cell records; machine.json names the first cells' machine)"
    counts = Counter(r.machine or unrecorded for r in results if r.status == "finished")
    if len(counts) < 2:
        return []
    listed = "; ".join(f"{name}: {n} cell{'s' if n != 1 else ''}" for name, n in counts.items())
    return [f"- Cells ran on more than one machine (`results.csv` names each cell's): {listed}."]


def render_report(results: Sequence[CellResult], spec: ExperimentSpec, out: Path, command: str) -> Path:
    """Write results.csv/json, summary.csv, the plots and report.md into ``out``; returns report.md."""
    rows, summary = write_results(results, spec, out)
    plots = write_plots(results, spec, out)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [f"# Experiment `{spec.name}`", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    lines += [
        f"- Command: `{command}`",
        f"- Machine: {_machine_line(out)}",
        *_machines_of_cells(results),
        f"- Cells: {len(results)} ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}); every cell is "
        "one run of the Fed Server, the Main Server and the device agents as separate processes on loopback.",
        f"- Axes: {'; '.join(f'`{a}` = ' + ', '.join(labels) for a, labels in spec.axes.items())}.",
    ]
    if spec.repeat_axis:
        lines.append(f"- Figures are mean ± sample standard deviation over `{spec.repeat_axis}`; "
                     "`n` counts the finished cells.")
    lines += ["- Files: `results.csv` / `results.json` (one row per cell), `summary.csv` (aggregated), "
              "`cells/<cell>/` (each run's config, `metrics.jsonl` and `summary.json`).", "",
              "## Results", ""]
    lines += summary_table(summary, spec)
    if spec.targets:
        lines += ["", "## Time and bytes to target accuracy", "",
                  "The first completed round at or above the target. `reached` counts the cells that got "
                  "there; the averages cover those cells only.", ""]
        lines += target_table(summary, spec)
    for name, path in plots.items():
        lines += ["", f"## {_PLOT_TITLES[name]}", "", f"![{_PLOT_TITLES[name]}]({path.name})"]
    if "device_round_times" in plots:
        lines += ["", "Bars average every (device, round) pair of the finished cells, the number above "
                  "each bar; a device's round time runs from receiving its task to sending its upload, "
                  "with the emulated compute stretch and transfer delays of its kind included."]
    failed = [r for r in results if r.status == "failed"]
    if failed:
        lines += ["", "## Failed cells", ""]
        lines += [f"- `{r.cell.cell_id}`: {(r.error or '').splitlines()[0] if r.error else 'no error recorded'}"
                  for r in failed]
    missing = [r for r in results if r.status not in ("finished", "failed")]
    if missing:
        lines += ["", "## Cells without results", ""]
        lines += [f"- `{r.cell.cell_id}`: {r.status}" for r in missing]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
