"""(l) Secure aggregation's cost: what masking every update (``secure_aggregation.enabled``;
docs/privacy.md) costs a FedAvg round against the same round in the clear, and with devices that
drop after sharing their secrets.

Each case is one testbed run (:class:`testbed.runner.Testbed`: the Fed Server and the device agents
as separate processes on loopback): FedAvg with ``logreg`` on the embedded MNIST subset dealt IID
over N devices, every device in every round, :data:`ROUNDS` rounds, real devices (no emulation).
The cases at each N: plain FedAvg, secure aggregation over SecAgg's complete graph (a majority
threshold; up to :data:`COMPLETE_MAX` devices), and, where N exceeds it by more than one, over SecAgg+'s sparse graph of
:data:`NEIGHBOURS` neighbours and a threshold of :data:`SPARSE_THRESHOLD`; then the last of these
with 10 % and 30 % of the devices dropping after the share stage
(:class:`benchmarks.adversary.DropsAfterSharing`: they train, then withdraw instead of uploading, so
the Fed Server rebuilds their mask keys from shares and removes the masks they left). The devices
are spread over one agent process per usable core (``--agents N`` sets another count, the same in
every case); a dropout case runs its dropping devices in a process of their own (the attack
benchmark's ``HarmfulTestbed``).

Per case: the median round period (a record's ``elapsed_s`` minus the previous one's), the Fed
Server's CPU seconds per round and its peak PSS (sampled every second), the HTTP body bytes the Fed
Server received and sent per device and round (its ``sfl_http_body_bytes_total``, every route:
tasks, weights, uploads and the secure stages, registration included), the device agents' CPU
seconds, and the final accuracy. Every device shares the machine's cores, so the devices' own
masking and key agreements lengthen the round here, where a fleet would run them on its devices.
An agent is one Python process, which does its devices' protocol work (and their training's
Python) one device at a time: one agent for a hundred devices left a core idle that a fleet's
devices would all have, so the devices get one agent per core, as many as the machine has.

``python -m benchmarks.secure_aggregation [--sizes 10,100] [--rounds N] [--agents N] [--quick]`` prints the table
and writes it as JSON and Markdown (``benchmarks/results/<UTC date>_secure-aggregation/``);
``python -m benchmarks.run --only l`` runs the same part.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import numpy as np

from benchmarks.attacks import HarmfulTestbed
from benchmarks.adversary import DropsAfterSharing
from benchmarks.fedavg_overhead import PssSampler
from benchmarks.network_overhead import round_periods
from benchmarks.result_files import add_name_option, comma_separated, default_out, finish, markdown_table
from fed_server.records import read_round_records
from fed_server.run_dir import RunDirectory
from shared.config import RunConfig
from shared.http_metrics import HTTP_BODY_BYTES
from shared.machine import describe_machine, usable_cores
from shared.run_config import load_run_config
from shared.models import build_model
from shared.secagg.graph import majority_threshold, neighbourhoods
from shared.secagg.masks import BlockLayout, masked_splits
from shared.secagg.protocol import DeviceSecrets
from testbed.runner import Testbed
from testbed.warm_start import WarmStarter, shared_starter

T = TypeVar("T")
SIZES = (10, 100)
QUICK_SIZES = (10,)
DROPOUTS = (0.1, 0.3)
#: Rounds per run: the median round of 3 moved with a single slow round (2.45x and 1.79x in two
#: runs of one configuration).
ROUNDS = 10
QUICK_ROUNDS = 2
#: The goal at 100 devices a round: secure aggregation's round at most this many times plain
#: FedAvg's, with dropouts up to the threshold recovered.
GOAL_ROUND_RATIO = 1.5
GOAL_DEVICES = 100
TIME_LIMIT_S = 1800.0
#: SecAgg+'s graph in the sparse cases: each device's neighbours, and the shares of its
#: neighbourhood of 21 that rebuild its secrets. A majority (11) fails an attempt whenever some
#: neighbourhood loses 11 of its 21 devices, which with 30 of 100 devices dropping happens in about
#: 30 % of attempts; 8 in well under 1 % (:func:`failed_attempts`, printed with the results). Chosen
#: by that computation, before any measurement.
NEIGHBOURS = 20
SPARSE_THRESHOLD = 8
#: The largest round the complete graph is measured at: its work grows with the square of the
#: devices (88 s rounds at 100 here), so at 1,000 a run would take hours.
COMPLETE_MAX = 100


@dataclass(frozen=True)
class Case:
    """One run: ``devices`` devices, all in every round, masked or not, ``dropout`` of them
    dropping after the share stage."""

    devices: int
    secure: bool
    dropout: float = 0.0
    #: SecAgg+'s graph (``secure_aggregation.neighbours``); None: the complete graph.
    neighbours: int | None = None

    @property
    def label(self) -> str:
        if not self.secure:
            return "plain"
        graph = f", {self.neighbours} neighbours" if self.neighbours is not None else ""
        return "secure" + graph + (f", {self.dropout:.0%} drop" if self.dropout else "")

    @property
    def dropped(self) -> int:
        return round(self.dropout * self.devices)


def cases(sizes: Sequence[int]) -> list[Case]:
    """At each size: plain, secure over the complete graph (up to :data:`COMPLETE_MAX` devices),
    secure over :data:`NEIGHBOURS` neighbours where that graph is sparse, and the last of these
    with each of :data:`DROPOUTS`."""
    out = []
    for n in sizes:
        graphs: list[int | None] = [None] if n <= COMPLETE_MAX else []
        graphs += [NEIGHBOURS] if sparse(n) else []
        dropouts_graph, _ = graph_of(n)
        out += [Case(n, False), *(Case(n, True, 0.0, g) for g in graphs),
                *(Case(n, True, d, dropouts_graph) for d in DROPOUTS)]
    return out


def bench_config(case: Case, rounds: int) -> RunConfig:
    """FedAvg, ``logreg`` on the embedded MNIST subset (IID), every device in every round; over the
    complete graph the threshold is the default (a majority of the devices that sent keys), which
    the dropouts stay within, over the sparse one :data:`SPARSE_THRESHOLD`; deadlines long enough
    that only the dropouts' withdrawals end an attempt early."""
    return load_run_config({
        "algorithm": "fedavg", "model": "logreg", "rounds": rounds, "devices_per_round": case.devices,
        "aggregation": {"rule": "mean"},
        "data": {"dataset": "mnist", "partition": "iid", "num_devices": case.devices, "seed": 1},
        "train": {"lr": 0.05, "batch_size": 20},
        "deadlines": {"round_s": TIME_LIMIT_S, "registration_s": 300.0},
        "secure_aggregation": {"enabled": case.secure, "stage_s": 120.0, "neighbours": case.neighbours,
                               "threshold": None if case.neighbours is None else SPARSE_THRESHOLD},
        "devices": {"profiles": []}, "seed": 1})


def failed_attempts(devices: int, neighbours: int, threshold: int, dropped: int, trials: int = 2000,
                    seed: int = 0) -> float:
    """The share of attempts that ``dropped`` of ``devices`` dropping after the share stage would
    fail over SecAgg+'s graph (:func:`shared.secagg.graph.neighbourhoods`, a fresh ring each
    trial): those where some neighbourhood keeps fewer than ``threshold`` survivors to answer."""
    rng = random.Random(seed)
    roster = [f"d{i:04d}" for i in range(devices)]
    failed = 0
    for _ in range(trials):
        hoods = neighbourhoods(roster, neighbours, rng)
        gone = set(rng.sample(roster, dropped))
        failed += any(len(set(hood) - gone) < threshold for hood in hoods.values())
    return failed / trials


def blocks_aggregated(devices: int, neighbours: int, threshold: int, trials: int = 300, seed: int = 0) -> float:
    """The share of the blocks the devices of a split run hold that they mask and upload over
    SecAgg+'s graph (:func:`shared.secagg.masks.masked_splits`: those at least ``threshold`` of
    their neighbourhood mask too; a fresh ring each trial), each device cut at random after 1, 2 or
    3 blocks (the small CNN's split candidates); their group copies stand in for the rest."""
    rng = random.Random(seed)
    roster = [f"d{i:04d}" for i in range(devices)]
    held = uploaded = 0
    for _ in range(trials):
        hoods = neighbourhoods(roster, neighbours, rng)
        cuts = {d: rng.choice((1, 2, 3)) for d in roster}
        held += sum(cuts.values())
        uploaded += sum(masked_splits(cuts, threshold, hoods).values())
    return uploaded / held


def sparse_failures(sizes: Sequence[int]) -> list[dict]:
    """At each size where the sparse graph runs, the share of attempts each dropout would fail
    (:func:`failed_attempts`) with :data:`SPARSE_THRESHOLD` and with a majority of the neighbourhood."""
    return [{"devices": n, "dropout": d, "threshold": t, "failed": failed_attempts(n, NEIGHBOURS, t, round(d * n))}
            for n in sizes if sparse(n) for d in DROPOUTS
            for t in (SPARSE_THRESHOLD, majority_threshold(NEIGHBOURS + 1))]


def sparse(devices: int) -> bool:
    """Whether :data:`NEIGHBOURS` neighbours leave out some of ``devices`` (else they are every
    device's neighbours: the complete graph)."""
    return NEIGHBOURS < devices - 1


def graph_of(devices: int) -> tuple[int | None, int]:
    """The graph (neighbours, None for the complete one) and threshold of the last secure cases
    at ``devices`` a round: those the dropouts run on."""
    return (NEIGHBOURS, SPARSE_THRESHOLD) if sparse(devices) else (None, majority_threshold(devices))


def protocol_cpu(devices: int) -> dict:
    """The devices' side of one secure attempt at ``devices`` a round (over :func:`graph_of`'s
    graph), computed in this process one device after another, with no message sent: each
    device's key pairs, its sealed shares (its key agreements with them), the shares sealed for it
    opened, and its masked update of ``logreg``'s entries. The CPU seconds of each step, summed
    over the devices: what the agents' work for a round grows by before any stage's messages."""
    neighbours, threshold = graph_of(devices)
    layout = BlockLayout.of(build_model("logreg"))
    ids = [f"d{i:04d}" for i in range(devices)]
    hoods = neighbourhoods(ids, neighbours, random.Random(0))
    cpu = dict.fromkeys(("keys", "shares", "inbox", "mask"), 0.0)

    def timed(step: str, section: Callable[[], T]) -> T:
        started = time.process_time()
        out = section()
        cpu[step] += time.process_time() - started
        return out

    secrets = {d: timed("keys", partial(DeviceSecrets, d, "benchmark", 1)) for d in ids}
    public = {d: timed("keys", secrets[d].public_keys) for d in ids}
    rosters = {d: {p: public[p] for p in hoods[d]} for d in ids}
    sealed = {d: timed("shares", partial(secrets[d].seal_shares, rosters[d], threshold)) for d in ids}
    partners = {d: timed("inbox", partial(secrets[d].open_inbox, rosters[d], {s: sealed[s][d] for s in hoods[d] if s != d}))
                for d in ids}
    update = {name: np.full(shape, 1e-3) for block in layout.blocks for name, shape in block}
    splits = dict.fromkeys(ids, len(layout.blocks))
    for d in ids:
        timed("mask", partial(secrets[d].mask, update, weight=60.0, fraction_bits=20, value_range=1.0, layout=layout,
                              roster=rosters[d], partners=partners[d], splits=splits))
    return {"devices": devices, "neighbours": neighbours, "threshold": threshold,
            "cpu_s": {k: round(v, 4) for k, v in cpu.items()}, "total_cpu_s": round(sum(cpu.values()), 4)}


def fed_body_bytes(testbed: Testbed) -> float:
    """Every HTTP body byte the testbed's Fed Server received and sent so far (its ``/metrics``;
    route templates hold braces of their own, so the labels are matched to the line's last brace)."""
    text = httpx.get(f"{testbed.fed_url}/metrics", timeout=10, verify=testbed.verify).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{HTTP_BODY_BYTES}\{{.*\}} (\S+)$", text, re.M))


def run_case(case: Case, rounds: int, root: Path, warm: WarmStarter | None = None, agents: int = 1) -> dict:
    """One case through the testbed, its devices over ``agents`` agent processes; its figures."""
    config = bench_config(case, rounds)
    run_dir = root / f"{case.devices}-{case.label.replace(', ', '-').replace(' ', '-').replace('%', 'pc')}"
    testbed = (HarmfulTestbed(config, run_dir, DropsAfterSharing, case.dropped, warm, agents=agents) if case.dropped
               else Testbed(config, run_dir, agents=agents, log_level="WARNING", warm=warm))
    started = time.monotonic()
    with testbed:
        assert testbed.fed is not None
        # Every process, for its CPU seconds (read each second: an agent exits when the run ends).
        sampler = PssSampler({s.name: s.process.pid for s in testbed.processes.services}).start()
        status = testbed.follow(timeout=TIME_LIMIT_S)
        body = fed_body_bytes(testbed)
        sampler.sample()
        memory, cpu = sampler.stop(), dict(sampler.cpu_s)
    wall = time.monotonic() - started
    records = read_round_records(RunDirectory(run_dir).metrics_path)
    ok = [r for r in records if r.status == "ok"]
    periods = round_periods(records)
    return {"devices": case.devices, "case": case.label, "secure": case.secure, "neighbours": case.neighbours,
            "dropout": case.dropout,
            "dropped": case.dropped, "state": status["state"], "rounds_ok": len(ok), "attempts": len(records),
            "aggregated": [len(r.aggregated) for r in ok], "round_s": [round(p, 3) for p in periods],
            "median_round_s": statistics.median(periods) if periods else None,
            "fed_cpu_s_per_round": cpu.get("fed_server", 0.0) / max(1, len(records)),
            "agents_cpu_s": sum(v for k, v in cpu.items() if k != "fed_server"),
            "fed_peak_pss_mib": memory["peak_pss_mib"].get("fed_server"),
            "fed_kib_per_device_round": body / 1024 / case.devices / max(1, len(records)),
            "final_accuracy": ok[-1].test_accuracy if ok else None, "wall_s": round(wall, 1)}


def add_ratios(rows: list[dict]) -> None:
    """Each row's median round against the plain row of its size (``round_ratio``)."""
    plain = {r["devices"]: r["median_round_s"] for r in rows if not r["secure"]}
    for row in rows:
        base = plain.get(row["devices"])
        row["round_ratio"] = row["median_round_s"] / base if base and row["median_round_s"] else None


def verdict(rows: list[dict]) -> str:
    """Whether the goal holds at :data:`GOAL_DEVICES` devices (every secure case of the graph the
    dropouts ran on, SecAgg+'s where it was measured, within :data:`GOAL_ROUND_RATIO` of plain,
    every round recovered), or that size was not measured."""
    at = [r for r in rows if r["devices"] == GOAL_DEVICES and r["secure"]]
    if not at:
        return f"not measured at {GOAL_DEVICES} devices"
    graph = at[-1].get("neighbours")
    at = [r for r in at if r.get("neighbours") == graph]
    missed = [r["case"] for r in at if r["round_ratio"] is None or r["round_ratio"] > GOAL_ROUND_RATIO
              or r["state"] != "finished" or r["attempts"] != r["rounds_ok"]]
    return "met" if not missed else "not met: " + ", ".join(missed)


def run(sizes: Sequence[int] = SIZES, rounds: int = ROUNDS, log: Callable[[str], None] = print,
        agents: int | None = None) -> dict:
    """Every case at each of ``sizes``, the devices over ``agents`` agent processes (None: one per
    usable core); the results with the machine, the goal and the verdict."""
    agents = agents or usable_cores()
    results: dict = {"machine": describe_machine(), "rounds": rounds, "agents": agents,
                     "model": "logreg (7,850 parameters)",
                     "data": "the embedded MNIST subset, IID", "goal": {"devices": GOAL_DEVICES,
                                                                       "round_ratio_max": GOAL_ROUND_RATIO},
                     "rows": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sfl-bench-l-") as tmp:
        for case in cases(sizes):
            row = run_case(case, rounds, Path(tmp), shared_starter(), agents)
            results["rows"].append(row)
            log(f"  {case.devices} devices, {case.label}: {row['rounds_ok']}/{rounds} rounds in {row['attempts']} "
                f"attempts, median round {_number(row['median_round_s'], 2)} s, Fed Server "
                f"{row['fed_cpu_s_per_round']:.2f} CPU s a round, {row['fed_kib_per_device_round']:.0f} KiB a device "
                f"and round")
    add_ratios(results["rows"])
    results["verdict"] = verdict(results["rows"])
    results["sparse_failed_attempts"] = sparse_failures(sizes)
    results["sparse_blocks_aggregated"] = [{"devices": n, "threshold": SPARSE_THRESHOLD,
                                            "aggregated": blocks_aggregated(n, NEIGHBOURS, SPARSE_THRESHOLD)}
                                           for n in sizes if sparse(n)]
    results["protocol_cpu"] = [protocol_cpu(n) for n in sizes]
    results["total_s"] = time.perf_counter() - started
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict) -> list[str]:
    """The results as a Markdown table, a row per case."""
    lines = [["devices", "case", "rounds (attempts)", "median round s", "vs plain", "Fed Server CPU s/round",
              "Fed Server peak PSS MiB", "Fed Server KiB per device and round", "agents' CPU s", "final accuracy"]]
    for r in results["rows"]:
        ratio = r.get("round_ratio")
        lines.append([str(r["devices"]), r["case"], f"{r['rounds_ok']} ({r['attempts']})",
                      _number(r["median_round_s"], 2), "-" if ratio is None else f"{ratio:.2f}x",
                      f"{r['fed_cpu_s_per_round']:.2f}", _number(r["fed_peak_pss_mib"]),
                      f"{r['fed_kib_per_device_round']:.0f}", f"{r['agents_cpu_s']:.1f}",
                      "-" if r["final_accuracy"] is None else f"{100 * r['final_accuracy']:.1f} %"])
    return markdown_table(lines)


def report(results: dict) -> str:
    """The table, the setting and the verdict."""
    m = results["machine"]
    return "\n".join([
        f"FedAvg, {results['model']}, {results['data']}, every device in every round, {results['rounds']} rounds; "
        f"the devices in {_agents(results.get('agents', 1))}; {m['cpu_model']}, {m['cpus_usable']} CPUs usable, "
        f"every process on them",
        "", *table(results), "",
        f"Goal: secure aggregation at {results['goal']['devices']} devices a round within "
        f"{results['goal']['round_ratio_max']}x plain FedAvg's round, dropouts recovered (judged on the graph the "
        f"dropouts ran on). Verdict: {results['verdict']}",
        *[f"The devices' protocol computation alone at {c['devices']} devices ("
          f"{'the complete graph' if c['neighbours'] is None else str(c['neighbours']) + ' neighbours'}, threshold "
          f"{c['threshold']}), one device after another in one process, no messages: {c['total_cpu_s']:.3f} CPU s an "
          f"attempt ({', '.join(f'{k} {v:.3f}' for k, v in c['cpu_s'].items())})"
          for c in results.get("protocol_cpu", [])],
        *[f"Over {NEIGHBOURS} neighbours with threshold {f['threshold']}, {f['dropout']:.0%} of {f['devices']} devices "
          f"dropping fail {f['failed']:.1%} of attempts (2,000 random rings)"
          for f in results.get("sparse_failed_attempts", [])],
        *[f"In a split run over {NEIGHBOURS} neighbours with threshold {b['threshold']}, {b['devices']} devices cut at "
          f"random after 1 to 3 blocks mask and upload {b['aggregated']:.1%} of the blocks they hold (300 random rings)"
          for b in results.get("sparse_blocks_aggregated", [])]])


def _agents(count: int) -> str:
    return "one agent process" if count == 1 else f"{count} agent processes"


#: ``--sizes``: device counts of at least 3 (a threshold needs two).
parse_sizes = comma_separated(int, "--sizes", lambda n: n >= 3, "device counts of at least 3, e.g. 10,100")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.secure_aggregation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help=f"devices a round (default {','.join(map(str, SIZES))}; --quick: "
                             f"{','.join(map(str, QUICK_SIZES))})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds per run (default {ROUNDS}; --quick: {QUICK_ROUNDS})")
    parser.add_argument("--agents", type=int, default=None,
                        help="agent processes the devices are spread over, in every case (default one per usable "
                             "core; a dropout case's dropping devices run in one more)")
    parser.add_argument("--quick", action="store_true", help="the smallest size and 2 rounds (a couple of minutes)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file (default benchmarks/results/<UTC date>_<name>/results.json)")
    add_name_option(parser, "secure-aggregation")
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    if rounds < 1:
        parser.error("--rounds takes a positive count")
    if args.agents is not None and args.agents < 1:
        parser.error("--agents takes a positive count")
    results = run(sizes, rounds, agents=args.agents)
    finish(results, args.out or default_out(results["machine"]["date_utc"], args.name), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
