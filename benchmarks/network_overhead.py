"""(a) The same S2FL run through the services and in one process; (d) peak memory of each service.

Services: the real testbed (Fed Server, Main Server, one device agent hosting every device, each
its own process on loopback, one torch thread each), real devices (``devices.profiles=[]``: no
emulated stretching or transfer sleeps, so the difference is the cost of the services
themselves: HTTP, msgpack, schema checks, barriers, scheduling of three processes).

In-process: the same math in this one process and one thread, replayed round by round from the
services run: the split point of every device is the one the Fed Server chose (S2FL's sliding
split depends on measured times, so it is taken from the run's metrics rather than re-decided),
the groups are recomputed with the Main Server's own grouping plug-in (and checked against
the run's), and then exactly the services' code paths without the network: the device loop of
``device_agent.trainer.train_round`` (same batch-order seed per device and round), one
``GroupTrainer.step`` per group and step over the members' batches (the per-step barrier),
the algorithm's ``aggregate`` (Algorithm 1) and ``evaluate`` on the same test set.

Figures: seconds per round of both (the Fed Server's round time: dispatch to evaluated model;
in-process: training + aggregation + evaluation), their ratio, final accuracies, and the
largest absolute difference between the two final global models. The Main Server concatenates
a group's members' batches in device order whatever order their steps arrive in, as this replay
does, so the two compute the same floats. Float summation order would otherwise move the model
(training amplifies rounding), so a second, untimed replay with every group's members in reverse
order measures how far order alone moves it: the yardstick for the first difference.
"""
from __future__ import annotations

import copy
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.machine import PeakMemorySampler
from device_agent.trainer import batches, round_seed, steps_per_round
from shared.evaluation import classification_accuracy
from fed_server.records import RoundRecord, read_round_records
from fed_server.run_dir import RunDirectory
from main_server.group_trainer import GroupMember, GroupTrainer, MemberBatch
from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext
from shared.algorithms.grouping import GroupCandidate, grouping_rng
from shared.algorithms.registry import build_algorithm, build_group_loss, build_grouping
from shared.config import RunConfig
from shared.run_config import load_run_config
from shared.data import dataset_input_shape, dataset_num_classes, device_shard, load_dataset
from shared.models import build_model
from shared.portions import portion_state
from testbed.runner import Testbed



def clean_run_results(run_dir: Path, rounds: int) -> tuple[list[RoundRecord], dict[str, torch.Tensor]]:
    """The round records and final model of a finished services run, for a comparison with the
    in-process run; RuntimeError unless all ``rounds`` succeeded with no device dropped (a figure
    of a run that lost devices would compare different math)."""
    finished_run = RunDirectory(run_dir)
    records = read_round_records(finished_run.metrics_path)
    _, final_state, _ = finished_run.read_checkpoint()
    ok = [r for r in records if r.status == "ok"]
    if len(ok) != rounds or any(r.dropped for r in ok):
        raise RuntimeError(f"the services run was not clean: {[(r.round, r.status, r.dropped) for r in records]}")
    return ok, final_state


def round_periods(records: list[RoundRecord]) -> list[float]:
    """Seconds each round cost the services run: a record's ``elapsed_s`` minus the previous one's
    (the first: its own). Both are taken when the round's model is complete; the Fed Server's
    evaluation of a round runs beside the next round's training, so ``round_time_s`` leaves it out
    while the period includes whatever it delayed."""
    elapsed = [r.elapsed_s for r in records]
    return [t - before for t, before in zip(elapsed, [0.0, *elapsed[:-1]])]


def bench_config(quick: bool) -> RunConfig:
    """S2FL on the embedded MNIST subset with real (non-emulated) devices."""
    if quick:
        devices, rounds, samples, group = 4, 2, 600, 2
    else:
        devices, rounds, samples, group = 10, 5, 4000, 5
    return load_run_config({
        "algorithm": "s2fl",
        "rounds": rounds,
        "data": {"num_devices": devices, "partition": "dirichlet", "alpha": 0.5, "seed": 1, "max_samples": samples},
        "train": {"lr": 0.05, "batch_size": 32},
        "grouping": {"group_size": group},
        "deadlines": {"round_s": 600, "join_s": 120, "step_s": 120},
        "devices": {"profiles": []},
        "seed": 1,
    })


# --- services -----------------------------------------------------------------------------------

@dataclass
class ServicesRun:
    """A clean run through the real services: its round records, final model, the peak memory of
    each service (MiB) and the seconds to start the services and to run the rounds."""

    records: list[RoundRecord]
    final_state: dict[str, torch.Tensor]
    peak_memory_mib: dict[str, float]
    startup_s: float
    run_wall_s: float


def run_services(config: RunConfig, log: Callable[[str], None]) -> ServicesRun:
    """The run through the real services; per-round records, final model, peak memory per service."""
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-"))
    run_dir = root / "run"
    try:
        t_start = time.perf_counter()
        testbed = Testbed(config, run_dir, agents=1, log_level="WARNING")
        sampler: PeakMemorySampler | None = None
        try:
            testbed.start()
            assert testbed.fed is not None
            pids = {"fed_server": testbed.fed.process.pid}
            if testbed.main is not None:   # a split-depth-zero run, (e)'s FedAvg, starts no Main Server
                pids["main_server"] = testbed.main.process.pid
            for service in testbed.agent_services:
                pids[f"device_agent ({service.name}, {config.data.num_devices} devices)"] = service.process.pid
            sampler = PeakMemorySampler(pids).start()
            t_ready = time.perf_counter()

            def on_round(record: RoundRecord, _status: dict) -> None:
                accuracy = "n/a" if record.test_accuracy is None else f"{100 * record.test_accuracy:.2f}%"
                log(f"  services round {record.round}/{config.rounds}: {record.round_time_s:.2f}s, "
                    f"acc {accuracy}, splits {sorted(set(record.split_points.values()))}")

            testbed.follow(on_round=on_round, timeout=1800)
            t_done = time.perf_counter()
        finally:
            if sampler is not None:
                peak = sampler.stop()
            testbed.stop()
        ok, final_state = clean_run_results(run_dir, config.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return ServicesRun(ok, final_state, peak, t_ready - t_start, t_done - t_ready)


# --- in-process ---------------------------------------------------------------------------------

def _train_group(model_template, device_models: dict, global_model, members: list[str], split: dict[str, int],
                 shards: dict[str, int], data: dict, config: RunConfig, round_id: int, grouping_start: int,
                 reverse: bool = False):
    """One group of one round: every member's device loop and the group's server copy, step by
    step; the members' batches are concatenated in ``members`` order, or reversed. Like the
    services, each device keeps its model object across rounds (``device_models``) and the
    group's server copy is a fresh deep copy of the template (as the Main Server makes)."""
    train = config.train
    n_blocks = len(global_model.blocks)
    trainer = GroupTrainer(copy.deepcopy(model_template), grouping_start,
                           portion_state(global_model, grouping_start, n_blocks), lr=train.lr,
                           momentum=train.momentum, weight_decay=train.weight_decay,
                           group_loss=build_group_loss(config.grouping.group_loss),
                           members={m: GroupMember(len(data[m]), split[m]) for m in members})
    clients, optimizers, iters, num_steps = {}, {}, {}, {}
    for m in members:
        portion = device_models[m].portion(0, split[m])
        portion.load_state_dict(portion_state(global_model, 0, split[m]), strict=True)
        portion.train()
        clients[m] = portion
        optimizers[m] = torch.optim.SGD(portion.parameters(), lr=train.lr, momentum=train.momentum,
                                        weight_decay=train.weight_decay)
        iters[m] = batches(data[m], train.batch_size, train.local_epochs, round_seed(config.seed, shards[m], round_id))
        num_steps[m] = steps_per_round(len(data[m]), train.batch_size, train.local_epochs)
    for step in range(max(num_steps.values())):
        active = [m for m in members if num_steps[m] > step]
        fxs, member_batches = {}, []
        for m in active:
            x, y = next(iters[m])
            fxs[m] = clients[m](x)
            member_batches.append(MemberBatch(m, split[m], fxs[m].detach(), y))
        results = trainer.step(member_batches[::-1] if reverse else member_batches)
        for m in active:
            optimizers[m].zero_grad(set_to_none=True)
            fxs[m].backward(results[m].dfx.to(fxs[m].dtype))
            optimizers[m].step()
    client_states = {m: {k: v.detach().clone() for k, v in clients[m].state_dict().items()} for m in members}
    return client_states, trainer.state()


def run_in_process(config: RunConfig, records: list[RoundRecord], log: Callable[[str], None], reverse: bool = False) -> dict:
    """Replay the services run's rounds (their split points) in this process, without the network
    (``reverse``: every group's members concatenated in reverse id order)."""
    t_setup = time.perf_counter()
    num_classes, input_shape = dataset_num_classes(config.data), dataset_input_shape(config.data)
    train_set, test_set = load_dataset(config.data)
    template = build_model(config.model, num_classes, input_shape, seed=config.seed, params=config.model_params)
    model = build_model(config.model, num_classes, input_shape, seed=config.seed, params=config.model_params)
    algorithm = build_algorithm(config)
    algorithm.bind_model(model)
    ids = sorted({d for r in records for d in r.split_points})
    shards = {d: int(d.rsplit("-", 1)[1]) for d in ids}   # testbed device ids are dev-<shard>
    data = {d: device_shard(config.data, train_set, shards[d]) for d in ids}
    device_models = {d: copy.deepcopy(template) for d in ids}
    setup_s = time.perf_counter() - t_setup
    round_times, accuracies, groups_match = [], [], True
    for record in records:
        t0 = time.perf_counter()
        split = dict(record.split_points)
        participants = sorted(split)
        candidates = {d: GroupCandidate.of(data[d].label_counts().tolist(), split[d], max(1, len(data[d])))
                      for d in participants}
        groups = build_grouping(algorithm.grouping()).form(candidates, config.grouping.group_size,
                                                           grouping_rng(config.seed, record.round_id))
        recorded = sorted(sorted(g.members) for g in record.groups)
        groups_match &= sorted(sorted(g) for g in groups) == recorded
        contributions: dict[str, Contribution] = {}
        for members in groups:
            start = min(split[m] for m in members)
            client_states, server_state = _train_group(template, device_models, model, list(members), split, shards,
                                                       data, config, record.round_id, start, reverse)
            for m in members:
                contributions[m] = Contribution(weight=len(data[m]), client_state=client_states[m], server_state=server_state)
        contributions = dict(sorted(contributions.items()))
        new_state = algorithm.aggregate(RoundContext(record.round, record.round_id), model.state_dict(), contributions, {})
        model.load_state_dict(new_state)
        accuracy = classification_accuracy(model, test_set)
        round_times.append(time.perf_counter() - t0)
        accuracies.append(accuracy)
        log(f"  in-process{' (reversed)' if reverse else ''} round {record.round}/{len(records)}: "
            f"{round_times[-1]:.2f}s, acc {100 * accuracy:.2f}%")
    return {"round_times_s": round_times, "accuracies": accuracies, "final_state": model.state_dict(),
            "setup_s": setup_s, "groups_match_services": groups_match}


# --- both -----------------------------------------------------------------------------------------

def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts (over ``b``'s keys), in float64."""
    return max(float((a[k].double() - v.double()).abs().max()) for k, v in b.items())


def run(quick: bool, log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """Returns ((a) network overhead figures, (d) peak memory figures)."""
    config = bench_config(quick)
    log(f"  S2FL, {config.data.num_devices} devices, {config.rounds} rounds, "
        f"{config.data.max_samples} samples, group size {config.grouping.group_size}, real devices (no emulation)")
    services = run_services(config, log)
    inproc = run_in_process(config, services.records, log)
    reversed_order = run_in_process(config, services.records, log, reverse=True)
    svc_times = round_periods(services.records)
    svc_mean, inp_mean = statistics.mean(svc_times), statistics.mean(inproc["round_times_s"])
    overhead = {
        "config": {"algorithm": config.algorithm, "model": config.model, "devices": config.data.num_devices,
                   "rounds": config.rounds, "max_samples": config.data.max_samples,
                   "batch_size": config.train.batch_size, "group_size": config.grouping.group_size,
                   "device_profiles": "none (real devices, no emulation)", "agents": 1},
        "split_points_per_round": [sorted(set(r.split_points.values())) for r in services.records],
        "services_round_s": svc_times,
        "in_process_round_s": inproc["round_times_s"],
        "services_mean_round_s": svc_mean,
        "in_process_mean_round_s": inp_mean,
        "ratio_services_over_in_process": svc_mean / inp_mean,
        # Round 1 carries both sides' cold start (first use of every kernel, connection set-up).
        "ratio_without_round_1": (statistics.mean(svc_times[1:]) / statistics.mean(inproc["round_times_s"][1:])
                                  if len(svc_times) > 1 else None),
        "services_final_accuracy": services.records[-1].test_accuracy,
        "in_process_final_accuracy": inproc["accuracies"][-1],
        "services_accuracy_per_round": [r.test_accuracy for r in services.records],
        "in_process_accuracy_per_round": inproc["accuracies"],
        "max_abs_weight_diff_final_model": max_abs_diff(services.final_state, inproc["final_state"]),
        # How far the concatenation order alone moves the model: the yardstick for the line above.
        "max_abs_weight_diff_member_order": max_abs_diff(reversed_order["final_state"], inproc["final_state"]),
        "in_process_reversed_accuracy_per_round": reversed_order["accuracies"],
        "groups_match_services": inproc["groups_match_services"],
        "services_startup_s": services.startup_s,
        "services_run_wall_s": services.run_wall_s,
        "in_process_setup_s": inproc["setup_s"],
        "bytes_per_round_services": [r.bytes_total for r in services.records],
    }
    memory = {"peak_rss_mib": services.peak_memory_mib,
              "source": "VmHWM of /proc/<pid>/status, sampled every 0.25 s during (a)'s services run"}
    return overhead, memory
