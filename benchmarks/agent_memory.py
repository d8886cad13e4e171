"""(e) Peak memory of one agent hosting many virtual devices: models kept vs built per task.

The same FedAvg run (the whole model trains on the device: the largest device footprint) goes
through the real services twice, with ``SFL_KEEP_MODELS=yes`` (every device keeps a full model
for the run) and ``=no`` (a device allocates the blocks it trains when a task arrives and frees
them after the upload). Figures: the agent's peak RSS (VmHWM) in each mode, their ratio, mean
round time in each mode (rebuilding costs time), and whether the two final global models are
identical (they must be: the per-task model changes where weights live, not the math).
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch

from benchmarks.network_overhead import run_services
from shared.config import RunConfig
from shared.run_config import load_run_config


def bench_config(quick: bool) -> RunConfig:
    """Quick: 20 small-CNN devices, 5 per round. Full: 100 VGG-16 devices, 10 per round, as in
    the Table 2 grid (few samples each: the point is memory, not accuracy)."""
    if quick:
        model, devices, per_round, samples, transform = "cnn", 20, 5, 400, "none"
    else:
        model, devices, per_round, samples, transform = "vgg16", 100, 10, 2000, "rgb32"
    return load_run_config({
        "algorithm": "fedavg",
        "model": model,
        "rounds": 2,
        "devices_per_round": per_round,
        "data": {"num_devices": devices, "partition": "iid", "seed": 1, "max_samples": samples, "transform": transform},
        "train": {"lr": 0.05, "batch_size": 10},
        "deadlines": {"round_s": 600},
        "devices": {"profiles": []},
        "seed": 1,
    })


def run(quick: bool, log: Callable[[str], None] = print) -> dict:
    config = bench_config(quick)
    log(f"  FedAvg, {config.model}, {config.data.num_devices} devices in one agent, {config.devices_per_round} per round, "
        f"{config.rounds} rounds, real devices (no emulation)")
    modes: dict[str, dict] = {}
    previous = os.environ.get("SFL_KEEP_MODELS")
    try:
        for keep in ("yes", "no"):
            os.environ["SFL_KEEP_MODELS"] = keep
            result = run_services(config, log)
            agent = next(v for k, v in result.peak_memory_mib.items() if k.startswith("device_agent"))
            modes[keep] = {"agent_peak_rss_mib": agent, "peak_rss_mib": result.peak_memory_mib,
                           "mean_round_s": statistics.mean(r.round_time_s for r in result.records),
                           "final_state": result.final_state}
            log(f"  keep models {keep}: agent peak RSS {agent:.0f} MiB, mean round {modes[keep]['mean_round_s']:.2f}s")
    finally:
        if previous is None:
            os.environ.pop("SFL_KEEP_MODELS", None)
        else:
            os.environ["SFL_KEEP_MODELS"] = previous
    kept, per_task = modes["yes"], modes["no"]
    return {
        "config": {"algorithm": config.algorithm, "model": config.model, "devices": config.data.num_devices,
                   "devices_per_round": config.devices_per_round, "rounds": config.rounds,
                   "max_samples": config.data.max_samples, "agents": 1},
        "agent_peak_rss_mib_kept": kept["agent_peak_rss_mib"],
        "agent_peak_rss_mib_per_task": per_task["agent_peak_rss_mib"],
        "ratio_kept_over_per_task": kept["agent_peak_rss_mib"] / per_task["agent_peak_rss_mib"],
        "mean_round_s_kept": kept["mean_round_s"],
        "mean_round_s_per_task": per_task["mean_round_s"],
        "same_final_model": all(torch.equal(kept["final_state"][k], v) for k, v in per_task["final_state"].items()),
        "peak_rss_mib_all_services": {"kept": kept["peak_rss_mib"], "per_task": per_task["peak_rss_mib"]},
        "source": "VmHWM of /proc/<pid>/status, sampled every 0.25 s",
    }
