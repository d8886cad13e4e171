"""The privacy benchmark's harness (benchmarks/privacy.py): its settings load as runs, the goals it
names as missed (and by how much), the table, the picture, the command line. No services here."""
from __future__ import annotations

import struct
import zlib
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks import privacy, run


def _attack(accuracy: float, auc: float, chance: float = 0.12) -> dict:
    return {"accuracy": accuracy, "auc": auc, "chance_accuracy": chance, "samples": 100}


def _row(setting: str, seed: int, accuracy: float, bytes_: int, attacks: dict, reconstruction: dict) -> dict:
    return {"setting": setting, "seed": seed, "state": "finished", "rounds_completed": 2, "rounds_planned": 2,
            "wall_s": 10.0, "accuracy": accuracy, "bytes": bytes_, "round_s": 5.0, "split_points": [1, 2],
            "label_attacks": attacks, "reconstruction": reconstruction}


def _rec(ssim: float) -> dict:
    return {"round": 1, "samples": 8, "ssim": ssim, "psnr": 20.0, "baseline_ssim": 0.1, "baseline_psnr": 12.0}


def _results(u_accuracy: float, u_bytes: int, recommended_auc: float, recommended_ssim: float) -> dict:
    rows = []
    for seed in (1, 2):
        plain = _row("plain", seed, 0.90, 100, {"labels": _attack(1.0, 1.0)}, {"1": _rec(0.8), "2": _rec(0.6)})
        u = _row("u_shaped", seed, u_accuracy, u_bytes, {"norm": _attack(0.9, 0.6, 0.9), "similarity": _attack(0.7, 0.9)},
                 {"1": _rec(0.8)})
        r = _row("recommended", seed, 0.89, 130, {"similarity": _attack(0.15, recommended_auc)},
                 {"2": _rec(recommended_ssim)})
        for row in (plain, u, r):
            row["points_vs_plain"] = 100 * (row["accuracy"] - plain["accuracy"])
            row["bytes_vs_plain"] = row["bytes"] / plain["bytes"]
        rows += [plain, u, r]
    tile = [[[seed * 10] * 28] * 28 for seed in range(4)]
    return {"machine": {"cpu_model": "cpu", "cpus_usable": 2, "cpu_count": 2, "memory_gib": 8, "python": "3",
                        "torch": "2", "date_utc": "2026-01-02T03:04:05+00:00", "load_average_at_start": [0.1]},
            "settings": {"devices": 10, "rounds": 2, "seeds": 2, "record_steps": 3, "auxiliary": 500,
                         "inverse_epochs": 8, "model": "cnn", "data": "MNIST"},
            "rows": rows, "total_s": 60.0,
            "tiles": [{"setting": "plain", "cut": "1", "originals": tile, "reconstructions": tile}]}


def test_every_setting_loads_as_a_run_and_the_recommended_one_keeps_labels_on_the_device() -> None:
    for setting in privacy.SETTINGS:
        config = privacy.setting_config(setting, seed=2, rounds=3)
        assert config.seed == 2 and config.rounds == 3
        assert config.split.u_shaped == (setting != "plain")
    recommended = privacy.setting_config("recommended", 1, 1)
    assert recommended.split_privacy.label_counts == "withheld" and recommended.grouping.method == "random"
    assert recommended.secure_aggregation.enabled and recommended.aggregation.rule == "mean"
    assert set(recommended.split_privacy.defences) == {"floor", "noise", "label_noise"}


def test_the_population_rows_run_ten_devices_a_round_of_a_hundred_over_every_training_image() -> None:
    config = privacy.setting_config("recommended", seed=1, rounds=2, devices=100)
    assert (config.data.num_devices, config.per_round, config.data.max_samples) == (100, 10, 4000)
    assert config.secure_aggregation.enabled and config.split_privacy.label_counts == "withheld"
    default = privacy.setting_config("plain", seed=1, rounds=2)
    assert (default.data.num_devices, default.per_round, default.data.max_samples) == (10, 10, 2000)
    # As many images trained as the 10-device runs: 10 devices of 40 images a round against 2,000.
    assert privacy.population_rounds(10, 100) == 50 and privacy.population_rounds(2, 100) == 10


def test_the_population_rows_get_tables_of_their_own_and_no_goal() -> None:
    results = _results(u_accuracy=0.895, u_bytes=140, recommended_auc=0.52, recommended_ssim=0.3)
    assert privacy.population_table(results) == []
    plain = _row("plain", 1, 0.70, 100, {"labels": _attack(1.0, 1.0)}, {"1": _rec(0.8)})
    recommended = _row("recommended", 1, 0.60, 90, {"similarity": _attack(0.3, 0.7)}, {"2": _rec(0.5)})
    for row in (plain, recommended):
        row.update(devices=100, points_vs_plain=100 * (row["accuracy"] - 0.70), bytes_vs_plain=row["bytes"] / 100)
    results["population_rows"] = [plain, recommended]
    results["settings"]["population_data"] = "all 4,000 training images"
    lines = privacy.population_table(results)
    assert lines[0].startswith("Population: 100 devices, 10 a round, 2 rounds, seed 1, all 4,000 training images")
    assert any(line.startswith("| recommended | 60.0 | -10.0 |") for line in lines)
    assert "\n".join(lines) in privacy.report(results)
    # The goals judge the 10-device rows alone: the population's 10 points lost and AUC 0.7 miss none.
    assert privacy.goals(results) == []


def test_goals_met_when_the_figures_are_within_them() -> None:
    results = _results(u_accuracy=0.895, u_bytes=140, recommended_auc=0.52, recommended_ssim=0.3)
    assert privacy.goals(results) == []
    assert "Every goal measured is met." in privacy.report(results)


def test_goals_missed_are_named_with_by_how_much() -> None:
    results = _results(u_accuracy=0.85, u_bytes=200, recommended_auc=0.7, recommended_ssim=0.6)
    missed = privacy.goals(results)
    assert any("U-shaped accuracy: -5.0 points" in m for m in missed)
    assert any("U-shaped bytes: 2.00x" in m for m in missed)
    assert any("(similarity): AUC 0.700" in m for m in missed)
    assert any("SSIM at its shallowest cut (2): 0.75x plain split 1's" in m for m in missed)
    assert not any("recommended accuracy" in m for m in missed)   # 1 point lost: within 2
    results["goals_missed"] = missed
    assert "Goals missed:" in privacy.report(results)
    without = {**results, "rows": [r for r in results["rows"] if r["setting"] == "plain"]}
    assert [m for m in privacy.goals(without) if "not measured" in m] == [
        "U-shaped against plain: not measured (u_shaped not run)", "recommended setting: not measured (recommended not run)"]


def test_the_table_averages_seeds_and_shows_each_attack_and_cut() -> None:
    results = _results(u_accuracy=0.88, u_bytes=140, recommended_auc=0.52, recommended_ssim=0.3)
    results["rows"][1].update(accuracy=0.86, points_vs_plain=-4.0)   # u_shaped, seed 1: means 0.87 and -3.0
    s = privacy.summary(results)
    assert s["u_shaped"]["accuracy"] == pytest.approx(0.87) and s["u_shaped"]["seeds"] == 2
    lines = privacy.table(results)
    u_line = next(line for line in lines if line.startswith("| u_shaped |") and "x |" in line)
    assert "| 87.0 | -3.0 |" in u_line and "90 % / 0.60 (chance 90 %)" in u_line and "n/a" in u_line
    plain_rec = [line for line in lines if line.startswith("| plain |")][-1]
    assert plain_rec == "| plain | 0.800 / 20.0 (0.100 / 12.0) | 0.600 / 20.0 (0.100 / 12.0) |"
    assert "plain at cut 1" in privacy.report(results)


def test_unsplit_gets_a_table_of_its_own_and_the_reconstruction_goal_judges_the_better_attack() -> None:
    results = _results(u_accuracy=0.895, u_bytes=140, recommended_auc=0.52, recommended_ssim=0.3)
    assert not any("UnSplit" in line for line in privacy.table(results))   # a result written before it ran
    assert privacy.goals(results) == []
    for row in results["rows"]:
        for cut, figures in row["reconstruction"].items():
            # UnSplit beats the inverse network at the recommended setting's cut 2 only
            figures.update(unsplit_ssim=0.72 if row["setting"] == "recommended" else 0.2, unsplit_psnr=15.0)
        if row["setting"] == "plain" and row["seed"] == 1:
            del row["reconstruction"]["2"]["unsplit_ssim"]   # a cut UnSplit did not run at: left out of the mean
    lines = privacy.table(results)
    start = lines.index("UnSplit, the Main Server without the front's weights or any data (SSIM / PSNR dB):")
    assert "| plain | 0.200 / 15.0 | 0.200 / 15.0 |" in lines[start:]
    assert "| recommended | n/a | 0.720 / 15.0 |" in lines[start:]
    assert privacy.summary(results)["plain"]["reconstruction"]["2"]["unsplit_ssim"] == pytest.approx(0.2)
    results["settings"].update(unsplit_samples=32, unsplit_budget=asdict(privacy.unsplit_budget(20)))
    assert "UnSplit on 32 images a cut, 20 alternations of 50 steps on the images and 50 on its clone" in \
        privacy.report(results)
    # 0.72 at the recommended cut 2 against plain cut 1's better attack (the inverse network's 0.8)
    assert privacy.goals(results) == [
        "recommended, reconstruction SSIM at its shallowest cut (2): 0.90x plain split 1's, the better attack's at "
        "each (goal at most 0.5x)"]


def test_the_picture_is_a_png_of_the_tiles(tmp_path: Path) -> None:
    path = privacy.picture(_results(0.9, 100, 0.5, 0.3), tmp_path / "reconstructions.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (height, width) == (2 + 30, 2 + 9 * 30)   # one row; 4 + gap + 4 tiles of 28 and 2-pixel gaps
    (length,) = struct.unpack(">I", data[33:37])
    raw = zlib.decompress(data[41:41 + length])
    assert raw[(width + 1) * 2 + 1 + 2] == 0 and raw[(width + 1) * 2 + 1 + 2 + 30] == 10   # tiles 0 and 1


def test_the_command_line(capsys) -> None:
    selection, _ = privacy.parse(["--quick"])
    assert selection == privacy.Selection.quick() and selection.seeds == 1 and "plain" in selection.settings
    selection, args = privacy.parse(["--settings", "noise,floor", "--seeds", "2", "--name", "x"])
    assert (selection.settings, selection.seeds, args.name) == (("noise", "floor"), 2, "x")
    assert privacy.parse([])[0].seeds == 3
    assert privacy.parse([])[0].population == 100 and privacy.Selection.quick().population == 0
    assert privacy.parse(["--population", "0"])[0].population == 0
    for bad in (["--settings", "nope"], ["--seeds", "0"], ["--name", "Bad Name"], ["--population", "5"]):
        with pytest.raises(SystemExit):
            privacy.parse(bad)
    assert "nope" in capsys.readouterr().err
    assert "j" in run.PARTS and "j" not in run.DEFAULT_PARTS


def test_a_run_that_withholds_its_label_counts_gives_the_count_attack_nothing_to_read() -> None:
    from benchmarks.privacy_records import RoundRecords

    def round_of(joins: dict[str, list[int]]) -> RoundRecords:
        return RoundRecords(1, 1, None, {d: 1 for d in joins}, joins, {d: [3, 1] for d in joins}, None)

    assert privacy.reported_counts([round_of({"dev-000": [], "dev-001": []})]) == []
    assert privacy.reported_counts([round_of({"dev-000": [2, 2], "dev-001": []})]) == [([2, 2], [3, 1])]
