"""(h) Large populations: how long a population of devices takes to register, how long its rounds
take, and what each registered device costs in memory.

For each population size N: FedAvg with ``logreg`` on Synthetic(0.5, 0.5) with its natural
partition (N generated devices, one per shard), a tenth of the population per round and at most
100, :data:`ROUNDS` rounds, real devices (no emulation), through the testbed
(:class:`testbed.runner.Testbed`: the Fed Server and ``--agents`` agent processes sharing the
shards, on loopback). With ``--s2fl`` also S2FL with the ``cnn`` on the embedded MNIST subset
(IID) at :data:`S2FL_DEVICES` devices, :data:`S2FL_PER_ROUND` per round (with its Main Server).

Each population starts with an empty data cache (``SFL_DATA_CACHE``, ``shared/data/synthetic_files.py``), so
its time to register includes generating its data set once. Per population: the seconds from
starting the processes until the Fed Server's ``/v1/status``
counts every device registered (polled every half second), the median round period (a record's
``elapsed_s`` minus the previous one's), and the peak proportional set size of each process and of
the whole testbed (the sum of ``Pss`` in ``/proc/<pid>/smaps_rollup``, sampled together every
second from the moment the Fed Server is healthy). Memory per registered device is the growth of
the peak PSS from the smallest population to N over the devices added, for the Fed Server, the
Main Server, the agents together and the whole testbed. A population that has not registered
within the time limit, or whose testbed passes the memory limit (its processes are stopped at
once, so that the machine is not driven out of memory), is recorded as it stands then (how many
registered, memory), and the larger populations are skipped.

``python -m benchmarks.population [--sizes 100,1000] [--agents N] [--s2fl] [--time-limit S] [--memory-limit MIB]``
prints the table and writes it as JSON and Markdown (``benchmarks/results/<UTC date>_population/results.json``
and ``results.md`` by default, ``--name`` naming the folder for what the run measured);
``python -m benchmarks.run --only h`` runs the same part.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.fedavg_overhead import PssSampler
from benchmarks.network_overhead import round_periods
from benchmarks.result_files import add_name_option, default_out, markdown_table, write
from fed_server.records import RoundRecord
from shared.config import RunConfig
from shared.run_config import load_run_config
from testbed.runner import Testbed, TestbedError

SIZES = (100, 1000, 10000)
QUICK_SIZES = (20, 100)   # benchmarks.run --quick
ROUNDS = 3
MAX_PER_ROUND = 100
S2FL_DEVICES = 1000
S2FL_PER_ROUND = 10
TIME_LIMIT_S = 600.0
MEMORY_LIMIT_FRACTION = 0.4   # of the machine's memory: the default --memory-limit
POLL_S = 0.5

# The goals at 10,000 devices on the 2-core reference machine (benchmarks/README.md, part (h)).
GOAL_REGISTER_S = 60.0
GOAL_TESTBED_PSS_MIB = 2e9 / 2 ** 20
GOAL_ROUND_RATIO = 1.2
GOAL_AGENT_KB_PER_DEVICE = 50.0
GOAL_FED_KB_PER_DEVICE = 10.0

#: The process kinds memory per device is given for (the agents' PSS summed).
KINDS = ("fed_server", "main_server", "agents", "testbed")


def per_round(population: int) -> int:
    """Devices per round: a tenth of the population, at least 1 and at most :data:`MAX_PER_ROUND`."""
    return max(1, min(MAX_PER_ROUND, population // 10))


def fedavg_config(population: int, time_limit_s: float, rounds: int = ROUNDS) -> RunConfig:
    """FedAvg, ``logreg``, Synthetic(0.5, 0.5) with one generated device per shard; the rounds wait
    for every device (the registration deadline lies beyond the time limit)."""
    return load_run_config({
        "algorithm": "fedavg", "model": "logreg", "rounds": rounds, "devices_per_round": per_round(population),
        "data": {"dataset": "synthetic", "partition": "natural", "num_devices": population,
                 "synthetic_alpha": 0.5, "synthetic_beta": 0.5, "seed": 1},
        "train": {"lr": 0.01, "momentum": 0.5, "batch_size": 20, "local_epochs": 1},
        "deadlines": _deadlines(time_limit_s), "devices": {"profiles": []}, "seed": 1})


def s2fl_config(time_limit_s: float, rounds: int = ROUNDS) -> RunConfig:
    """S2FL, ``cnn``, the embedded MNIST subset dealt IID over :data:`S2FL_DEVICES` devices (4 images each)."""
    return load_run_config({
        "algorithm": "s2fl", "model": "cnn", "rounds": rounds, "devices_per_round": S2FL_PER_ROUND,
        "data": {"dataset": "mnist", "partition": "iid", "num_devices": S2FL_DEVICES, "seed": 1},
        "train": {"lr": 0.05, "batch_size": 4},
        "deadlines": _deadlines(time_limit_s), "devices": {"profiles": []}, "seed": 1})


def _deadlines(time_limit_s: float) -> dict[str, float]:
    return {"round_s": time_limit_s, "join_s": 120.0, "step_s": 120.0, "registration_s": time_limit_s + 60.0}


@dataclass
class Population:
    """One population's figures."""

    algorithm: str
    model: str
    devices: int
    per_round: int
    agents: int
    registered: int
    register_s: float | None        # None: not every device registered within the limits
    rounds_done: int
    rounds_planned: int
    round_s: list[float]
    peak_pss_mib: dict[str, float]  # per process, and "testbed" for the peak of their sum
    error: str | None

    @property
    def median_round_s(self) -> float | None:
        return statistics.median(self.round_s) if self.round_s else None

    def kind_pss_mib(self) -> dict[str, float]:
        """Peak PSS per process kind: the Fed Server, the Main Server(s), the agents summed, the testbed."""
        kinds = {k: 0.0 for k in KINDS}
        for name, mib in self.peak_pss_mib.items():
            kind = "testbed" if name == "testbed" else "agents" if name.startswith("agent") else (
                "main_server" if name.startswith("main_server") else "fed_server")
            kinds[kind] += mib
        return kinds

    def as_dict(self) -> dict:
        return {"algorithm": self.algorithm, "model": self.model, "devices": self.devices,
                "per_round": self.per_round, "agents": self.agents, "registered": self.registered,
                "register_s": self.register_s, "rounds_done": self.rounds_done, "rounds_planned": self.rounds_planned,
                "round_s": self.round_s, "median_round_s": self.median_round_s, "peak_pss_mib": self.peak_pss_mib,
                "kind_pss_mib": self.kind_pss_mib(), "error": self.error}


class GuardedSampler(PssSampler):
    """A :class:`PssSampler` that calls ``trip`` once, from its thread, when the peak of the summed
    PSS passes ``limit_mib``."""

    def __init__(self, pids: dict[str, int], limit_mib: float, trip: Callable[[], None]) -> None:
        super().__init__(pids)
        self.limit_mib = limit_mib
        self.trip = trip
        self.tripped = threading.Event()

    def sample(self) -> None:
        super().sample()
        if self.peak_pss_sum_kib / 1024 > self.limit_mib and not self.tripped.is_set():
            self.tripped.set()
            self.trip()


def run_population(config: RunConfig, agents: int, time_limit_s: float, memory_limit_mib: float,
                   log: Callable[[str], None]) -> Population:
    """Start the testbed for ``config``, wait until every device has registered (or a limit), follow
    the rounds (within the time limit again), stop everything; the figures."""
    n = config.data.num_devices
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-h-"))
    # A cold data cache: the time to register includes generating the population's data set.
    cache_before = os.environ.get("SFL_DATA_CACHE")
    os.environ["SFL_DATA_CACHE"] = str(root / "data-cache")
    testbed = Testbed(config, root / "run", agents=agents, log_level="WARNING")
    sampler: GuardedSampler | None = None
    registered, register_s, error = 0, None, None
    records: list[RoundRecord] = []
    started = time.monotonic()
    try:
        testbed.start(healthy_s=time_limit_s)
        pids = {service.name: service.process.pid for service in testbed.processes.services}
        sampler = GuardedSampler(pids, memory_limit_mib, lambda: testbed.processes.stop(1.0))
        sampler.start()
        registered, register_s = _wait_registered(testbed, n, started, time_limit_s, sampler.tripped, log)
        if register_s is None:
            error = f"{registered} of {n} devices registered after {time.monotonic() - started:.0f} s"
        else:
            log(f"  {n} devices registered in {register_s:.1f} s")
            records = _follow(testbed, time_limit_s, log)
            if len(records) < config.rounds:
                error = f"{len(records)} of {config.rounds} rounds within {time_limit_s:g} s"
    except (TestbedError, RuntimeError) as exc:
        error = str(exc).splitlines()[0]
    finally:
        memory = sampler.stop() if sampler is not None else {}
        testbed.stop(interrupted=True)
        shutil.rmtree(root, ignore_errors=True)
        if cache_before is None:
            os.environ.pop("SFL_DATA_CACHE", None)
        else:
            os.environ["SFL_DATA_CACHE"] = cache_before
    if sampler is not None and sampler.tripped.is_set():
        error = f"stopped at the memory limit ({memory_limit_mib:,.0f} MiB PSS): {error}"
    if error:
        log(f"  {error}")
    peaks = {**memory.get("peak_pss_mib", {}), "testbed": memory.get("peak_pss_sum_mib", 0.0)}
    return Population(config.algorithm, config.model, n, config.devices_per_round or n, agents, registered,
                      register_s, len(records), config.rounds, round_periods(records), peaks, error)


def _wait_registered(testbed: Testbed, n: int, started: float, time_limit_s: float, stopped: threading.Event,
                     log: Callable[[str], None]) -> tuple[int, float | None]:
    """(devices registered, seconds from ``started`` until all ``n`` were; None if not within the
    time limit or before ``stopped`` was set)."""
    registered, reported = 0, -1
    while time.monotonic() - started < time_limit_s and not stopped.is_set():
        if testbed.fed is not None and not testbed.fed.alive():
            if stopped.is_set():
                break
            raise TestbedError(f"the Fed Server exited: {testbed.fed.log_tail(5)}")
        try:
            registered = int(testbed.status()["registered"])
        except httpx.HTTPError:
            pass    # a Fed Server busy registering may miss one status request
        if registered >= n:
            return registered, time.monotonic() - started
        elapsed = time.monotonic() - started
        if registered != reported and elapsed // 30 != (elapsed - POLL_S) // 30:
            log(f"  {registered} of {n} registered after {elapsed:.0f} s")
            reported = registered
        time.sleep(POLL_S)
    return registered, None


def _follow(testbed: Testbed, time_limit_s: float, log: Callable[[str], None]) -> list[RoundRecord]:
    """The successful round records, as far as the run got within ``time_limit_s``."""
    records: list[RoundRecord] = []

    def on_round(record: RoundRecord, status: dict) -> None:
        if record.status == "ok":
            records.append(record)
            log(f"  round {record.round}/{status['rounds_total']}: {record.round_time_s:.1f} s")

    try:
        testbed.follow(on_round, timeout=time_limit_s)
    except TestbedError as exc:
        log(f"  rounds stopped: {str(exc).splitlines()[0]}")
    return records


def per_device_kib(populations: Sequence[dict], algorithm: str = "fedavg") -> dict[int, dict[str, float]]:
    """Memory per registered device of each population of ``algorithm`` above the smallest that
    registered: (peak PSS at N - at the smallest N) / (N - smallest N), KiB, per process kind. A
    population that did not register counts the devices it had registered."""
    out: dict[int, dict[str, float]] = {}
    runs = [p for p in populations if p["algorithm"] == algorithm]
    complete = [p for p in runs if p["register_s"] is not None]
    if not complete:
        return out
    base = min(complete, key=lambda p: p["devices"])
    for p in runs:
        if p["registered"] <= base["devices"]:
            continue
        added = p["registered"] - base["devices"]
        out[p["devices"]] = {k: 1024 * (p["kind_pss_mib"][k] - base["kind_pss_mib"][k]) / added for k in KINDS}
    return out


def default_memory_limit_mib() -> float:
    """:data:`MEMORY_LIMIT_FRACTION` of the machine's memory, MiB."""
    return MEMORY_LIMIT_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 20


def run(sizes: Sequence[int] = SIZES, agents: int = 1, s2fl: bool = False, time_limit_s: float = TIME_LIMIT_S,
        memory_limit_mib: float | None = None, log: Callable[[str], None] = print) -> dict:
    """Every population in ``sizes`` (ascending; a size after one that did not register is skipped),
    then the S2FL population with ``s2fl``; the figures and the goals, as a dict (see :func:`report`).
    ``memory_limit_mib``: the whole testbed's PSS at which a population is stopped (None: the default)."""
    from shared.machine import describe_machine

    memory_limit_mib = memory_limit_mib or default_memory_limit_mib()

    results: dict = {"machine": describe_machine(), "settings": {
        "sizes": list(sizes), "agents": agents, "rounds": ROUNDS, "time_limit_s": time_limit_s,
        "memory_limit_mib": round(memory_limit_mib),
        "fedavg": "logreg on Synthetic(0.5, 0.5), natural partition (one generated device per shard), "
                  f"a tenth of the population per round, at most {MAX_PER_ROUND}, batch 20, one local epoch",
        "s2fl": f"cnn on the embedded MNIST subset, IID over {S2FL_DEVICES} devices, {S2FL_PER_ROUND} per round"},
        "goals": {"register_s_at_10000": GOAL_REGISTER_S, "testbed_pss_mib_at_10000": round(GOAL_TESTBED_PSS_MIB, 1),
                  "round_ratio_10000_over_1000": GOAL_ROUND_RATIO,
                  "agent_kb_per_device": GOAL_AGENT_KB_PER_DEVICE, "fed_server_kb_per_device": GOAL_FED_KB_PER_DEVICE},
        "populations": []}
    started = time.perf_counter()
    configs = [fedavg_config(n, time_limit_s) for n in sorted(sizes)]
    if s2fl:
        configs.append(s2fl_config(time_limit_s))
    stalled = False
    for config in configs:
        n = config.data.num_devices
        if stalled and config.algorithm == "fedavg":
            log(f"(h) {n} devices: skipped (a smaller population did not register)")
            continue
        log(f"(h) {config.algorithm}, {config.model}, {n} devices, {config.devices_per_round} per round, "
            f"{agents} agent(s)")
        population = run_population(config, agents, time_limit_s, memory_limit_mib, log).as_dict()
        results["populations"].append(population)
        stalled = stalled or (config.algorithm == "fedavg" and population["register_s"] is None)
    results["per_device_kib"] = {str(n): v for n, v in per_device_kib(results["populations"]).items()}
    results["total_s"] = time.perf_counter() - started
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def table(results: dict) -> list[list[str]]:
    """The table's rows, the header first: one row per population."""
    per_device = results.get("per_device_kib", {})
    header = ["algorithm", "devices", "per round", "registered", "register s", "median round s",
              "Fed Server MiB", "Main Server MiB", "agents MiB", "testbed MiB",
              "KiB/device Fed Server", "KiB/device agents", "KiB/device testbed"]
    rows = [header]
    for p in results["populations"]:
        kinds, extra = p["kind_pss_mib"], per_device.get(str(p["devices"])) if p["algorithm"] == "fedavg" else None
        rows.append([
            f"{p['algorithm']} {p['model']}", f"{p['devices']:,}", str(p["per_round"]),
            f"{p['registered']:,}" if p["register_s"] is not None else f"{p['registered']:,} (limit)",
            _number(p["register_s"]), _number(p["median_round_s"], 2) + (
                "" if p["rounds_done"] == p["rounds_planned"] else f" ({p['rounds_done']}/{p['rounds_planned']} rounds)"),
            _number(kinds["fed_server"], 0), _number(kinds["main_server"], 0) if kinds["main_server"] else "-",
            _number(kinds["agents"], 0), _number(kinds["testbed"], 0),
            *(_number(extra[k], 1) if extra else "-" for k in ("fed_server", "agents", "testbed"))])
    return rows


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def report(results: dict) -> str:
    """The part as Markdown: the machine, the settings, the goals, the table, what did not finish."""
    m, s, g = results["machine"], results["settings"], results["goals"]
    rows = table(results)
    out = [f"Machine: {m['cpu_model']}, {m['cpus_usable']} of {m['cpu_count']} CPUs usable, {m['memory_gib']} GiB, "
           f"Python {m['python']}, torch {m['torch']}, {m['date_utc']}, load average {m['load_average_at_start']} "
           f"at the start, {m.get('load_average_at_end')} at the end; {results['total_s'] / 60:.1f} min in all.",
           "",
           f"Runs: FedAvg with {s['fedavg']}; S2FL with {s['s2fl']} (with --s2fl); {s['rounds']} rounds, "
           f"{s['agents']} agent(s), real devices (no emulation), a population stopped after {s['time_limit_s']:g} s "
           f"of registration or of rounds, or when the testbed passed {s.get('memory_limit_mib', 0):,} MiB PSS.",
           "",
           f"Goals at 10,000 devices: every device registered within {g['register_s_at_10000']:g} s; the whole testbed "
           f"within {g['testbed_pss_mib_at_10000']:,.0f} MiB PSS; the median round within "
           f"{g['round_ratio_10000_over_1000']}x of 1,000 devices'; an idle device at most "
           f"{g['agent_kb_per_device']:g} KB in its agent and {g['fed_server_kb_per_device']:g} KB in the Fed Server.",
           "", *markdown_table(rows)]
    errors = [f"{p['algorithm']} at {p['devices']:,}: {p['error']}" for p in results["populations"] if p["error"]]
    if errors:
        out += ["", "Not finished: " + "; ".join(errors) + "."]
    return "\n".join(out)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--sizes 100,1000``: ascending distinct population sizes, each at least 2 (ValueError otherwise)."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 2:
        raise ValueError(f"--sizes takes comma-separated population sizes of at least 2, e.g. 100,1000; got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.population", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help=f"population sizes, FedAvg (default {','.join(map(str, SIZES))})")
    parser.add_argument("--agents", type=int, default=1, help="agent processes sharing the devices (default 1)")
    parser.add_argument("--s2fl", action="store_true", help=f"also S2FL with the cnn at {S2FL_DEVICES} devices")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help=f"seconds a population may take to register, and then its rounds (default {TIME_LIMIT_S:g})")
    parser.add_argument("--memory-limit", type=float, default=None,
                        help="whole-testbed PSS in MiB at which a population is stopped (default "
                             f"{MEMORY_LIMIT_FRACTION * 100:.0f} %% of the machine's memory)")
    add_name_option(parser, "population")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file; the Markdown goes beside it with .md "
                             "(default benchmarks/results/<UTC date>_<name>/results.json)")
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.agents < 1:
        parser.error("--agents must be at least 1")
    if not args.time_limit > 0:
        parser.error("--time-limit must be a positive number of seconds")
    if args.memory_limit is not None and not args.memory_limit > 0:
        parser.error("--memory-limit must be a positive number of MiB")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run(sizes, args.agents, args.s2fl, args.time_limit, args.memory_limit, lambda text: print(text, flush=True))
    print()
    print(report(results))
    out = args.out or default_out(results["machine"]["date_utc"], args.name)
    markdown = write(results, out, report)
    print(f"\nresults: {out}, {markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
