"""(i) The Main Server's peak memory against the size of the server portion it trains.

A ResNet-18 (torchvision's, written here as one ``nn.Module`` with its own ``forward``, so the
project traces it and cuts it between its layers: torchvision is not installed) trains under S2FL
through the real services, every device cut at one fixed point, the one after the stem
(``split.sliding: false`` with ``split.candidates: [k]``), so the Main Server trains nearly the whole
network: a server portion of 42.7 MiB (44.7 MB) of float32 weights and buffers. The same short run goes with
3 and with 10 devices (groups of 4: one and three server-side copies). Figures: the Main Server's
peak resident set (VmHWM) and its resident set before the first round (the fixed base: Python,
torch, the HTTP stack), both against the portion's size. Goal: peak at most 4x the portion plus
the base.

``python -m benchmarks.main_server_memory [--devices 3,10] [--rounds 3] [--name NAME]`` (about 6
minutes on 2 cores); also ``python -m benchmarks.run --only i`` (``--quick``: 3 devices, 2 rounds).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fed_server.records import RoundRecord
from benchmarks.result_files import add_name_option, default_out, write_json
from shared.config import RunConfig
from shared.machine import PeakMemorySampler, describe_machine, proc_status_kib
from shared.models.zoo import BasicBlock   # torchvision's basic block: 3x3 convolutions, projection shortcut
from shared.run_config import load_run_config
from testbed.runner import Testbed

MODEL = "benchmarks.main_server_memory:ResNet18"
#: The goal: the Main Server's peak at most this many server portions above its base.
GOAL_PORTIONS = 4.0


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` (11.2 M parameters for 10 classes): a 7x7 stride-2 stem and max
    pool, four stages of two basic blocks (64, 128, 256, 512 channels), global average pool, fc."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths = [64, 64, 128, 256, 512]
        self.layer1, self.layer2, self.layer3, self.layer4 = (
            nn.Sequential(BasicBlock(widths[i], widths[i + 1], 1 if i == 0 else 2), BasicBlock(widths[i + 1], widths[i + 1]))
            for i in range(4))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def fixed_cut(split_points: Sequence[int], block_names: Sequence[str]) -> int:
    """The split point right after the stem: the first whose next block is in ``layer1``."""
    return next(k for k in split_points if block_names[k].startswith("layer1"))


def sizes(quick: bool) -> tuple[tuple[int, ...], int]:
    """The device counts and the rounds of a run: 3 and 10 devices for 3 rounds; quick, 3 for 2."""
    return ((3,), 2) if quick else ((3, 10), 3)


def bench_config(devices: int, rounds: int, cut: int) -> RunConfig:
    """S2FL, every device cut at ``cut``; MNIST as 3x32x32 images, 60 a device, batches of 16."""
    return load_run_config({
        "algorithm": "s2fl",
        "model": MODEL,
        "rounds": rounds,
        "data": {"num_devices": devices, "partition": "iid", "seed": 1, "max_samples": 60 * devices,
                 "transform": "rgb32"},
        "train": {"lr": 0.05, "batch_size": 16},
        "split": {"sliding": False, "candidates": [cut]},
        "grouping": {"group_size": 4},
        "deadlines": {"round_s": 900, "join_s": 300, "step_s": 300},
        "devices": {"profiles": []},
        "seed": 1,
    })


def run_one(config: RunConfig, log: Callable[[str], None]) -> dict:
    """One run through the services: the Main Server's resident set before the first round and
    after each, and its peak."""
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-main-memory-"))
    try:
        testbed = Testbed(config, root / "run", agents=1, log_level="WARNING")
        sampler: PeakMemorySampler | None = None
        after_round: list[float] = []
        try:
            testbed.start()
            assert testbed.main is not None
            pid = testbed.main.process.pid
            base = (proc_status_kib(pid, "VmRSS") or 0) / 1024
            sampler = PeakMemorySampler({"main_server": pid}).start()
            started = time.perf_counter()

            def on_round(record: RoundRecord, _status: dict) -> None:
                after_round.append((proc_status_kib(pid, "VmRSS") or 0) / 1024)
                log(f"  round {record.round}/{config.rounds} {record.status}: {record.round_time_s:.1f}s, "
                    f"Main Server {after_round[-1]:.0f} MiB now")

            status = testbed.follow(on_round=on_round, timeout=3600)
            wall = time.perf_counter() - started
        finally:
            peak = sampler.stop()["main_server"] if sampler is not None else float("nan")
            testbed.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    records = status["history"]
    return {"devices": config.data.num_devices, "rounds": config.rounds,
            "groups": max(len(r["groups"]) for r in records),
            "rounds_ok": sum(r["status"] == "ok" for r in records), "dropped": sorted({d for r in records for d in r["dropped"]}),
            "main_server_base_rss_mib": round(base, 1), "main_server_rss_after_round_mib": [round(x, 1) for x in after_round],
            "main_server_peak_rss_mib": peak, "run_s": round(wall, 1)}


def run(device_counts: Sequence[int] = (3, 10), rounds: int = 3, log: Callable[[str], None] = print) -> dict:
    """Every population in ``device_counts``, with the portion's size and the goal's verdict."""
    from shared.models import build_model_layout, profile_model

    model = build_model_layout(MODEL, 10, (3, 32, 32))
    cut = fixed_cut(model.split_points, model.block_names())
    portion_mib = profile_model(model, MODEL).cost(cut).server_param_bytes / 2**20
    log(f"  ResNet-18, {len(model.blocks)} traced blocks, cut at split point {cut}: server portion {portion_mib:.1f} MiB")
    runs = []
    for devices in device_counts:
        log(f"  {devices} devices, {rounds} rounds")
        result = run_one(bench_config(devices, rounds, cut), log)
        above = result["main_server_peak_rss_mib"] - result["main_server_base_rss_mib"]
        result.update(portions_above_base=round(above / portion_mib, 2),
                      goal_met=above <= GOAL_PORTIONS * portion_mib)
        log(f"  {devices} devices: peak {result['main_server_peak_rss_mib']:.0f} MiB, base "
            f"{result['main_server_base_rss_mib']:.0f} MiB: {result['portions_above_base']:.2f} portions above the base")
        runs.append(result)
    return {"model": "ResNet-18 (traced, benchmarks/main_server_memory.py)", "input_shape": [3, 32, 32],
            "split_point": cut, "server_portion_mib": round(portion_mib, 1), "goal_portions_above_base": GOAL_PORTIONS,
            "runs": runs, "source": "VmRSS and VmHWM of /proc/<pid>/status, VmHWM sampled every 0.25 s"}


def report(results: dict) -> str:
    """The table of :func:`run`'s results."""
    lines = [f"{results['model']}, input {results['input_shape']}, cut at {results['split_point']}: server portion "
             f"{results['server_portion_mib']} MiB; goal: peak <= base + {results['goal_portions_above_base']:g} portions",
             "devices  groups  rounds ok  base MiB  peak MiB  portions above base  after each round MiB  goal"]
    for r in results["runs"]:
        lines.append(f"{r['devices']:>7}  {r['groups']:>6}  {r['rounds_ok']:>9}  {r['main_server_base_rss_mib']:>8.0f}  "
                     f"{r['main_server_peak_rss_mib']:>8.0f}  {r['portions_above_base']:>19.2f}  "
                     f"{' '.join(f'{x:.0f}' for x in r['main_server_rss_after_round_mib']):>20}  "
                     f"{'met' if r['goal_met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.main_server_memory", description=__doc__.split("\n\n")[0])
    counts, rounds = sizes(quick=False)
    parser.add_argument("--devices", default=",".join(map(str, counts)),
                        help=f"comma-separated device counts (default {','.join(map(str, counts))})")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"rounds of each run (default {rounds})")
    add_name_option(parser, "main-server-memory")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {"machine": describe_machine(), **run(tuple(int(n) for n in args.devices.split(",")), args.rounds)}
    print(report(results))
    out = write_json(results, args.out or default_out(results["machine"]["date_utc"], args.name))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
