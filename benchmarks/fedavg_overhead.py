"""(f) FedAvg through the services beside the same math in one process, and beside the 2-core limit.

Services: the real testbed (Fed Server and one device agent hosting every device, each its own
process on loopback, one torch thread each) with real devices (``devices.profiles=[]``). FedAvg
trains the whole model on the device and never calls a Main Server, so the testbed starts none
(an idle one held 269 MiB of PSS): the figure is the cost of the deployment shape for the
simplest algorithm (the first of the goals in benchmarks/README.md).

In-process: the same rounds in this process on one thread: every device of a round trains the
whole model from the global weights with ``device_agent.trainer.train_round`` (the agent's own
loop, the same per-device, per-round batch seed), the algorithm's ``aggregate`` and the same
evaluation on the test set. Nothing is ordered by arrival here (aggregation is keyed by device),
so the final models agree to float rounding (``max_abs_weight_diff_final_model``).

The 2-core limit is the single-thread time divided by the usable cores: what the services could
reach if the devices' compute spread perfectly over both cores and everything else were free.

Memory: the whole testbed's proportional set size (PSS: shared pages split between the processes
that map them, so shared libraries count once in the sum) is the sum of ``Pss`` from
``/proc/<pid>/smaps_rollup`` over the launcher (``python -m testbed``, started by this benchmark
as a user starts it; until 2026-11-24 this process stood in for it, with torch, the model and
the data loaded), the Fed Server and the agent, sampled together every second; the peak of that
sum is the figure. The peak of the summed RSS is reported beside it.
"""
from __future__ import annotations

import copy
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from benchmarks.network_overhead import clean_run_results, max_abs_diff, round_periods
from device_agent.timing import RoundClock
from device_agent.trainer import TrainContext, TrainSettings, round_seed, train_round
from fed_server.records import RoundRecord
from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.config import RunConfig
from shared.data import dataset_input_shape, dataset_num_classes, device_shard, load_dataset
from shared.evaluation import classification_accuracy
from shared.machine import usable_cores
from shared.models import build_model
from shared.portions import portion_state
from shared.run_config import load_run_config
from testbed.processes import service_env


def bench_config(quick: bool, rounds: int | None = None) -> RunConfig:
    """The goals' FedAvg task: small cnn, embedded MNIST, Dirichlet 0.5, 10 devices, batch 32,
    lr 0.05, one epoch, no emulation. Full mode runs 10 of the task's 30 rounds (the median
    round settles after the first; 30 rounds on both sides would take about 8 minutes here);
    quick mode 4 devices, 2 rounds, 600 samples."""
    if quick:
        devices, default_rounds, samples = 4, 2, 600
    else:
        devices, default_rounds, samples = 10, 10, None
    return load_run_config({
        "algorithm": "fedavg",
        "rounds": rounds or default_rounds,
        "data": {"num_devices": devices, "partition": "dirichlet", "alpha": 0.5, "seed": 1, "max_samples": samples},
        "train": {"lr": 0.05, "batch_size": 32, "local_epochs": 1},
        "deadlines": {"round_s": 600, "join_s": 120, "step_s": 120},
        "devices": {"profiles": []},
        "seed": 1,
    })


# --- memory -----------------------------------------------------------------------------------

def smaps_rollup_kib(pid: int) -> dict[str, int]:
    """``Pss`` and ``Rss`` (KiB) of ``/proc/<pid>/smaps_rollup``; empty when the process is gone."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return out


def stat_fields(pid: int, thread: bool = False) -> list[str] | None:
    """The fields after the command name of ``/proc/<pid>/stat`` (with ``thread``, of the process's
    main thread alone: ``/proc/<pid>/task/<pid>/stat``), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def fields_cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds in :func:`stat_fields`' fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used, or None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else fields_cpu_seconds(fields)


class PssSampler:
    """Samples the summed PSS and RSS of a set of processes together and keeps the peaks (of the
    sums, and of each process's PSS).

    Once a second: reading ``smaps_rollup`` walks every mapping of a process, and at four reads
    every 0.25 s the sampler itself used 1.8 CPU seconds per round (measured), more than the Fed
    Server. PSS moves with allocations that last at least a step, so a second still finds the
    peak of a round that lasts several."""

    def __init__(self, pids: dict[str, int], interval_s: float = 1.0) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.peak_pss_sum_kib = 0
        self.peak_rss_sum_kib = 0
        self.peak_pss_kib: dict[str, int] = {}
        self.cpu_s: dict[str, float] = {}   # the last CPU seconds read of each process
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pss", daemon=True)

    def sample(self) -> None:
        pss_sum = rss_sum = 0
        for name, pid in self.pids.items():
            cpu = cpu_seconds(pid)
            if cpu is not None:
                with self._lock:
                    self.cpu_s[name] = cpu
            figures = smaps_rollup_kib(pid)
            pss, rss = figures.get("Pss", 0), figures.get("Rss", 0)
            pss_sum, rss_sum = pss_sum + pss, rss_sum + rss
            self.peak_pss_kib[name] = max(self.peak_pss_kib.get(name, 0), pss)
        self.peak_pss_sum_kib = max(self.peak_pss_sum_kib, pss_sum)
        self.peak_rss_sum_kib = max(self.peak_rss_sum_kib, rss_sum)

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds of each process so far (read now where the process is still alive)."""
        for name, pid in self.pids.items():
            cpu = cpu_seconds(pid)
            if cpu is not None:
                with self._lock:
                    self.cpu_s[name] = cpu
        with self._lock:
            return dict(self.cpu_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> "PssSampler":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(2.0)
        return {"peak_pss_sum_mib": round(self.peak_pss_sum_kib / 1024, 1),
                "peak_rss_sum_mib": round(self.peak_rss_sum_kib / 1024, 1),
                "peak_pss_mib": {k: round(v / 1024, 1) for k, v in self.peak_pss_kib.items()}}


# --- services -----------------------------------------------------------------------------------

def service_children(launcher_pid: int) -> dict[str, int]:
    """The services ``python -m testbed`` has started so far: ``{module: pid}`` of its children
    (``/proc/<pid>/task/<pid>/children``, the module from each ``python -m MODULE`` command line)."""
    try:
        pids = [int(p) for p in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()]
    except (OSError, ValueError):
        return {}
    found = {}
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue   # already gone (the configuration check's child)
        if "-m" in argv[:-1]:
            found[argv[argv.index("-m") + 1]] = pid
    return found


@dataclass
class TestbedRun:
    """A clean run of ``python -m testbed``: its round records and final model, the whole
    testbed's memory (:meth:`PssSampler.stop`), and the CPU seconds per round of the services
    together (None for a run of one round) and of each process."""

    records: list[RoundRecord]
    final_state: dict[str, torch.Tensor]
    memory: dict
    cpu_s_per_round: float | None
    cpu_s_per_round_per_process: dict[str, float]


def run_services(config: RunConfig, log: Callable[[str], None]) -> TestbedRun:
    """The run through the real ``python -m testbed`` (its own process, as a user starts it):
    per-round records, final model, peak PSS of the launcher and the services it starts."""
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-f-"))
    run_dir = root / "run"
    config_path = root / "config.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    command = [sys.executable, "-m", "testbed", "--config", str(config_path), "--run-dir", str(run_dir),
               "--log-level", "WARNING", "--timeout", "1800"]
    try:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=service_env()) as launcher:
            assert launcher.stdout is not None
            sampler: PssSampler | None = None
            cpu_at_round: list[dict[str, float]] = []
            output: list[str] = []
            try:
                for line in launcher.stdout:
                    output.append(line.rstrip())
                    if sampler is None and line.startswith("fed server "):
                        # Printed once the servers are healthy and the agent is started (its
                        # process may take a moment to show in /proc).
                        children = service_children(launcher.pid)
                        while "device_agent" not in children and launcher.poll() is None:
                            time.sleep(0.05)
                            children = service_children(launcher.pid)
                        if "device_agent" not in children:
                            continue   # the launcher failed: its output is reported below
                        # FedAvg: no Main Server is started.
                        assert "main_server" not in children, children
                        pids = {"launcher": launcher.pid, "fed_server": children["fed_server"],
                                f"device_agent ({config.data.num_devices} devices)": children["device_agent"]}
                        sampler = PssSampler(pids).start()
                    elif sampler is not None and line.startswith("round "):
                        cpu_at_round.append(sampler.cpu_now())
                        log(f"  services {line.split('  moved')[0]}")
            finally:
                memory = sampler.stop() if sampler is not None else {}
                if launcher.poll() is None:
                    launcher.terminate()
            if launcher.wait() != 0:
                raise RuntimeError("python -m testbed failed:\n" + "\n".join(output[-30:]))
        ok, final_state = clean_run_results(run_dir, config.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # CPU seconds of the whole testbed per round, from round 1's line to the last one (start-up,
    # imports and round 1's cold start left out); the launcher prints a round up to 0.5 s late,
    # which moves work between neighbouring rounds but not out of the total.
    per_process = ({name: (cpu_at_round[-1].get(name, 0.0) - first) / (len(cpu_at_round) - 1)
                    for name, first in cpu_at_round[0].items()} if len(cpu_at_round) > 1 else {})
    # The launcher only follows the run (status polls); its CPU is reported but, as before it was
    # its own process, left out of the services' sum.
    services_cpu = sum(v for name, v in per_process.items() if name != "launcher") if per_process else None
    return TestbedRun(ok, final_state, memory, services_cpu, per_process)


# --- in-process ---------------------------------------------------------------------------------

def run_in_process(config: RunConfig, records: list[RoundRecord], log: Callable[[str], None]) -> dict:
    """The services run's rounds (same participants, same seeds) in this process on one thread."""
    num_classes, input_shape = dataset_num_classes(config.data), dataset_input_shape(config.data)
    train_set, test_set = load_dataset(config.data)
    model = build_model(config.model, num_classes, input_shape, seed=config.seed, params=config.model_params)
    algorithm = build_algorithm(config)
    algorithm.bind_model(model)
    logic_class = ALGORITHMS[config.algorithm]
    n_blocks = len(model.blocks)
    ids = sorted({d for r in records for d in r.aggregated})
    shards = {d: int(d.rsplit("-", 1)[1]) for d in ids}   # testbed device ids are dev-<shard>
    data = {d: device_shard(config.data, train_set, shards[d]) for d in ids}
    device_model = copy.deepcopy(model)   # the agent, too, loads each task's weights into a model
    train = config.train
    round_times, accuracies, train_times, serial_times, cpu_times = [], [], [], [], []
    for record in records:
        t0, cpu0 = time.perf_counter(), time.process_time()
        global_portion = portion_state(model, 0, n_blocks)
        contributions: dict[str, Contribution] = {}
        device_times: dict[str, float] = {}
        for d in sorted(record.aggregated):
            t_device = time.perf_counter()
            train_round(device_model, n_blocks, global_portion, data[d],
                        TrainSettings.of(train, round_seed(config.seed, shards[d], record.round_id)),
                        TrainContext(RoundClock(None), logic=logic_class.device_logic(algorithm.device_params())))
            state = {k: v.detach().clone() for k, v in device_model.portion(0, n_blocks).state_dict().items()}
            contributions[d] = Contribution(weight=len(data[d]), client_state=state)
            device_times[d] = time.perf_counter() - t_device
        t_serial = time.perf_counter()
        model.load_state_dict(algorithm.aggregate(RoundContext(record.round, record.round_id), model.state_dict(), contributions, {}))
        accuracy = classification_accuracy(model, test_set)
        serial_times.append(time.perf_counter() - t_serial)
        train_times.append(device_times)
        round_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - cpu0)
        accuracies.append(accuracy)
        log(f"  in-process round {record.round}/{len(records)}: {round_times[-1]:.2f}s, acc {100 * accuracy:.2f}%")
    return {"round_times_s": round_times, "accuracies": accuracies, "final_state": model.state_dict(),
            "device_train_s": train_times, "cpu_s": cpu_times, "aggregate_evaluate_s": serial_times,
            "samples_per_device": {d: len(data[d]) for d in ids}}


def critical_path_round_s(device_train_s: dict[str, float], serial_s: float, cores: int) -> float:
    """A round's lower bound on ``cores`` cores from its one-thread parts: the devices' training
    packed perfectly, but never shorter than the longest device (one device is one thread), plus
    aggregation and evaluation, which run once the last upload is in."""
    times = list(device_train_s.values())
    return max(sum(times) / cores, max(times)) + serial_s


# --- both -----------------------------------------------------------------------------------------

#: This part's goals (benchmarks/README.md, "Goals").
GOAL_RATIO_OVER_LIMIT = 1.15
GOAL_PSS_MIB = 1.2e9 / 2 ** 20   # 1.2 GB, in MiB (1144.4)


def run(quick: bool, log: Callable[[str], None] = print, rounds: int | None = None) -> dict:
    """(f) figures: median round times, the ratios, accuracy agreement, peak PSS of the testbed."""
    config = bench_config(quick, rounds)
    cores = usable_cores()
    log(f"  FedAvg, {config.model}, {config.data.num_devices} devices, {config.rounds} rounds, "
        f"{config.data.max_samples or 'all'} samples, real devices (no emulation), {cores} usable cores")
    services = run_services(config, log)
    inproc = run_in_process(config, services.records, log)
    svc_times = round_periods(services.records)
    svc_median, inp_median = statistics.median(svc_times), statistics.median(inproc["round_times_s"])
    limit = inp_median / cores
    critical = statistics.median(critical_path_round_s(t, s, cores)
                                 for t, s in zip(inproc["device_train_s"], inproc["aggregate_evaluate_s"]))
    return {
        "config": {"algorithm": config.algorithm, "model": config.model, "devices": config.data.num_devices,
                   "rounds": config.rounds, "max_samples": config.data.max_samples, "alpha": config.data.alpha,
                   "batch_size": config.train.batch_size, "lr": config.train.lr,
                   "local_epochs": config.train.local_epochs, "device_profiles": "none (real devices, no emulation)",
                   "agents": 1, "usable_cores": cores},
        "services_round_s": svc_times,
        "in_process_round_s": inproc["round_times_s"],
        "services_median_round_s": svc_median,
        "in_process_median_round_s": inp_median,
        "two_core_limit_round_s": limit,
        "limit_definition": "single-thread in-process median round / usable cores",
        "ratio_services_over_in_process": svc_median / inp_median,
        "ratio_services_over_limit": svc_median / limit,
        # What the round's shape allows on these cores (see critical_path_round_s): the non-IID
        # shards differ in size, so the largest device and the serial evaluation bound the round.
        "critical_path_round_s": critical,
        "ratio_services_over_critical_path": svc_median / critical,
        "in_process_aggregate_evaluate_median_s": statistics.median(inproc["aggregate_evaluate_s"]),
        "in_process_longest_device_median_s": statistics.median(max(t.values()) for t in inproc["device_train_s"]),
        "samples_per_device": inproc["samples_per_device"],
        # CPU seconds per round: the load of other jobs on a shared machine stretches wall time but
        # hardly the CPU time a round needs, so this ratio is the steadier measure of the overhead.
        "services_cpu_s_per_round": services.cpu_s_per_round,
        "services_cpu_s_per_round_per_process": services.cpu_s_per_round_per_process,
        "in_process_cpu_s_per_round": statistics.mean(inproc["cpu_s"][1:] or inproc["cpu_s"]),
        "ratio_cpu_services_over_in_process": (services.cpu_s_per_round / statistics.mean(inproc["cpu_s"][1:] or inproc["cpu_s"])
                                               if services.cpu_s_per_round else None),
        "goal_ratio_services_over_limit": GOAL_RATIO_OVER_LIMIT,
        "services_final_accuracy": services.records[-1].test_accuracy,
        "in_process_final_accuracy": inproc["accuracies"][-1],
        "services_accuracy_per_round": [r.test_accuracy for r in services.records],
        "in_process_accuracy_per_round": inproc["accuracies"],
        "max_abs_weight_diff_final_model": max_abs_diff(services.final_state, inproc["final_state"]),
        "memory": {**services.memory, "goal_pss_sum_mib": round(GOAL_PSS_MIB, 1),
                   "source": "sum of Pss (and of Rss) in /proc/<pid>/smaps_rollup over the launcher, the Fed "
                             "Server and the agent, sampled together every second"},
    }
