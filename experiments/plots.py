"""PNG plots of a grid's results (matplotlib, headless): one line per series value, mean over repeats.

Each figure has one panel per combination of the remaining axes (e.g. one per partition), so a
figure answers one question across the whole grid.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from shared.data import dataset_input_shape, dataset_num_classes  # noqa: E402
from shared.models import build_model  # noqa: E402

from experiments.results import CellResult  # noqa: E402
from fed_server.records import RoundRecord  # noqa: E402
from experiments.spec import ExperimentSpec  # noqa: E402

XY = Callable[[RoundRecord], "tuple[float, float] | None"]   # None: the round has no point (no accuracy)


def _panels(results: Sequence[CellResult], spec: ExperimentSpec) -> dict[str, dict[str, list[CellResult]]]:
    """panel title -> series label -> cells (the repeats), finished cells with rounds only."""
    skip = {*spec.series_axes, spec.repeat_axis}
    panel_axes = [a for a in spec.axes if a not in skip]
    panels: dict[str, dict[str, list[CellResult]]] = {}
    for r in results:
        if r.status != "finished" or not r.rounds:
            continue
        title = ", ".join(f"{a}={r.cell.labels[a]}" for a in panel_axes) or spec.name
        panels.setdefault(title, {}).setdefault(spec.series_label(r.cell.labels), []).append(r)
    return panels


def _grid(n: int) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _mean_curve(cells: list[CellResult], xy: XY) -> tuple[list[float], list[float], list[float]]:
    """Mean x, mean y and std y per round index over the repeats (up to the shortest run); a round
    index where some repeat has no point is left out."""
    length = min(len(c.rounds) for c in cells)
    xs, ys, sds = [], [], []
    for i in range(length):
        points = [p for c in cells if (p := xy(c.rounds[i])) is not None]
        if len(points) < len(cells):   # a round without an accuracy (federated, nobody reported)
            continue
        xs.append(statistics.fmean(p[0] for p in points))
        ys.append(statistics.fmean(p[1] for p in points))
        sds.append(statistics.stdev([p[1] for p in points]) if len(points) > 1 else 0.0)
    return xs, ys, sds


def curve_figure(results: Sequence[CellResult], spec: ExperimentSpec, xy: XY, xlabel: str, ylabel: str,
                 path: Path, xlog: bool = False) -> Path | None:
    """Accuracy-style curves, one panel per remaining-axes combination; None when nothing finished."""
    panels = _panels(results, spec)
    if not panels:
        return None
    fig, axes = _grid(len(panels))
    for ax, (title, by_series) in zip(axes, panels.items()):
        for label, cells in by_series.items():
            xs, ys, sds = _mean_curve(cells, xy)
            line, = ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.4,
                            label=f"{label} (n={len(cells)})")
            if len(cells) > 1:
                ax.fill_between(xs, [y - s for y, s in zip(ys, sds)], [y + s for y, s in zip(ys, sds)],
                                color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if xlog:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def device_times_figure(results: Sequence[CellResult], spec: ExperimentSpec, path: Path) -> Path | None:
    """Mean per-device round time by device kind (left) and by split point (right), per series value.

    Each bar averages every (device, round) pair of the finished cells; the bar label gives how
    many pairs it covers.
    """
    by_kind: dict[str, dict[str, list[float]]] = {}
    by_split: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if r.status != "finished":
            continue
        label = spec.series_label(r.cell.labels)
        data = r.cell.config.data
        blocks = model_blocks(r.cell.config.model, dataset_num_classes(data), dataset_input_shape(data),
                              json.dumps(r.cell.config.model_params, sort_keys=True))
        for record in r.rounds:
            for device, times in record.device_times.items():
                kind = record.device_kinds.get(device, "unknown")
                split = record.split_points.get(device)
                by_kind.setdefault(label, {}).setdefault(kind, []).append(times.total_s)
                split_name = "whole model" if split is None or split >= blocks else f"split {split}"
                by_split.setdefault(label, {}).setdefault(split_name, []).append(times.total_s)
    if not by_kind:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, by_label, title in ((axes[0], by_kind, "by device kind (FLOPS-rate)"), (axes[1], by_split, "by split point")):
        categories = sorted({c for per in by_label.values() for c in per}, key=_category_order)
        width = 0.8 / max(1, len(by_label))
        for i, (label, per) in enumerate(by_label.items()):
            xs = [j + i * width for j in range(len(categories))]
            means = [statistics.fmean(per[c]) if c in per else 0.0 for c in categories]
            bars = ax.bar(xs, means, width=width, label=label)
            for bar, c in zip(bars, categories):
                if c in per:
                    ax.annotate(f"{len(per[c])}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6)
        ax.set_xticks([j + width * (len(by_label) - 1) / 2 for j in range(len(categories))])
        ax.set_xticklabels(categories, rotation=30, fontsize=8)
        ax.set_ylabel("mean device round time (s)")
        ax.set_title(f"Per-device round time {title}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


@functools.lru_cache(maxsize=16)
def model_blocks(model: str, num_classes: int, input_shape: tuple[int, ...], params_json: str = "{}") -> int:
    """Blocks in the whole model: a split point equal to it means the device trains everything.
    (``model_params`` as JSON: the cache needs hashable arguments.)"""
    return len(build_model(model, num_classes, input_shape, params=json.loads(params_json)).blocks)


_KIND_ORDER = {"low": 0, "mid": 1, "high": 2}


def _category_order(name: str) -> tuple:
    """Kinds low < mid < high (FLOPS first, then rate); splits by depth; anything else last."""
    if name.startswith("split "):
        return (1, int(name.split()[1]), "")
    parts = name.split("-")
    if all(p in _KIND_ORDER for p in parts):
        return (0, tuple(_KIND_ORDER[p] for p in parts), "")
    return (2, 0, name)


def _accuracy_against(x: Callable[[RoundRecord], float]) -> XY:
    """(``x(record)``, accuracy in %), or None for a round without an accuracy."""
    return lambda r: None if r.test_accuracy is None else (x(r), 100 * r.test_accuracy)


def write_plots(results: Sequence[CellResult], spec: ExperimentSpec, out: Path) -> dict[str, Path]:
    """Every standard figure that has data; name -> file."""
    figures = {
        "accuracy_vs_round": curve_figure(results, spec, _accuracy_against(lambda r: r.round),
                                          "round", "test accuracy (%)", out / "accuracy_vs_round.png"),
        "accuracy_vs_time": curve_figure(results, spec, _accuracy_against(lambda r: r.elapsed_s),
                                         "wall-clock time (s)", "test accuracy (%)", out / "accuracy_vs_time.png"),
        "accuracy_vs_bytes": curve_figure(results, spec, _accuracy_against(lambda r: r.cumulative_bytes * 1e-6),
                                          "bytes moved (MB, all links)", "test accuracy (%)", out / "accuracy_vs_bytes.png"),
        "device_round_times": device_times_figure(results, spec, out / "device_round_times.png"),
    }
    return {name: path for name, path in figures.items() if path is not None}
