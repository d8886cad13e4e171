"""(k) The privacy benchmark: what an honest-but-curious Fed Server and Main Server learn of the
devices' labels and inputs, in each privacy setting, and what each setting costs.

Every setting (plain S2FL, U-shaped S2FL, each device-side defence, each label-count mode, the
recommended combination) runs through the real services (the testbed: Fed Server, Main Server and a
device agent as separate processes on loopback) with both servers recording what they receive
(``--record-received``, shared/recording.py); benchmarks/privacy_records.py reads the records back
beside the true inputs and labels, and the attacks of benchmarks/privacy_attacks.py run on them:

- label inference: the labels themselves (plain split); from the gradients a U-shaped device sends
  up, the norm, direction (cosine clustering) and similarity attacks; from each device's head update
  the Fed Server receives, and from the label counts a join carries, each device's label
  distribution. Accuracy and AUC against chance;
- input reconstruction: an inverse network trained on auxiliary images no device holds (the first
  :data:`AUXILIARY` images of the test set) maps the activations received at each cut back to
  inputs, with the front blocks of the round's global model (which every device may fetch). SSIM
  and PSNR against the auxiliary mean image (no information).

Per setting and seed: the final accuracy against plain S2FL's of the same seed in the same
invocation, the run's wire bytes and mean round time, and each attack's success; the goals of the
privacy work printed beside them (:func:`goals`). A PNG grid shows originals and reconstructions.
The population rows run plain and the recommended setting once more at :data:`POPULATION` devices,
:data:`DEVICES` a round, in tables of their own (no goal is set there).

``python -m benchmarks.privacy [--settings ...] [--seeds N] [--rounds N] [--population N] [--quick]`` prints the
table and writes ``benchmarks/results/<UTC date>_privacy/results.json``, ``results.md`` and
``reconstructions.png``; ``python -m benchmarks.run --only k`` runs the same part.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.result_files import add_name_option, default_out, markdown_table, write

if TYPE_CHECKING:
    from benchmarks.privacy_attacks import UnSplitBudget
    from benchmarks.privacy_records import RoundRecords
    from shared.config import RunConfig
    from shared.models import SplitModel
    from testbed.warm_start import WarmStarter

#: Every setting: the run's overrides on top of :func:`base_config` (dotted keys).
U_SHAPED: dict[str, object] = {"split.u_shaped": True}
#: U-shaped S2FL with secure aggregation: the Fed Server stores each device's head update masked
#: (docs/privacy.md); the rule is the mean, as secure aggregation sums the updates.
SECURE: dict[str, object] = {**U_SHAPED, "secure_aggregation.enabled": True, "aggregation.rule": "mean"}
#: The defence setting the goals judge: labels kept on the device, counts withheld (random
#: grouping), the head's update masked, the floor at cut 2 and activation noise against
#: reconstruction, label noise against the gradients (docs/split-privacy.md, "How to choose a
#: setting").
RECOMMENDED: dict[str, object] = {
    **SECURE, "split_privacy.label_counts": "withheld", "grouping.method": "random",
    "split_privacy.defences": ["floor", "noise", "label_noise"],
    "split_privacy.defence_params": {"floor": {"split": 2}, "noise": {"scale": 0.5}, "label_noise": {"epsilon": 2.0}}}
SETTINGS: dict[str, dict[str, object]] = {
    "plain": {},
    "u_shaped": U_SHAPED,
    "floor": {**U_SHAPED, "split_privacy.defences": ["floor"], "split_privacy.defence_params": {"floor": {"split": 2}}},
    "noise": {**U_SHAPED, "split_privacy.defences": ["noise"], "split_privacy.defence_params": {"noise": {"scale": 0.5}}},
    "nopeek": {**U_SHAPED, "split_privacy.defences": ["nopeek"],
               "split_privacy.defence_params": {"nopeek": {"weight": 0.5}}},
    "label_noise": {**U_SHAPED, "split_privacy.defences": ["label_noise"],
                    "split_privacy.defence_params": {"label_noise": {"epsilon": 2.0}}},
    "counts_local_dp": {**U_SHAPED, "split_privacy.label_counts": "local_dp", "split_privacy.label_counts_epsilon": 1.0},
    "counts_withheld": {**U_SHAPED, "split_privacy.label_counts": "withheld", "grouping.method": "random"},
    "secure_aggregation": SECURE,
    "recommended": RECOMMENDED,
}
BASELINE = "plain"
QUICK_SETTINGS = ("plain", "u_shaped", "recommended")

DEVICES = 10
ROUNDS = 10
#: The images the 10-device runs share out.
SAMPLES = 2000
#: The population rows (``--population``): plain and the recommended setting at this many devices,
#: :data:`DEVICES` of them a round, the first seed only; the embedded MNIST's 4,000 training images
#: (all of them) shared out, 40 a device, for as many rounds as train the images the 10-device runs
#: train (:func:`population_rounds`).
POPULATION = 100
POPULATION_SETTINGS = (BASELINE, "recommended")
TRAIN_IMAGES = 4000
#: Quick: the warm-up's rounds at cuts 1 and 2 (plain S2FL reaches cut 3 in its third round).
QUICK_ROUNDS = 2
SEEDS = 3
#: Each device's first steps of a round that the servers keep: enough samples for the attacks
#: (10 devices x 3 steps x 32 = 960 a round) at 25 KB a sample at cut 1.
RECORD_STEPS = 3
#: The attacker's auxiliary data: the first images of the test set, which no device holds.
AUXILIARY = 500
#: Reconstructions scored per cut (the latest round at that cut).
SCORED = 256
#: Epochs of the inverse network over the auxiliary images (quick: :data:`QUICK_EPOCHS`).
EPOCHS = 30
QUICK_EPOCHS = 8
#: UnSplit's images per cut (the latest round at that cut), and its optimisation budget (quick: fewer
#: alternations). UnSplit optimises every image for itself, so it rebuilds fewer than the inverse
#: network, which is trained once.
UNSPLIT_SAMPLES = 32
UNSPLIT_ROUNDS = 20
QUICK_UNSPLIT_ROUNDS = 4
#: Added to the run's seed for UnSplit's clone: the attacker's own initialisation of the front.
ATTACKER_SEED = 1000
ROUND_S = 60.0

# The goals printed beside the figures.
GOAL_U_SHAPED_POINTS = 1.0      # U-shaped S2FL within this many points of plain S2FL's final accuracy
GOAL_U_SHAPED_BYTES = 1.5       # at no more than this many times its bytes
GOAL_LABEL_AUC = 0.55           # recommended setting: the best label attack's AUC at most this
GOAL_LABEL_POINTS = 5.0         # and its accuracy at most chance + this many points
GOAL_SSIM_FRACTION = 0.5        # its reconstruction SSIM at most this fraction of plain split 1's
GOAL_RECOMMENDED_POINTS = 2.0   # and at most this many points of accuracy lost


def base_config(seed: int, rounds: int, devices: int = DEVICES) -> dict:
    """The benchmark's run: the small cnn on 2,000 images of the embedded MNIST over 10 devices of
    one agent (no emulated kinds), every device in every round; the paper's warm-up
    (``split.warm_up: every_split``, set here: the default, ``estimated``, tries a cut only where
    the median rule picks it) puts every device at each cut in turn, so each cut is recorded.
    With more ``devices`` (the population rows), :data:`DEVICES` of them a round over
    all the training images."""
    population = devices > DEVICES
    return {
        "algorithm": "s2fl",
        "rounds": rounds,
        "devices_per_round": DEVICES if population else None,
        "data": {"num_devices": devices, "partition": "dirichlet", "alpha": 1.0, "seed": seed,
                 "max_samples": TRAIN_IMAGES if population else SAMPLES},
        "train": {"lr": 0.05, "batch_size": 32},
        "deadlines": {"round_s": ROUND_S, "join_s": 20.0, "step_s": 20.0, "registration_s": 60.0},
        "devices": {"profiles": []},
        "split": {"warm_up": "every_split"},
        "seed": seed,
    }


def population_rounds(rounds: int, population: int) -> int:
    """Rounds of the population rows: as many images trained as ``rounds`` of the 10-device runs,
    whose round trains all :data:`SAMPLES` images, where a population round trains its
    :data:`DEVICES` devices' share of :data:`TRAIN_IMAGES` (50 rounds for 10 at 100 devices; 10
    would train each image about once, too little to compare accuracies: docs/split-privacy.md)."""
    return math.ceil(rounds * SAMPLES * population / (DEVICES * TRAIN_IMAGES))


def setting_config(setting: str, seed: int, rounds: int, devices: int = DEVICES) -> RunConfig:
    """The run of ``setting`` with ``seed`` over ``devices``."""
    from shared.config import set_dotted
    from shared.run_config import load_run_config

    data = base_config(seed, rounds, devices)
    for key, value in SETTINGS[setting].items():
        set_dotted(data, key, json.loads(json.dumps(value)))
    return load_run_config(data)


# --- one run and its attacks ------------------------------------------------------------------

def run_setting(setting: str, seed: int, rounds: int, root: Path, warm: WarmStarter | None = None,
                time_limit_s: float | None = None, epochs: int = EPOCHS, unsplit_rounds: int = UNSPLIT_ROUNDS,
                devices: int = DEVICES) -> dict:
    """One testbed run of ``setting`` over ``devices`` with both servers recording, then every
    attack on what they recorded: the row's figures."""
    from testbed.runner import Testbed

    config = setting_config(setting, seed, rounds, devices)
    folder = root / (f"{setting}-{seed}" + (f"-{devices}-devices" if devices != DEVICES else ""))
    run_dir, records = folder / "run", folder / "records"
    started = time.monotonic()
    with Testbed(config, run_dir, log_level="WARNING", warm=warm,
                 server_args=["--record-received", str(records), "--record-steps", str(RECORD_STEPS)]) as testbed:
        status = testbed.follow(timeout=time_limit_s or 2 * rounds * ROUND_S + 120.0)
    wall = time.monotonic() - started
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ok = [m for m in metrics if m["status"] == "ok"]
    row = {"setting": setting, "seed": seed, "devices": devices, "state": status["state"],
           "rounds_completed": len({m["round"] for m in ok}),
           "rounds_planned": rounds, "wall_s": round(wall, 2),
           "accuracy": status["summary"]["final_accuracy"],
           "bytes": sum(m["bytes_total"] for m in metrics),
           "round_s": sum(m["round_time_s"] for m in ok) / len(ok) if ok else None,
           "split_points": sorted({k for m in ok for k in m["split_points"].values()})}
    row.update(attack_records(records, config, epochs, unsplit_rounds))
    shutil.rmtree(records, ignore_errors=True)
    return row


def _head_weight_and_bias(model: SplitModel) -> tuple[str, str]:
    """The state names of the model's last block's weight and bias (the classifier)."""
    last = list(model.blocks.keys())[-1]
    return f"blocks.{last}.weight", f"blocks.{last}.bias"


def reported_counts(rounds: list[RoundRecords]) -> list[tuple[list[int], list[int]]]:
    """(the label counts a device reported at its join, its true counts) for every join that
    reported any: a run with ``split_privacy.label_counts: withheld`` reports none, and the
    label-count attack has nothing to read."""
    return [(r.joins[d], r.true_counts[d]) for r in rounds for d in r.joins if r.joins[d]]


def attack_records(records: Path, config: RunConfig, epochs: int = EPOCHS,
                   unsplit_rounds: int = UNSPLIT_ROUNDS) -> dict:
    """Every attack on what the servers recorded under ``records`` (a run of ``config``): the
    label attacks' and the reconstruction's figures (the inverse network trained ``epochs``;
    UnSplit for ``unsplit_rounds`` alternations), and the reconstructions' tiles."""
    from benchmarks import privacy_attacks as attacks
    from benchmarks.images import psnr, ssim, to_unit_range
    from benchmarks.privacy_records import read_records
    from shared.algorithms.privacy_defence import ActivationNoiseParams
    from shared.data import dataset_input_shape, dataset_num_classes, load_dataset
    from shared.models import build_model

    classes = dataset_num_classes(config.data)
    model = build_model(config.model, classes, dataset_input_shape(config.data), seed=config.seed,
                        params=config.model_params)
    rounds = read_records(records, config, model)
    weight_name, bias_name = _head_weight_and_bias(model)
    steps = [s for r in rounds for s in r.steps]
    labels: dict[str, dict] = {}

    read = [(s.labels, s.y) for s in steps if s.labels is not None]
    if read:
        labels["labels"] = attacks.judge(attacks.one_hot_scores(torch.cat([k for k, _ in read]), classes),
                                         torch.cat([y for _, y in read])).as_dict()
    # (gradient sent up, true labels, the round's head weight where the Fed Server recorded it)
    sent_up = [(s.gradient, s.y, None if r.global_state is None else r.global_state[weight_name])
               for r in rounds for s in r.steps if s.gradient is not None]
    if sent_up:
        gradients = torch.cat([g for g, _, _ in sent_up])
        truth = torch.cat([y for _, y, _ in sent_up])
        labels["norm"] = attacks.norm_attack(gradients, truth, classes).as_dict()
        labels["direction"] = attacks.direction_attack(gradients, truth, classes, seed=config.seed).as_dict()
        with_head = [(g, y, w) for g, y, w in sent_up if w is not None]
        if with_head:
            scores = torch.cat([attacks.similarity_scores(g, w) for g, _, w in with_head])
            labels["similarity"] = attacks.judge(scores, torch.cat([y for _, y, _ in with_head])).as_dict()
    updates = [(upload[bias_name], r.global_state[bias_name], r.true_counts[d])
               for r in rounds if r.global_state is not None
               for d, upload in r.uploads.items() if bias_name in upload]
    if updates:
        scores = attacks.distribution_scores([attacks.head_update_scores(g, u) for u, g, _ in updates])
        labels["head_update"] = attacks.device_level(scores, torch.tensor([c for _, _, c in updates])).as_dict()
    joins = reported_counts(rounds)
    if joins:
        scores = attacks.distribution_scores([torch.tensor(j, dtype=torch.float64) for j, _ in joins])
        labels["label_counts"] = attacks.device_level(scores, torch.tensor([c for _, c in joins])).as_dict()

    train, test = load_dataset(config.data)
    low, high = float(train.x.min()), float(train.x.max())
    auxiliary = test.x[:AUXILIARY]
    mean_image = to_unit_range(auxiliary.mean(dim=0, keepdim=True), low, high)
    noise = ActivationNoiseParams.model_validate(config.split_privacy.defence_params.get("noise", {})).scale \
        if "noise" in config.split_privacy.defences else 0.0
    reconstruction: dict[str, dict] = {}
    tiles: dict[str, list] = {}
    for cut in sorted({s.split_point for s in steps}):
        latest = max((r for r in rounds if r.global_state is not None and any(s.split_point == cut for s in r.steps)),
                     key=lambda r: (r.round_index, r.attempt), default=None)
        if latest is None or latest.global_state is None:
            continue
        model.load_state_dict(latest.global_state)
        inverse = attacks.train_inverse(model.portion(0, cut), auxiliary, epochs, seed=config.seed,
                                        noise_scale=float(noise))
        at_cut = [s for s in latest.steps if s.split_point == cut]
        fx = torch.cat([s.fx for s in at_cut])[:SCORED]
        truth = to_unit_range(torch.cat([s.x for s in at_cut])[:SCORED], low, high)
        with torch.no_grad():
            rebuilt = to_unit_range(inverse(fx), low, high)
        baseline = mean_image.expand_as(truth)
        # UnSplit: the Main Server alone, with the front's architecture and weights of its own.
        clone = build_model(config.model, classes, dataset_input_shape(config.data), seed=config.seed + ATTACKER_SEED,
                            params=config.model_params).portion(0, cut)
        guessed = attacks.unsplit(clone, fx[:UNSPLIT_SAMPLES], tuple(truth.shape[1:]), low, high,
                                  unsplit_budget(unsplit_rounds), seed=config.seed)
        few = truth[:UNSPLIT_SAMPLES]
        reconstruction[str(cut)] = {
            "round": latest.round_index, "samples": len(truth),
            "ssim": float(ssim(rebuilt, truth).mean()), "psnr": float(psnr(rebuilt, truth).mean()),
            "baseline_ssim": float(ssim(baseline, truth).mean()), "baseline_psnr": float(psnr(baseline, truth).mean()),
            "unsplit_samples": len(few), "unsplit_ssim": float(ssim(guessed, few).mean()),
            "unsplit_psnr": float(psnr(guessed, few).mean())}
        tiles[str(cut)] = [_pixels(truth[:4, 0]), _pixels(rebuilt[:4, 0])]
    return {"label_attacks": labels, "reconstruction": reconstruction, "tiles": tiles}


def _pixels(images: torch.Tensor) -> list:
    """Images in ``[0, 1]`` as 8-bit grey levels (nested lists), what the results keep of a tile."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).tolist()


# --- the part ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """What to run: settings, seeds, rounds, and the population rows' devices."""

    settings: tuple[str, ...] = tuple(SETTINGS)
    seeds: int = SEEDS
    rounds: int = ROUNDS
    epochs: int = EPOCHS
    unsplit_rounds: int = UNSPLIT_ROUNDS
    population: int = POPULATION   # devices of the population rows; 0: none

    @classmethod
    def quick(cls) -> "Selection":
        """``--quick``: plain, U-shaped and the recommended setting, one seed, 2 rounds (cuts 1 and
        2), a shorter-trained inverse network and a shorter UnSplit, no population rows."""
        return cls(settings=QUICK_SETTINGS, seeds=1, rounds=QUICK_ROUNDS, epochs=QUICK_EPOCHS,
                   unsplit_rounds=QUICK_UNSPLIT_ROUNDS, population=0)


def run(selection: Selection, log: Callable[[str], None] = print, time_limit_s: float | None = None) -> dict:
    """Every selected setting under every seed (plain S2FL first, the baseline of each seed's rows),
    then the population rows; the figures and the goals, as a dict (see :func:`report`)."""
    from shared.machine import describe_machine
    from testbed.warm_start import WarmStarter

    settings = (BASELINE, *(s for s in selection.settings if s != BASELINE))
    results: dict = {"machine": describe_machine(), "settings": {
        "devices": DEVICES, "rounds": selection.rounds, "seeds": selection.seeds, "record_steps": RECORD_STEPS,
        "inverse_epochs": selection.epochs, "unsplit_samples": UNSPLIT_SAMPLES,
        "unsplit_budget": asdict(unsplit_budget(selection.unsplit_rounds)),
        "auxiliary": AUXILIARY, "model": "cnn", "data": "2,000 images of the embedded MNIST, Dirichlet 1.0",
        "recommended": RECOMMENDED, "overrides": {s: SETTINGS[s] for s in settings},
        "population": selection.population, "population_data": f"all {TRAIN_IMAGES:,} training images"},
        "goals": {"u_shaped_points": GOAL_U_SHAPED_POINTS, "u_shaped_bytes": GOAL_U_SHAPED_BYTES,
                  "label_auc": GOAL_LABEL_AUC, "label_points": GOAL_LABEL_POINTS,
                  "ssim_fraction": GOAL_SSIM_FRACTION, "recommended_points": GOAL_RECOMMENDED_POINTS},
        "rows": [], "population_rows": [], "tiles": []}
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-j-"))
    warm = WarmStarter()
    started = time.perf_counter()
    runs = [(seed, setting, DEVICES, selection.rounds) for seed in range(1, selection.seeds + 1) for setting in settings]
    runs += [(1, setting, selection.population, population_rounds(selection.rounds, selection.population))
             for setting in POPULATION_SETTINGS if selection.population]
    try:
        baseline: dict | None = None
        for seed, setting, devices, rounds in runs:
            row = run_setting(setting, seed, rounds, root, warm, time_limit_s, selection.epochs,
                              selection.unsplit_rounds, devices)
            tiles = row.pop("tiles")
            if seed == 1 and devices == DEVICES:   # the picture's: one seed's
                results["tiles"] += [{"setting": setting, "cut": cut, "originals": originals,
                                      "reconstructions": rebuilt} for cut, (originals, rebuilt) in tiles.items()]
            if setting == BASELINE:   # each seed's and the population's runs begin with plain
                baseline = row
            assert baseline is not None
            row["points_vs_plain"] = 100 * (row["accuracy"] - baseline["accuracy"])
            row["bytes_vs_plain"] = row["bytes"] / baseline["bytes"]
            results["rows" if devices == DEVICES else "population_rows"].append(row)
            log(f"  {setting} seed {seed}" + (f" at {devices} devices" if devices != DEVICES else "") + f": {_line(row)}")
    finally:
        warm.close()
        shutil.rmtree(root, ignore_errors=True)
    results["total_s"] = time.perf_counter() - started
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["goals_missed"] = goals(results)
    return results


def best_label_attack(row: dict) -> tuple[str, dict] | None:
    """The label attack of ``row`` with the highest AUC (its name and figures), None if none ran."""
    ran = [(name, a) for name, a in row["label_attacks"].items() if a["auc"] == a["auc"]]
    return max(ran, key=lambda item: item[1]["auc"]) if ran else None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def summary(results: dict) -> dict[str, dict]:
    """Each setting's figures, averaged over its seeds."""
    out: dict[str, dict] = {}
    for setting in dict.fromkeys(r["setting"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["setting"] == setting]
        attacks = sorted({name for r in rows for name in r["label_attacks"]})
        cuts = sorted({cut for r in rows for cut in r["reconstruction"]}, key=int)
        out[setting] = {
            "seeds": len(rows), "accuracy": _mean([r["accuracy"] for r in rows]),
            "points_vs_plain": _mean([r["points_vs_plain"] for r in rows]),
            "bytes_vs_plain": _mean([r["bytes_vs_plain"] for r in rows]),
            "bytes": _mean([r["bytes"] for r in rows]),
            "round_s": _mean([r["round_s"] for r in rows if r["round_s"] is not None] or [float("nan")]),
            "label_attacks": {name: {key: _mean([r["label_attacks"][name][key] for r in rows
                                                 if name in r["label_attacks"]])
                                     for key in ("accuracy", "auc", "chance_accuracy")} for name in attacks},
            "reconstruction": {cut: {key: _mean(values) for key in RECONSTRUCTION_FIGURES
                                     if (values := [r["reconstruction"][cut][key] for r in rows
                                                    if key in r["reconstruction"].get(cut, {})])}
                               for cut in cuts}}
    return out


#: A cut's reconstruction figures: the inverse network's, the mean image's, UnSplit's (a result
#: written before UnSplit ran has none).
RECONSTRUCTION_FIGURES = ("ssim", "psnr", "baseline_ssim", "baseline_psnr", "unsplit_ssim", "unsplit_psnr")


def best_ssim(figures: dict) -> float:
    """A cut's best reconstruction SSIM: the inverse network's or UnSplit's, whichever is higher."""
    return max(figures["ssim"], figures.get("unsplit_ssim", float("-inf")))


def unsplit_budget(rounds: int) -> "UnSplitBudget":
    """UnSplit's budget at ``rounds`` alternations (the rest as :class:`UnSplitBudget` has it)."""
    from benchmarks.privacy_attacks import UnSplitBudget

    return UnSplitBudget(rounds=rounds)


def goals(results: dict) -> list[str]:
    """The goals the run missed, each with by how much (empty: all met that the run measured; a
    goal whose settings did not run is named as not measured)."""
    s = summary(results)
    missed: list[str] = []
    u = s.get("u_shaped")
    if u is None:
        missed.append("U-shaped against plain: not measured (u_shaped not run)")
    else:
        if u["points_vs_plain"] < -GOAL_U_SHAPED_POINTS:
            missed.append(f"U-shaped accuracy: {u['points_vs_plain']:+.1f} points vs plain (goal within "
                          f"{GOAL_U_SHAPED_POINTS:g})")
        if u["bytes_vs_plain"] > GOAL_U_SHAPED_BYTES:
            missed.append(f"U-shaped bytes: {u['bytes_vs_plain']:.2f}x plain (goal at most {GOAL_U_SHAPED_BYTES:g}x)")
    r = s.get("recommended")
    if r is None:
        missed.append("recommended setting: not measured (recommended not run)")
        return missed
    best = best_label_attack(r)
    if best is not None:
        name, attack = best
        if attack["auc"] > GOAL_LABEL_AUC:
            missed.append(f"recommended, best label attack ({name}): AUC {attack['auc']:.3f} (goal at most "
                          f"{GOAL_LABEL_AUC:g})")
        over = 100 * (attack["accuracy"] - attack["chance_accuracy"])
        if over > GOAL_LABEL_POINTS:
            missed.append(f"recommended, best label attack ({name}): accuracy {over:+.1f} points over chance "
                          f"(goal at most +{GOAL_LABEL_POINTS:g})")
    plain_cut1 = s[BASELINE]["reconstruction"].get("1")
    shallowest = min(r["reconstruction"], key=int, default=None)
    if plain_cut1 is None or shallowest is None:
        missed.append("recommended reconstruction against plain split 1: not measured (no records at those cuts)")
    else:
        ratio = best_ssim(r["reconstruction"][shallowest]) / best_ssim(plain_cut1)
        if ratio > GOAL_SSIM_FRACTION:
            missed.append(f"recommended, reconstruction SSIM at its shallowest cut ({shallowest}): {ratio:.2f}x plain "
                          f"split 1's, the better attack's at each (goal at most {GOAL_SSIM_FRACTION:g}x)")
    if r["points_vs_plain"] < -GOAL_RECOMMENDED_POINTS:
        missed.append(f"recommended accuracy: {r['points_vs_plain']:+.1f} points vs plain (goal at most "
                      f"{GOAL_RECOMMENDED_POINTS:g} lost)")
    return missed


def _line(row: dict) -> str:
    best = best_label_attack(row)
    shallow = min(row["reconstruction"], key=int, default=None)
    return (f"{row['rounds_completed']}/{row['rounds_planned']} rounds, accuracy {100 * row['accuracy']:.1f}% "
            f"({row['points_vs_plain']:+.1f} vs plain), {row['bytes'] / 1e6:.1f} MB, "
            + (f"best label attack {best[0]} AUC {best[1]['auc']:.3f}, " if best else "")
            + (f"SSIM at cut {shallow} {row['reconstruction'][shallow]['ssim']:.3f}" if shallow else "no reconstruction"))


# --- the table ---------------------------------------------------------------------------------

LABEL_ATTACKS = ("labels", "norm", "direction", "similarity", "head_update", "label_counts")


def _attack_cell(attack: dict | None) -> str:
    if attack is None:
        return "n/a"
    return f"{100 * attack['accuracy']:.0f} % / {attack['auc']:.2f} (chance {100 * attack['chance_accuracy']:.0f} %)"


def table(results: dict) -> list[str]:
    """The settings' table and the reconstruction table as Markdown lines."""
    s = summary(results)
    cuts = sorted({cut for v in s.values() for cut in v["reconstruction"]}, key=int)
    lines = [["setting", "accuracy %", "vs plain (points)", "bytes (MB)", "bytes vs plain", "round s",
              *(f"{a}: acc / AUC" for a in LABEL_ATTACKS)]]
    for name, v in s.items():
        lines.append([name, f"{100 * v['accuracy']:.1f}", f"{v['points_vs_plain']:+.1f}", f"{v['bytes'] / 1e6:.1f}",
                      f"{v['bytes_vs_plain']:.2f}x", f"{v['round_s']:.1f}",
                      *(_attack_cell(v["label_attacks"].get(a)) for a in LABEL_ATTACKS)])
    out = markdown_table(lines)
    out += ["", "Input reconstruction (SSIM / PSNR dB of the inverse network; the auxiliary mean image in brackets):", ""]
    rec = [["setting", *(f"cut {c}" for c in cuts)]]
    for name, v in s.items():
        rec.append([name, *(f"{r['ssim']:.3f} / {r['psnr']:.1f} ({r['baseline_ssim']:.3f} / {r['baseline_psnr']:.1f})"
                            if (r := v["reconstruction"].get(c)) else "n/a" for c in cuts)])
    out += markdown_table(rec)
    if any("unsplit_ssim" in r for v in s.values() for r in v["reconstruction"].values()):
        out += ["", "UnSplit, the Main Server without the front's weights or any data (SSIM / PSNR dB):", ""]
        unsplit = [["setting", *(f"cut {c}" for c in cuts)]]
        for name, v in s.items():
            unsplit.append([name, *(f"{r['unsplit_ssim']:.3f} / {r['unsplit_psnr']:.1f}"
                                    if "unsplit_ssim" in (r := v["reconstruction"].get(c, {})) else "n/a" for c in cuts)])
        out += markdown_table(unsplit)
    return out


def population_table(results: dict) -> list[str]:
    """The population rows' tables (as :func:`table`'s) under a line saying what they ran, then an
    empty line; nothing for a result without them."""
    rows = results.get("population_rows")
    if not rows:
        return []
    st = results["settings"]
    return [f"Population: {rows[0]['devices']} devices, {st['devices']} a round, {rows[0]['rounds_planned']} rounds, seed 1, "
            f"{st.get('population_data', 'the training images')} shared out (Dirichlet 1.0); plain and the recommended "
            "setting only, vs plain at the same population:", "", *table({"rows": rows}), ""]


def report(results: dict) -> str:
    """The part as Markdown: the machine, the runs, the table, the goals and which were missed."""
    m, st = results["machine"], results["settings"]
    out = [f"Machine: {m['cpu_model']}, {m['cpus_usable']} of {m['cpu_count']} CPUs usable, {m['memory_gib']} GiB, "
           f"Python {m['python']}, torch {m['torch']}, {m['date_utc']}, load average {m['load_average_at_start']} "
           f"at the start, {m.get('load_average_at_end')} at the end; {results['total_s'] / 60:.1f} min in all.",
           "",
           f"Runs: S2FL, {st['model']} on {st['data']}, {st['devices']} devices, {st['rounds']} rounds, "
           f"{st['seeds']} seed(s), each device's first {st['record_steps']} steps of every round recorded; "
           f"the inverse network trained on the test set's first {st['auxiliary']} images "
           f"({st['inverse_epochs']} epochs)"
           + (f"; UnSplit on {st['unsplit_samples']} images a cut, {st['unsplit_budget']['rounds']} alternations of "
              f"{st['unsplit_budget']['input_steps']} steps on the images and {st['unsplit_budget']['model_steps']} on "
              "its clone" if "unsplit_budget" in st else "")
           + ". Label attacks: "
           "accuracy / AUC, with the chance accuracy (the most frequent class's share); labels, norm, direction "
           "and similarity per sample, head_update and label_counts per device (its most frequent class).",
           "",
           *table(results), "", *population_table(results),
           f"Goals: U-shaped within {GOAL_U_SHAPED_POINTS:g} point of plain's accuracy at no more than "
           f"{GOAL_U_SHAPED_BYTES:g}x its bytes; the recommended setting: best label attack at most chance + "
           f"{GOAL_LABEL_POINTS:g} points and AUC <= {GOAL_LABEL_AUC:g}, reconstruction SSIM at its shallowest cut "
           f"at most {GOAL_SSIM_FRACTION:g}x plain split 1's (the better attack at each), at most {GOAL_RECOMMENDED_POINTS:g} points of accuracy "
           "lost.", ""]
    missed = results.get("goals_missed", [])
    out += ["Goals missed:", *(f"- {g}" for g in missed)] if missed else ["Every goal measured is met."]
    if results.get("tiles"):
        out += ["", picture_caption(results)]
    return "\n".join(out)


def picture(results: dict, path: Path) -> Path:
    """The reconstructions as a PNG grid: a row per setting and cut (the first seed's, in the
    order of the reconstruction table), four originals, a gap, their four reconstructions."""
    from benchmarks.images import grid, write_png

    rows: list[list[torch.Tensor | None]] = []
    for tile in results["tiles"]:
        originals, rebuilt = (torch.tensor(tile[k], dtype=torch.float64) / 255 for k in ("originals", "reconstructions"))
        rows.append([*originals, None, *rebuilt])
    return write_png(grid(rows), path)


def picture_caption(results: dict) -> str:
    """What each row of :func:`picture` shows, top to bottom."""
    return "Rows of the picture, top to bottom (four originals, then their reconstructions): " + "; ".join(
        f"{t['setting']} at cut {t['cut']}" for t in results["tiles"]) + "."


# --- the command ------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> tuple[Selection, argparse.Namespace]:
    """The command line's selection and the other options."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.privacy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"settings to run, of {','.join(SETTINGS)} (default: all; plain always runs, the baseline)")
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds per setting, 1..N (default {SEEDS})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per run (default {ROUNDS})")
    parser.add_argument("--population", type=int, default=POPULATION,
                        help=f"devices of the population rows: {' and '.join(POPULATION_SETTINGS)} with seed 1 at this "
                             f"many devices, {DEVICES} a round; 0 for none (default {POPULATION})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{','.join(QUICK_SETTINGS)}, one seed, {QUICK_ROUNDS} rounds, no population rows "
                             "(a few minutes)")
    add_name_option(parser, None, "privacy, privacy_quick with --quick")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file; the Markdown and the PNG go beside it "
                             "(default benchmarks/results/<UTC date>_<name>/results.json)")
    args = parser.parse_args(argv)
    if args.quick:
        return Selection.quick(), args
    names = tuple(n.strip() for n in args.settings.split(",") if n.strip())
    unknown = [n for n in names if n not in SETTINGS]
    if not names or unknown:
        parser.error(f"--settings takes a comma-separated subset of {','.join(SETTINGS)}"
                     + (f"; unknown: {','.join(unknown)}" if unknown else ""))
    if args.seeds < 1 or args.rounds < 1:
        parser.error("--seeds and --rounds must be at least 1")
    if args.population != 0 and args.population <= DEVICES:
        parser.error(f"--population must be 0 (none) or more than the {DEVICES} devices of a round")
    return Selection(names, args.seeds, args.rounds, population=args.population), args


def save(results: dict, out: Path) -> tuple[Path, Path]:
    """The results as JSON and Markdown at ``out``, the picture beside them: the Markdown's and the
    picture's paths."""
    markdown = write(results, out, report)
    return markdown, picture(results, out.with_name(out.stem.replace("results", "reconstructions") + ".png"))


def main(argv: list[str] | None = None) -> int:
    selection, args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run(selection, lambda text: print(text, flush=True))
    print()
    print(report(results))
    out = args.out or default_out(results["machine"]["date_utc"], args.name or ("privacy_quick" if args.quick else "privacy"))
    markdown, png = save(results, out)
    print(f"\nresults: {out}, {markdown}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
