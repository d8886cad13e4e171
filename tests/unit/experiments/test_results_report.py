"""Results table, aggregation over seeds, resume bookkeeping and report rendering on written cells."""
from __future__ import annotations

import csv
import json
import statistics

import pytest
import yaml

from experiments.grid import expand
from experiments.report import render_report
from experiments.results import aggregate, cell_row, load_results
from experiments.runner import cell_dir, is_finished
from experiments.spec import ExperimentSpec

SPEC = ExperimentSpec.model_validate({
    "name": "t", "base": {"rounds": 3, "data": {"num_devices": 4}},
    "axes": {"seed": [0, 1], "algorithm": ["fedavg", "s2fl"]},
    "targets": [0.5, 0.9], "report": {"series": "algorithm", "repeat": "seed", "last_k": 2},
})


XEON = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpus_usable": 2, "torch": "2.13.0+cpu"}


@pytest.fixture
def write_cell(round_record):
    """Writes a cell's folder as a run leaves it: ``accs[i]`` is round i + 1's accuracy (None: none);
    two devices (a low one at split 1, a high one with the whole model)."""
    def _round(i: int, acc: float | None, **fields):
        return round_record(round=i, round_id=i, test_accuracy=acc, round_time_s=2.0 * i, elapsed_s=10.0 * i,
                            cumulative_bytes=1_000_000 * i, aggregated=["d0", "d1"], split_points={"d0": 1, "d1": 4},
                            device_kinds={"d0": "low-low", "d1": "high-high"},
                            device_times={d: {"compute_s": 1, "transfer_s": 0, "wait_s": 0, "server_s": 0, "total_s": t}
                                          for d, t in (("d0", 3.0), ("d1", 1.0))}, **fields)

    def write(out, cell, accs, status="finished", failed_round=False, machine=XEON):
        path = cell_dir(out, cell)
        path.mkdir(parents=True)
        rounds = [_round(i + 1, a) for i, a in enumerate(accs)]
        if failed_round:   # a failed attempt is in metrics.jsonl but never counts
            rounds.insert(1, _round(2, 0.99, status="failed"))
        (path / "metrics.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in rounds))
        (path / "cell.json").write_text(json.dumps({"cell_id": cell.cell_id, "labels": cell.labels,
                                                    "config_hash": cell.config_hash, "status": status,
                                                    **({"machine": machine} if machine else {})}))
    return write


@pytest.fixture
def written(tmp_path, write_cell):
    cells = expand(SPEC)   # seed 0 fedavg, seed 0 s2fl, seed 1 fedavg, seed 1 s2fl
    write_cell(tmp_path, cells[0], [0.3, 0.6, 0.7], failed_round=True)
    write_cell(tmp_path, cells[1], [0.4, 0.92, 0.95])
    write_cell(tmp_path, cells[2], [0.2, 0.5, 0.8])
    write_cell(tmp_path, cells[3], [0.1, 0.2], status="failed")
    return tmp_path, cells


def test_rows_count_completed_rounds_and_first_round_reaching_each_target(written):
    out, cells = written
    results = load_results(SPEC, cells, out)
    row = cell_row(results[0], SPEC)
    assert row["rounds_done"] == 3 and row["final_accuracy"] == 0.7 and row["best_accuracy"] == 0.7
    assert row["last2_accuracy"] == pytest.approx(0.65)
    assert (row["rounds_to_50"], row["time_to_50_s"], row["bytes_to_50"]) == (2, 20.0, 2_000_000)
    assert row["rounds_to_90"] is None and row["time_to_90_s"] is None     # never reached: no number
    assert row["median_round_time_s"] == 4.0 and row["total_bytes"] == 3_000_000


def test_aggregate_is_mean_and_std_over_seeds_of_finished_cells_only(written):
    out, cells = written
    rows = [cell_row(r, SPEC) for r in load_results(SPEC, cells, out)]
    summary = {s["algorithm"]: s for s in aggregate(rows, SPEC)}
    fedavg, s2fl = summary["fedavg"], summary["s2fl"]
    assert (fedavg["n"], fedavg["cells"]) == (2, 2)
    assert fedavg["final_accuracy_mean"] == pytest.approx(0.75)
    assert fedavg["final_accuracy_std"] == pytest.approx(statistics.stdev([0.7, 0.8]))
    assert fedavg["time_to_90_s_n"] == 0 and fedavg["time_to_90_s_mean"] is None
    assert (s2fl["n"], s2fl["cells"]) == (1, 2)           # the failed seed does not count
    assert s2fl["final_accuracy_mean"] == 0.95 and s2fl["final_accuracy_std"] == 0.0
    assert s2fl["rounds_to_90_mean"] == 2 and s2fl["time_to_90_s_n"] == 1


def test_only_finished_cells_with_the_same_config_are_skipped(written):
    out, cells = written
    assert is_finished(out, cells[0]) and not is_finished(out, cells[3])       # failed: run again
    changed = expand(ExperimentSpec.model_validate({**SPEC.model_dump(), "base": {"rounds": 4, "data": {"num_devices": 4}}}))
    assert changed[0].cell_id == cells[0].cell_id and not is_finished(out, changed[0])
    (cell_dir(out, cells[1]) / "metrics.jsonl").unlink()
    assert not is_finished(out, cells[1])


def test_a_cell_recorded_under_an_older_hash_counts_by_the_config_it_ran(written):
    """A setting the project added since changes every cell's hash; the run's config.yaml shows
    whether the cell's configuration really changed (experiments.grid.Cell.ran_as)."""
    out, cells = written
    path = cell_dir(out, cells[2])
    record = json.loads((path / "cell.json").read_text())
    (path / "cell.json").write_text(json.dumps({**record, "config_hash": "0123456789abcdef"}))
    assert not is_finished(out, cells[2])                          # no config.yaml to compare with
    assert load_results(SPEC, cells, out)[2].status == "not run"
    ran = {"run_id": "r", **cells[2].config.model_dump(mode="json")}
    del ran["deadlines"]["evaluate_s"]                            # added after the run, at its default now
    (path / "config.yaml").write_text(yaml.safe_dump(ran))
    assert is_finished(out, cells[2])
    assert load_results(SPEC, cells, out)[2].status == "finished"
    ran["rounds"] = 7                                               # it ran something else
    (path / "config.yaml").write_text(yaml.safe_dump(ran))
    assert not is_finished(out, cells[2])
    (path / "config.yaml").write_text("rounds: [unclosed")          # unreadable: as if missing
    assert not is_finished(out, cells[2])


def test_report_renders_tables_plots_and_failures(written):
    out, cells = written
    path = render_report(load_results(SPEC, cells, out), SPEC, out, "python -m experiments run t.yaml")
    text = path.read_text()
    assert "| fedavg | 2/2 | 75.00 ± 7.07 |" in text
    assert "| s2fl | 1/2 | 95.00 |" in text
    assert "| fedavg | 90% | 0/2 | — | — | — |" in text
    assert "## Failed cells" in text and cells[3].cell_id in text
    for name in ("accuracy_vs_round", "accuracy_vs_time", "accuracy_vs_bytes", "device_round_times"):
        assert f"]({name}.png)" in text
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["finished", "finished", "finished", "failed"]
    assert float(rows[1]["final_accuracy"]) == 0.95
    data = json.loads((out / "results.json").read_text())
    assert len(data["cells"]) == 4 and len(data["summary"]) == 2


def test_report_names_each_machine_when_cells_ran_on_more_than_one(tmp_path, write_cell):
    cells = expand(SPEC)
    epyc = {**XEON, "cpu_model": "AMD EPYC"}
    write_cell(tmp_path, cells[0], [0.3, 0.6])
    write_cell(tmp_path, cells[1], [0.4, 0.9])
    write_cell(tmp_path, cells[2], [0.2, 0.5], machine=epyc)
    write_cell(tmp_path, cells[3], [0.1, 0.2], machine=None)
    text = render_report(load_results(SPEC, cells, tmp_path), SPEC, tmp_path, "cmd").read_text()
    assert ("- Cells ran on more than one machine (`results.csv` names each cell's): "
            "Intel(R) Xeon(R) Processor, 2 cores, torch 2.13.0+cpu: 2 cells; AMD EPYC, 2 cores, torch 2.13.0+cpu: "
            "1 cell; not recorded (cells older than per-cell records; machine.json names the first cells' machine): 1 cell.") in text
    with open(tmp_path / "results.csv") as fh:
        machines = [r["machine"] for r in csv.DictReader(fh)]
    assert machines == ["Intel(R) Xeon(R) Processor, 2 cores, torch 2.13.0+cpu"] * 2 + [
        "AMD EPYC, 2 cores, torch 2.13.0+cpu", ""]
    assert all("machine_mean" not in s for s in json.loads((tmp_path / "results.json").read_text())["summary"])


def test_report_of_one_machine_lists_no_machines(written):
    out, cells = written
    text = render_report(load_results(SPEC, cells, out), SPEC, out, "cmd").read_text()
    assert "more than one machine" not in text


def test_progress_prints_one_line_per_cell_off_a_terminal():
    import io

    from experiments.runner import CellOutcome, Progress

    stream = io.StringIO()
    cells = expand(SPEC)
    progress = Progress(len(cells), stream)
    progress.show("seed=0, algorithm=fedavg: round 1/3  acc 10.0%")     # not a terminal: no redraws
    progress.cell_done(CellOutcome(cells[0], "finished", 65.0))
    progress.cell_done(CellOutcome(cells[1], "skipped", 0.0))
    progress.cell_done(CellOutcome(cells[2], "failed", 3.0, "fed_server exited with code 1"))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[######------------------] 1/4") and "done in 1:05" in lines[0]
    assert "already finished, skipped" in lines[1]
    assert "3/4" in lines[2] and "FAILED: fed_server exited with code 1" in lines[2] and "eta" in lines[2]


def test_a_cell_is_run_by_one_runner_at_a_time(tmp_path):
    import os
    import subprocess

    from experiments.runner import _claim, _release

    cell = expand(SPEC)[0]
    assert _claim(tmp_path, cell)
    assert not _claim(tmp_path, cell)                 # held by this (live) process
    _release(tmp_path, cell)
    assert _claim(tmp_path, cell)
    _release(tmp_path, cell)
    gone = subprocess.Popen(["true"])
    gone.wait()                                       # a runner that died holding the lock
    (tmp_path / "cells" / f"{cell.cell_id}.lock").write_text(str(gone.pid))
    assert _claim(tmp_path, cell)
    assert (tmp_path / "cells" / f"{cell.cell_id}.lock").read_text() == str(os.getpid())


def test_an_axis_label_is_not_overwritten_by_the_config_value(tmp_path, write_cell):
    spec = ExperimentSpec.model_validate({
        "name": "t", "base": {"rounds": 2, "data": {"num_devices": 4}},
        "axes": {"algorithm": {"plain": {"algorithm": "fedipg", "algorithm_params": {"lam": 0.0}},
                               "penalised": {"algorithm": "fedipg"}}},
    })
    cells = expand(spec)
    for cell in cells:
        write_cell(tmp_path, cell, [0.5, 0.6])
    rows = [cell_row(r, spec) for r in load_results(spec, cells, tmp_path)]
    assert [r["algorithm"] for r in rows] == ["plain", "penalised"]
    assert [s["algorithm"] for s in aggregate(rows, spec)] == ["plain", "penalised"]


def test_a_failed_cell_whose_run_completed_is_recovered_not_rerun(written):
    from experiments.runner import recover_finished

    out, cells = written
    failed = cells[3]
    assert not recover_finished(out, failed, None, "x")          # no summary.json: really unfinished
    (cell_dir(out, failed) / "summary.json").write_text(json.dumps({"finished": True, "stop_reason": "completed"}))
    assert recover_finished(out, failed, None, "recovered")
    assert is_finished(out, failed)
    assert json.loads((cell_dir(out, failed) / "cell.json").read_text())["note"] == "recovered"


def test_rounds_without_an_accuracy_count_as_rounds_but_never_as_figures(tmp_path, write_cell):
    """Federated evaluation that no device reported leaves a round's accuracy null: the row and
    the plots skip it instead of failing."""
    from experiments.plots import write_plots

    cells = expand(SPEC)
    write_cell(tmp_path, cells[0], [None, 0.6, None])
    write_cell(tmp_path, cells[2], [0.2, None, 0.8])
    results = load_results(SPEC, cells, tmp_path)
    row = cell_row(results[0], SPEC)
    assert row["rounds_done"] == 3 and row["final_accuracy"] == 0.6 and row["best_accuracy"] == 0.6
    assert row["rounds_to_50"] == 2 and row["rounds_to_90"] is None
    (tmp_path / "plots").mkdir()
    figures = write_plots([r for r in results if r.rounds], SPEC, tmp_path / "plots")
    assert figures["accuracy_vs_round"] is not None and figures["accuracy_vs_round"].exists()
