"""(j) The scenario benchmark: does the sliding split follow a fleet that changes mid-run?

Four scenarios, each a real testbed run through the services (Fed Server, Main Server, one device
agent process per device) of three devices, S2FL with its default (estimated) warm-up:

- ``link_drop``: the High device's link drops tenfold after round D;
- ``link_recovery``: the High device's link is a tenth of its kind's from the start and recovers
  after round D;
- ``compute_halves``: the Mid device's compute speed halves after round D (an emulated kind change);
- ``fast_device``: two devices 20 times slower than the third, in compute and link, all run long.

Links are shaped (the real-links mode, docs/real-links.md: each agent in its own network namespace
behind a tbf link, changed with ``tc`` mid-run) where this machine can make them (Linux, root,
iproute2), and emulated by sleeps otherwise (``--links emulated``, or ``auto`` where it cannot; the
results say which, and why). Compute is emulated either way (docs/s2fl.md, "Heterogeneous
devices"): each agent is ``python -m benchmarks.scenario_agent``, the device agent whose kind's
speeds the benchmark changes by a signal. A change lands while round D + 1 runs: the benchmark
applies it when the Fed Server reports round D.

Per scenario, the same scenario is run again with the best fixed split per device in hindsight
(``split.pinned``), chosen from the sliding run's own time table and its devices' upload times,
on the round's critical path that the time table's bottleneck cap uses (:func:`best_fixed`):
trying every assignment would take 27 runs per scenario. Per run and device: the split of each round it was
selected in and whether it uploaded, the rounds it lost to its change, and the time to the sliding
run's final accuracy. Each scenario runs with :data:`SEEDS` seeds (``--seeds N``), sliding and
pinned at each. Goals (printed beside the figures, missed ones named): no device loses more than
:data:`GOAL_LOST_ROUNDS` rounds to a change of its link or speed, at any seed, and the sliding run
reaches its final accuracy within :data:`GOAL_TIME_RATIO` times the time the pinned run takes to
reach it, the median over the seeds.
Beside the scenarios, the warm-up comparison: the ``fast_device`` fleet run again with the other
``split.warm_up`` (the paper's ``every_split`` against the default ``estimated``): the time of the
warm-up's rounds and the splits chosen after them.

``python -m benchmarks.scenarios [--quick] [--seeds N] [--scenarios a,b] [--links auto|real|emulated] [--patience P] [--paper-rule] [--warm-up every_split|estimated] [--docs docs/s2fl.md]``
prints the table and writes ``benchmarks/results/<UTC date>_scenarios/results.json`` and
``results.md`` (rewritten after every run); ``--docs PAGE`` writes the table into PAGE between its
scenario-table markers. ``python -m benchmarks.run --only j`` runs the same part.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from benchmarks.result_files import add_name_option, default_out, finish, replace_between, write
from fed_server.time_table import critical_path, warm_up_rounds

#: Rounds of a run, and the round after which a mid-run change lands (after the warm-up, the
#: paper's 3 rounds or the estimated one's 1, rounds the median rule decides, before the change).
ROUNDS, CHANGE_AFTER = 16, 7
QUICK_ROUNDS, QUICK_CHANGE_AFTER = 8, 4
#: Seeds each scenario runs with (``seed`` and ``data.seed``: the model's initial weights, the
#: devices' samples and their order): at 100 samples a device the accuracy moves by up to 18
#: points a round, so one seed's time to its final accuracy can hinge on one round's noise, and
#: the time goal is judged on the median over the seeds. Seed 1 is the single run of earlier tables.
SEEDS, QUICK_SEEDS = 3, 1
#: The paper's warm-up: one round per split candidate of the cnn.
WARM_UP_ROUNDS = 3
# The goals printed beside the figures.
GOAL_LOST_ROUNDS = 2     # rounds a device may go without an upload after a change of its link or speed
GOAL_TIME_RATIO = 1.2    # sliding run's time to its final accuracy over the best fixed split's
#: ``deadlines.patience`` of every run: a device's own deadline is this many times the slowest other
#: device's time (plus a second), tight so that a device that slowed down is cut rather than waited for.
PATIENCE = 1.2
#: The fleet's transfers: the shaped-links claims' settings (docs/real-links.md), links at the
#: kinds' rates x 1.5, 2 ms of round trip per request on shaped links.
TIME_SCALE = 1.5
RTT_MS = 2.0
LINK_MODES = ("auto", "real", "emulated")


@dataclass(frozen=True)
class Speeds:
    """Multipliers of a device's emulated kind: its compute speed and its link rate."""

    compute: float = 1.0
    link: float = 1.0


@dataclass(frozen=True)
class Change:
    """Device ``device`` runs at ``speeds`` from round ``after_round + 1`` on (0: from the start)."""

    after_round: int
    device: int
    speeds: Speeds


@dataclass(frozen=True)
class Scenario:
    """A fleet (its kinds, one device each) and what changes in it."""

    name: str
    what: str
    profiles: tuple[str, ...]
    changes: tuple[Change, ...]

    def speeds(self, device: int, round_: int) -> Speeds:
        """The speeds ``device`` runs at in round ``round_``: the latest of its changes before it."""
        current = Speeds()
        for change in sorted(self.changes, key=lambda c: c.after_round):
            if change.device == device and change.after_round < round_:
                current = change.speeds
        return current

    def phases(self, rounds: int) -> list[tuple[int, int]]:
        """The runs of rounds ``(first, last)`` in 1..``rounds`` within which no device's speeds change."""
        cuts = sorted({c.after_round for c in self.changes if 1 <= c.after_round < rounds})
        starts = [1, *(c + 1 for c in cuts)]
        return [(first, last) for first, last in zip(starts, [*(c for c in cuts), rounds])]

    def judged(self, rounds: int, warm_up: int = WARM_UP_ROUNDS) -> list[tuple[int, int, int]]:
        """``(device, first, last)``: the rounds in which each change's device is judged on the
        rounds it lost to the change: from the change to the device's next change or the run's end;
        a change from the start is judged after the warm-up, whose rounds try every split."""
        windows = []
        for change in self.changes:
            later = [c.after_round for c in self.changes if c.device == change.device and c.after_round > change.after_round]
            first = change.after_round + 1 if change.after_round >= 1 else warm_up + 1
            last = min(later) if later else rounds
            if first <= last:
                windows.append((change.device, first, last))
        return windows


def scenarios(change_after: int) -> tuple[Scenario, ...]:
    """The four scenarios, their mid-run changes after round ``change_after``."""
    fleet = ("low", "mid", "high")
    slow = Speeds(compute=0.5)   # a Low kind's compute stretch of 10, doubled
    # 10 x a Low kind's compute speed: stretch 1, this machine's own speed; and 20 x its link rate.
    fast = Speeds(compute=10.0, link=20.0)
    return (
        Scenario("link_drop", "High's link drops 10x after round D", fleet,
                 (Change(change_after, 2, Speeds(link=0.1)),)),
        Scenario("link_recovery", "High's link at 1/10 from the start, recovers after round D", fleet,
                 (Change(0, 2, Speeds(link=0.1)), Change(change_after, 2, Speeds()))),
        Scenario("compute_halves", "Mid's compute speed halves after round D", fleet,
                 (Change(change_after, 1, Speeds(compute=0.5)),)),
        Scenario("fast_device", "two devices 20x slower than the third, compute and link", ("low", "low", "low"),
                 (Change(0, 0, slow), Change(0, 1, slow), Change(0, 2, fast))),
    )


SCENARIO_NAMES = tuple(s.name for s in scenarios(CHANGE_AFTER))
#: The fleet of the warm-up comparison: the slow boards the paper's warm-up costs most.
WARM_UP_FLEET = "fast_device"


def device_id(index: int) -> str:
    """The id the testbed's agent gives device (shard) ``index``."""
    return f"dev-{index:03d}"


# --- what a run recorded ------------------------------------------------------------------------

def rounds_of(records: Sequence[Mapping]) -> list[dict]:
    """Per logical round, its last successful attempt's figures: round, elapsed and round time,
    accuracy, the split of every selected device, who uploaded, and the time-table entries."""
    last: dict[int, Mapping] = {}
    for record in records:
        if record["status"] == "ok":
            last[record["round"]] = record
    return [{"round": r["round"], "elapsed_s": r["elapsed_s"], "round_time_s": r["round_time_s"],
             "accuracy": r["test_accuracy"], "splits": dict(r["split_points"]), "uploaded": sorted(r["aggregated"]),
             "times": dict(r["table_times"]), "uploads": upload_seconds(r)} for _, r in sorted(last.items())]


def upload_seconds(record: Mapping) -> dict[str, float]:
    """Per uploading device, the seconds its upload took to reach the Fed Server: its table time
    less the parts the device timed itself (compute, transfer, the Main Server's steps)."""
    out = {}
    for device, timings in record.get("device_times", {}).items():
        if device in record["table_times"]:
            own = timings["compute_s"] + timings["transfer_s"] + timings["server_s"]
            out[device] = max(0.0, record["table_times"][device] - own)
    return out


def lost_rounds(rounds: Sequence[Mapping], device: str, first: int, last: int) -> list[int]:
    """The rounds in ``first..last`` in which ``device`` made no upload (not selected, cut, sat out,
    or a round with no successful attempt)."""
    uploaded = {r["round"] for r in rounds if device in r["uploaded"]}
    return [n for n in range(first, last + 1) if n not in uploaded]


def time_to(rounds: Sequence[Mapping], target: float) -> float | None:
    """Seconds from the run's start to the end of its first round at ``target`` accuracy or above."""
    for r in rounds:
        if r["accuracy"] is not None and r["accuracy"] >= target:
            return float(r["elapsed_s"])
    return None


def split_line(rounds: Sequence[Mapping], device: str) -> str:
    """``device``'s split in each round, ``x`` after it where it was cut, ``-`` where not selected."""
    cells = []
    for r in rounds:
        split = r["splits"].get(device)
        cells.append("-" if split is None else f"{split}{'' if device in r['uploaded'] else 'x'}")
    return " ".join(cells)


Cells = dict[str, dict[int, float]]   # device -> split -> seconds


def _medians(rounds: Sequence[Mapping], first: int, last: int, field: str) -> Cells:
    """Per device and split, the median of the device's ``field`` figures in rounds ``first..last``
    where it uploaded."""
    measured: dict[str, dict[int, list[float]]] = {}
    for r in rounds:
        if first <= r["round"] <= last:
            for device, split in r["splits"].items():
                if device in r["uploaded"] and device in r.get(field, {}):
                    measured.setdefault(device, {}).setdefault(split, []).append(r[field][device])
    return {d: {k: statistics.median(v) for k, v in splits.items()} for d, splits in measured.items()}


def phase_cells(rounds: Sequence[Mapping], first: int, last: int) -> Cells:
    """Per device and split, its time in rounds ``first..last`` as the time table measured it (the
    median of its entries); a split it was cut at and never uploaded from in those rounds is
    infinite (it did not fit the round)."""
    cells = _medians(rounds, first, last, "times")
    for r in rounds:
        if first <= r["round"] <= last:
            for device, split in r["splits"].items():
                if device not in r["uploaded"]:
                    cells.setdefault(device, {}).setdefault(split, float("inf"))
    return cells


def phase_uploads(rounds: Sequence[Mapping], first: int, last: int) -> Cells:
    """Per device and split, the seconds its upload took in rounds ``first..last`` (the median):
    its portion's one way on its link, which the critical path of :func:`best_fixed` counts."""
    return _medians(rounds, first, last, "uploads")


def fill_from_other_phases(phases: Sequence[Cells]) -> list[Cells]:
    """Each phase's cells, a device's missing split priced from another phase where both it and a
    split measured in this one were measured: ``t_p(k) = t_q(k) · t_p(j) / t_q(j)`` (the device
    changed by the same ratio at every split; the first such pair in phase order)."""
    filled = [{d: dict(s) for d, s in cells.items()} for cells in phases]
    for p, cells in enumerate(phases):
        for device, splits in cells.items():
            for q, other in enumerate(phases):
                theirs = other.get(device, {})
                shared = [j for j in splits if j in theirs and 0 < splits[j] < float("inf") and 0 < theirs[j] < float("inf")]
                if q == p or not shared:
                    continue
                j = shared[0]
                for k, t in theirs.items():
                    filled[p][device].setdefault(k, t * splits[j] / theirs[j])
    return filled


def best_fixed(phases: Sequence[Cells], lengths: Sequence[int], candidates: Sequence[int],
               uploads: Sequence[Cells] | None = None) -> dict[str, int]:
    """The split per device that minimises the run's time over its phases, ``Σ_p rounds_p ·
    path_p(k)``, from the cells of :func:`fill_from_other_phases`; a split with no price in a
    phase counts as infinite. A round's critical path is the time table's (docs/s2fl.md, the
    bottleneck cap): its group meets at a barrier every step, so the slowest portion download
    comes before every step and the slowest upload after them
    (:func:`fed_server.time_table.critical_path`), with each device's upload seconds at its split
    (``uploads``, filled as the cells; 0 where not measured: then the slowest device's time). Ties go to the deeper splits (less work
    for the Main Server), as the median rule's do."""
    devices = sorted({d for cells in phases for d in cells})
    if not devices:
        raise ValueError("no device has a time-table entry to choose a fixed split from")
    edges = list(uploads) if uploads is not None else [{} for _ in phases]

    def path(cells: Cells, edge: Cells, assignment: tuple[int, ...]) -> float:
        times = [cells.get(d, {}).get(k, math.inf) for d, k in zip(devices, assignment)]
        if math.inf in times:
            return math.inf
        return critical_path((t, edge.get(d, {}).get(k, 0.0)) for t, d, k in zip(times, devices, assignment))

    def cost(assignment: tuple[int, ...]) -> float:
        return sum(n * path(cells, edge, assignment) for cells, edge, n in zip(phases, edges, lengths))

    best = min(itertools.product(sorted(candidates), repeat=len(devices)),
               key=lambda a: (cost(a), tuple(-k for k in a)))
    return dict(zip(devices, best))


def choose_pinned(rounds: Sequence[Mapping], scenario: Scenario, total_rounds: int,
                  candidates: Sequence[int]) -> dict[str, int]:
    """The best fixed split per device in hindsight from the sliding run's own time table."""
    phases = scenario.phases(total_rounds)
    cells = fill_from_other_phases([phase_cells(rounds, a, b) for a, b in phases])
    uploads = fill_from_other_phases([phase_uploads(rounds, a, b) for a, b in phases])
    return best_fixed(cells, [b - a + 1 for a, b in phases], candidates, uploads)


def judge(runs: Mapping, judged: Sequence[Sequence[int]]) -> dict:
    """One seed's goal figures: the rounds each changed device lost in its ``judged`` window
    ``(device, first, last)``, and the sliding run's time to its own final accuracy over the pinned
    run's time to it (None where the pinned run never got there: the sliding run was the faster)."""
    sliding, pinned = runs["sliding"]["rounds"], runs["pinned"]["rounds"]
    lost = [{"device": device_id(d), "first": a, "last": b, "rounds": lost_rounds(sliding, device_id(d), a, b)}
            for d, a, b in judged]
    final = sliding[-1]["accuracy"] if sliding else None
    mine = time_to(sliding, final) if final is not None else None
    theirs = time_to(pinned, final) if final is not None else None
    return {"lost": lost, "target_accuracy": final, "sliding_time_s": mine, "pinned_time_s": theirs,
            "time_ratio": mine / theirs if mine is not None and theirs else None}


def median_ratio(ratios: Sequence[float | None]) -> float | None:
    """The time goal's figure over a scenario's seeds: the median of their time ratios, the higher
    of the middle two for an even count; a seed whose pinned run never reached the sliding run's
    final accuracy (None) counts below every ratio, and None is returned where it is the median."""
    if not ratios:
        return None
    ordered = sorted(ratios, key=lambda r: -math.inf if r is None else r)
    return ordered[len(ordered) // 2]


def time_ratio(seeds: Sequence[Mapping]) -> float | None:
    """A scenario's time goal figure: :func:`median_ratio` over its seeds whose sliding run
    recorded an accuracy (each seed with its :func:`judge` figures as ``goals``)."""
    return median_ratio([e["goals"]["time_ratio"] for e in seeds if e["goals"]["sliding_time_s"] is not None])


def goals_missed(seeds: Sequence[Mapping]) -> list[str]:
    """The goals a scenario's seeds (each with its :func:`judge` figures as ``goals``) miss, each
    named with its figure: a device that lost too many rounds at any seed, a seed whose sliding run
    recorded no accuracy, and the median time ratio over the seeds."""
    missed = []
    for entry in seeds:
        g = entry["goals"]
        for lost in g["lost"]:
            if len(lost["rounds"]) > GOAL_LOST_ROUNDS:
                missed.append(f"seed {entry['seed']}: {lost['device']} lost {len(lost['rounds'])} rounds "
                              f"(goal <= {GOAL_LOST_ROUNDS})")
        if g["sliding_time_s"] is None:
            missed.append(f"seed {entry['seed']}: the sliding run recorded no accuracy")
    ratio = time_ratio(seeds)
    if ratio is not None and ratio > GOAL_TIME_RATIO:
        missed.append(f"time to accuracy {ratio:.2f}x the best fixed split's, the median over {len(seeds)} "
                      f"seeds (goal <= {GOAL_TIME_RATIO}x)")
    return missed


def warm_up_figures(every: Sequence[Mapping], estimated: Sequence[Mapping], warm_up: int = WARM_UP_ROUNDS) -> dict:
    """The warm-up comparison: each run's time in the warm-up's rounds (1..``warm_up``), the time
    saved, and each run's time to the paper-warm-up run's final accuracy."""
    spent = [sum(r["round_time_s"] for r in run if r["round"] <= warm_up) for run in (every, estimated)]
    final = every[-1]["accuracy"] if every else None
    return {"warm_up_s": spent[0], "estimated_warm_up_s": spent[1], "saved_s": spent[0] - spent[1],
            "target_accuracy": final,
            "time_to_target_s": time_to(every, final) if final is not None else None,
            "estimated_time_to_target_s": time_to(estimated, final) if final is not None else None}


# --- the runs -----------------------------------------------------------------------------------

def links_problem(mode: str) -> str | None:
    """Why shaped links are not used for ``mode`` on this machine (None: they are)."""
    if mode == "emulated":
        return "emulated links asked for (--links emulated)"
    from testbed.links import problem_here

    problem = problem_here()
    if problem is not None and mode == "real":
        raise SystemExit(f"--links real: {problem}")
    return problem


def run_config(scenario: Scenario, rounds: int, warm_up: str = "estimated", pinned: Mapping[str, int] | None = None,
               patience: float = PATIENCE, paper_rule: bool = False, seed: int = 1):
    """The run of ``scenario`` at ``seed`` (the model's and the data's): the shaped-links claims'
    fleet (docs/real-links.md), one device of each kind, 100 IID samples each, every device in one
    group, deadlines at ``patience`` times the slowest other device's time (``deadlines.patience``),
    the median rule with its bottleneck cap and without dominated splits, or (``paper_rule``) as
    the paper writes it."""
    from shared.run_config import load_run_config

    return load_run_config({
        "algorithm": "s2fl", "rounds": rounds, "seed": seed,
        "data": {"num_devices": len(scenario.profiles), "partition": "iid", "seed": seed,
                 "max_samples": 100 * len(scenario.profiles)},
        "train": {"lr": 0.05, "batch_size": 64},
        "grouping": {"group_size": len(scenario.profiles)},
        "deadlines": {"round_s": 120, "join_s": 20, "step_s": 20, "patience": patience},
        "devices": {"profiles": list(scenario.profiles), "time_scale": TIME_SCALE},
        "split": {"warm_up": warm_up, "pinned": dict(pinned or {}), "bottleneck_cap": not paper_rule,
                  "undominated": not paper_rule},
    })


def _scenario_testbed(config, run_dir: Path, scenario: Scenario, real_links: bool):
    """A testbed whose agents are :mod:`benchmarks.scenario_agent` processes at the scenario's
    starting speeds, with :meth:`apply` changing a device's speeds mid-run."""
    from shared.profiles import parse_kind
    from testbed.runner import Testbed

    class ScenarioTestbed(Testbed):
        def base_rate(self, device: int) -> float:
            return parse_kind(self._kind(device)).rate * TIME_SCALE

        def start_agent(self, name, shards=None, data=None, index=0, module="device_agent", extra=()):
            device = (shards or [0])[0]
            speeds = scenario.speeds(device, 1)
            if self.network is not None:
                self.network.set_rate(device, self.base_rate(device) * speeds.link)
            return super().start_agent(name, shards, data, index, "benchmarks.scenario_agent", [
                "--compute-speed", str(speeds.compute), "--link-speed", str(1.0 if self.network else speeds.link),
                "--change-file", str(self.change_file(device)), *extra])

        def change_file(self, device: int) -> Path:
            return self.run_dir / f"speeds-{device}.json"

        def apply(self, change: Change) -> None:
            """Change a device's speeds now: its shaped link with tc, its emulated speeds by signal."""
            speeds = change.speeds
            if self.network is not None:
                self.network.set_rate(change.device, self.base_rate(change.device) * speeds.link)
            self.change_file(change.device).write_text(json.dumps(
                {"compute": speeds.compute, "link": 1.0 if self.network is not None else speeds.link}))
            self.agent_services[change.device].process.send_signal(signal.SIGUSR1)

    return ScenarioTestbed(config, run_dir, log_level="WARNING", agent_per_device=True, real_links=real_links,
                           rtt_ms=RTT_MS if real_links else 0.0)


def run_once(scenario: Scenario, config, run_dir: Path, real_links: bool) -> dict:
    """One run of ``scenario`` under ``config``: its rounds (:func:`rounds_of`), failed attempts,
    and why it stopped early (None when it finished)."""
    from fed_server.run_dir import RunDirectory
    from testbed.runner import TestbedError

    testbed = _scenario_testbed(config, run_dir, scenario, real_links)
    applied: set[Change] = set()
    error = None

    def on_round(record, status) -> None:
        for change in scenario.changes:
            if change.after_round == record.round and change not in applied:
                testbed.apply(change)
                applied.add(change)

    try:
        with testbed:
            testbed.follow(on_round=on_round, timeout=config.rounds * config.deadlines.round_s + 120)
    except (TestbedError, TimeoutError, RuntimeError) as exc:
        error = str(exc).splitlines()[0]
    records = RunDirectory(run_dir).read_metrics()
    return {"rounds": rounds_of(records), "failed_attempts": sum(r["status"] != "ok" for r in records),
            "error": error}


def run(quick: bool = False, log: Callable[[str], None] = print, names: Sequence[str] = SCENARIO_NAMES,
        links: str = "auto", progress: Callable[[dict], object] | None = None, patience: float = PATIENCE,
        paper_rule: bool = False, warm_up: str = "estimated", seeds: int | None = None) -> dict:
    """Every scenario of ``names`` run sliding and pinned at each of ``seeds`` seeds (1, 2, ...;
    default :data:`SEEDS`, or :data:`QUICK_SEEDS` when ``quick``) at ``deadlines.patience``
    ``patience``, with the median rule's extensions or (``paper_rule``) without, the sliding runs
    with ``split.warm_up`` ``warm_up``, and the warm-up comparison (the other warm-up's sliding run
    at the first seed) where :data:`WARM_UP_FLEET` is among them; the results (see the module's
    docstring)."""
    from shared import machine
    from shared.models import build_model

    rounds, change_after = (QUICK_ROUNDS, QUICK_CHANGE_AFTER) if quick else (ROUNDS, CHANGE_AFTER)
    seeds = seeds or (QUICK_SEEDS if quick else SEEDS)
    problem = links_problem(links)
    real = problem is None
    if problem:
        log(f"links emulated by sleeps, not shaped: {problem}")
    candidates = list(build_model("cnn").split_points)
    results: dict = {"mode": "quick" if quick else "full", "machine": machine.describe_machine(),
                     "settings": {"rounds": rounds, "change_after": change_after, "links": "real" if real else "emulated",
                                  "links_note": problem, "patience": patience, "paper_rule": paper_rule,
                                  "warm_up": warm_up, "seeds": seeds,
                                  "time_scale": TIME_SCALE, "rtt_ms": RTT_MS if real else 0.0,
                                  "goal_lost_rounds": GOAL_LOST_ROUNDS, "goal_time_ratio": GOAL_TIME_RATIO},
                     "scenarios": [], "warm_up": None}
    started = time.perf_counter()
    chosen = [s for s in scenarios(change_after) if s.name in names]
    with tempfile.TemporaryDirectory(prefix="scenarios-") as tmp:
        for scenario in chosen:
            judged = scenario.judged(rounds, warm_up_rounds(warm_up, len(candidates)))
            entry: dict = {"name": scenario.name, "what": scenario.what.replace("round D", f"round {change_after}"),
                           "profiles": list(scenario.profiles), "changes": [asdict(c) for c in scenario.changes],
                           "judged": judged, "seeds": []}
            results["scenarios"].append(entry)
            # Every run of the scenario at the invocation's patience and rule.
            config = partial(run_config, scenario, rounds, patience=patience, paper_rule=paper_rule)
            for seed in range(1, seeds + 1):
                at = Path(tmp) / f"{scenario.name}-{seed}"
                log(f"{scenario.name}, seed {seed}: sliding split")
                runs = {"sliding": run_once(scenario, config(warm_up=warm_up, seed=seed), Path(f"{at}-sliding"), real)}
                pinned = choose_pinned(runs["sliding"]["rounds"], scenario, rounds, candidates)
                log(f"{scenario.name}, seed {seed}: pinned {pinned}")
                runs["pinned"] = run_once(scenario, config(pinned=pinned, seed=seed), Path(f"{at}-pinned"), real)
                entry["seeds"].append({"seed": seed, "pinned": pinned, "runs": runs, "goals": judge(runs, judged)})
                entry["time_ratio"] = time_ratio(entry["seeds"])
                entry["goals_missed"] = goals_missed(entry["seeds"])
                results["total_s"] = time.perf_counter() - started
                if progress is not None:
                    progress(results)
            if scenario.name == WARM_UP_FLEET:
                other = "every_split" if warm_up == "estimated" else "estimated"
                log(f"{scenario.name}, seed 1: sliding split, split.warm_up {other}")
                compared = {warm_up: entry["seeds"][0]["runs"]["sliding"],
                            other: run_once(scenario, config(warm_up=other), Path(tmp) / f"{scenario.name}-{other}", real)}
                results["warm_up"] = {"fleet": scenario.name, **compared,
                                      **warm_up_figures(compared["every_split"]["rounds"], compared["estimated"]["rounds"])}
                results["total_s"] = time.perf_counter() - started
                if progress is not None:
                    progress(results)
    results["total_s"] = time.perf_counter() - started
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


# --- the table ----------------------------------------------------------------------------------

def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _markdown(lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])] + [
        "| " + " | ".join(line) + " |" for line in lines[1:]]


def _ratio(value: float | None) -> str:
    return "pinned never got there" if value is None else f"{value:.2f}x"


def summary_table(results: dict) -> list[str]:
    """One row per scenario and seed: the pinned splits, the rounds each changed device lost, the
    final accuracy, each run's time to it and whole time, and the goals, judged over the seeds."""
    rows = [["scenario", "seed", "pinned (best fixed split)", "lost rounds (sliding)", "final accuracy",
             "s to it: sliding / pinned", "time ratio", "whole runs, s: sliding / pinned", "goals"]]
    for entry in results["scenarios"]:
        missed = entry["goals_missed"]
        verdict = f"median time ratio {_ratio(entry['time_ratio'])}: " + ("met" if not missed else "missed: " + "; ".join(missed))
        for i, seeded in enumerate(entry["seeds"]):
            g, runs = seeded["goals"], seeded["runs"]
            lost = "; ".join(f"{e['device']}: {len(e['rounds'])} of rounds {e['first']}-{e['last']}" for e in g["lost"])
            whole = [_seconds(runs[k]["rounds"][-1]["elapsed_s"] if runs[k]["rounds"] else None) for k in ("sliding", "pinned")]
            rows.append([entry["name"] if i == 0 else "", str(seeded["seed"]),
                         " ".join(f"{d}: {k}" for d, k in sorted(seeded["pinned"].items())), lost or "none judged",
                         _percent(g["target_accuracy"]),
                         f"{_seconds(g['sliding_time_s'])} / {_seconds(g['pinned_time_s'])}", _ratio(g["time_ratio"]),
                         " / ".join(whole),
                         verdict if i == 0 else ""])
    return _markdown(rows)


def splits_table(results: dict, seeds: Sequence[int] | None = None) -> list[str]:
    """One row per scenario, seed (those of ``seeds``; every seed by default), run and device: its
    split in each round, with the final accuracy of each run."""
    rows = [["scenario", "seed", "run", "device", "splits, rounds 1..n (x: cut, -: not selected)", "final accuracy"]]
    for entry in results["scenarios"]:
        first_row = True
        for seeded in entry["seeds"]:
            if seeds is not None and seeded["seed"] not in seeds:
                continue
            for run_name in ("sliding", "pinned"):
                run_ = seeded["runs"][run_name]
                devices = sorted({d for r in run_["rounds"] for d in r["splits"]})
                for i, device in enumerate(devices):
                    rows.append([entry["name"] if first_row else "", str(seeded["seed"]) if i == 0 and run_name == "sliding" else "",
                                 run_name if i == 0 else "", device, split_line(run_["rounds"], device),
                                 _percent(run_["rounds"][-1]["accuracy"] if run_["rounds"] else None) if i == 0 else ""])
                    first_row = False
    return _markdown(rows)


def table(results: dict, seeds: Sequence[int] | None = None) -> list[str]:
    """The scenario tables as Markdown lines: the goals over every seed, the splits round by round
    at ``seeds`` (every seed by default), the warm-up comparison and any run's failed attempts."""
    lines = [*summary_table(results), "", "Splits round by round" +
             (f" (seed {', '.join(map(str, seeds))}; every seed's in the results file):" if seeds else ":"), "",
             *splits_table(results, seeds)]
    w = results.get("warm_up")
    if w:
        lines += ["", f"Warm-up ({w['fleet']} fleet, seed 1): rounds 1-{WARM_UP_ROUNDS} took {w['warm_up_s']:.1f} s "
                      f"with the paper's warm-up (`every_split`) and {w['estimated_warm_up_s']:.1f} s with `estimated` "
                      f"({w['saved_s']:.1f} s saved); time to {_percent(w['target_accuracy'])}: "
                      f"{_seconds(w['time_to_target_s'])} s against {_seconds(w['estimated_time_to_target_s'])} s.", ""]
        devices = sorted({d for r in w["every_split"]["rounds"] for d in r["splits"]})
        lines += _markdown([["warm-up", *devices],
                            *[[name, *(split_line(w[name]["rounds"], d) for d in devices)]
                              for name in ("every_split", "estimated")]])
    for name, run_ in [(f"{e['name']} seed {x['seed']} {k}", v) for e in results["scenarios"] for x in e["seeds"]
                       for k, v in x["runs"].items()]:
        if run_["error"] or run_["failed_attempts"]:
            lines.append(f"\n{name}: {run_['failed_attempts']} failed attempts" +
                         (f"; stopped early: {run_['error']}" if run_["error"] else ""))
    return lines


def report(results: dict, seeds: Sequence[int] | None = None) -> str:
    """The human-readable summary: the machine, the links used and the tables (the splits round by
    round at ``seeds``, every seed by default)."""
    m, s = results["machine"], results["settings"]
    links = ("shaped (real links)" if s["links"] == "real" else f"emulated by sleeps: {s['links_note']}")
    return "\n".join([
        f"machine: {m['cpu_model']}, {m['cpus_usable']} of {m['cpu_count']} CPUs usable, {m['date_utc']}, "
        f"load average {m['load_average_at_start']} at the start, {m.get('load_average_at_end')} at the end",
        f"mode: {results['mode']}, {s['rounds']} rounds, changes after round {s['change_after']}, "
        f"{s['seeds']} seed{'s' if s['seeds'] != 1 else ''} a scenario, links {links}, "
        f"deadlines.patience {s['patience']:g}, "
        f"{'split.bottleneck_cap and split.undominated false (the paper rule as written), ' if s.get('paper_rule') else ''}"
        f"split.warm_up {s.get('warm_up', 'every_split')}, "
        f"total {results.get('total_s', 0.0) / 60:.1f} min",
        f"goals: no changed device loses more than {s['goal_lost_rounds']} rounds at any seed; time to the sliding "
        f"run's final accuracy at most {s['goal_time_ratio']}x the best fixed split's (pinned from the sliding run's "
        f"time table), the median over the seeds",
        "", *table(results, seeds)])


#: Where a docs page holds the table :func:`update_docs` writes.
DOCS_BEGIN = "<!-- scenario table: written by python -m benchmarks.scenarios --docs; do not edit by hand -->"
DOCS_END = "<!-- end of scenario table -->"


def update_docs(results: dict, page: Path, results_file: Path) -> None:
    """Write the report of ``results`` into ``page`` between :data:`DOCS_BEGIN` and :data:`DOCS_END`
    (the splits round by round at the first seed only), with a link to ``results_file``;
    ValueError when the page has no such place."""
    link = os.path.relpath(results_file.resolve(), page.resolve().parent)
    lines = report(results, seeds=[1] if results["settings"]["seeds"] > 1 else None).splitlines()
    body = [f"Measured: {lines[0].removeprefix('machine: ')}; {lines[1].removeprefix('mode: ')} "
            f"([{Path(link).parent.name}/]({link}))", "", lines[2], *lines[3:]]
    page.write_text(replace_between(page.read_text(), DOCS_BEGIN, DOCS_END, body))


# --- the command --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scenarios", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_ROUNDS} rounds a run, changes after round {QUICK_CHANGE_AFTER} "
                             f"(default {ROUNDS} and {CHANGE_AFTER})")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds a scenario runs with, sliding and pinned at each (default {SEEDS}, "
                             f"{QUICK_SEEDS} with --quick); the time goal is judged on the median over them")
    parser.add_argument("--scenarios", default=",".join(SCENARIO_NAMES),
                        help=f"comma-separated subset of {','.join(SCENARIO_NAMES)} (default: all)")
    parser.add_argument("--links", choices=LINK_MODES, default="auto",
                        help="real: shaped links (Linux, root, iproute2); emulated: sleeps; auto (default): real "
                             "where this machine can make them")
    parser.add_argument("--docs", type=Path, default=None, metavar="PAGE",
                        help="also write the table into PAGE (docs/s2fl.md) between its scenario-table markers")
    parser.add_argument("--patience", type=float, default=PATIENCE,
                        help=f"deadlines.patience of every run: a device's own deadline over the slowest other "
                             f"device's time (at least 1; default {PATIENCE:g})")
    parser.add_argument("--paper-rule", action="store_true",
                        help="every run with split.bottleneck_cap and split.undominated false: the paper's median "
                             "rule as written")
    parser.add_argument("--warm-up", choices=("every_split", "estimated"), default="estimated",
                        help="split.warm_up of the sliding runs (default estimated, the run config's default; "
                             "every_split: the paper's); the warm-up comparison runs the other one")
    add_name_option(parser, None, "scenarios, or scenarios_quick with --quick")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file; the Markdown table goes beside it with .md "
                             "(default benchmarks/results/<UTC date>_<name>/results.json)")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.scenarios.split(",") if n.strip())
    unknown = [n for n in names if n not in SCENARIO_NAMES]
    if not names or unknown:
        parser.error(f"--scenarios takes a comma-separated subset of {','.join(SCENARIO_NAMES)}"
                     + (f"; unknown: {','.join(unknown)}" if unknown else ""))
    args.scenarios = names
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.patience < 1:
        parser.error(f"--patience must be at least 1 (a device's own deadline is never below its peers' time), "
                     f"got {args.patience:g}")
    if args.docs is not None:
        text = args.docs.read_text() if args.docs.is_file() else ""
        if DOCS_BEGIN not in text or DOCS_END not in text:
            parser.error(f"--docs {args.docs}: no place for the scenario table (the lines {DOCS_BEGIN} and {DOCS_END})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    name = args.name or ("scenarios_quick" if args.quick else "scenarios")
    out = args.out or default_out(datetime.now(timezone.utc).isoformat(), name)
    print(f"results (rewritten after every scenario): {out}", flush=True)
    results = run(args.quick, lambda text: print(text, flush=True), args.scenarios, args.links,
                  progress=lambda so_far: write(so_far, out, report), patience=args.patience,
                  paper_rule=args.paper_rule, warm_up=args.warm_up, seeds=args.seeds)
    finish(results, out, report, args.docs, update_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
