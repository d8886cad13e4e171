"""What one aggregation costs the Fed Server under each aggregation rule.

Each registered rule (``aggregation.rule``, shared/algorithms/registry.py) aggregates the same
round: ``--devices`` uploads of a built-in model's whole state, each the global state plus
Gaussian noise (standard deviation 0.01) on every floating entry, with sample counts 150, 160,
170, ... (so weights differ and no bound binds). The figure is the wall time of
``AggregationRule.aggregate`` on one torch thread, as the Fed Server runs it, after one untimed
call: the fastest and the mean of ``--repeats`` calls.

``python -m benchmarks.aggregation_rules [--model cnn] [--devices 10] [--repeats 3]
[--rules median,trimmed_mean] [--name NAME] [--out FILE]`` prints a line per rule and writes the
rows as JSON (``benchmarks/results/<UTC date>_aggregation-rules/results.json`` by default).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.result_files import add_name_option, default_out, write_json
from shared.algorithms.aggregation import Contribution
from shared.algorithms.registry import AGGREGATION_RULES
from shared.machine import describe_machine
from shared.models import build_model


def round_inputs(model: str, devices: int) -> tuple[dict[str, torch.Tensor], dict[str, Contribution]]:
    """The global state of ``model`` and ``devices`` whole-model uploads around it (seeded)."""
    global_state = {k: v.detach().clone() for k, v in build_model(model).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    uploads = {}
    for i in range(devices):
        state = {k: v + 0.01 * torch.randn(v.shape, generator=generator, dtype=v.dtype) if v.is_floating_point() else v
                 for k, v in global_state.items()}
        uploads[f"dev-{i:03d}"] = Contribution(150.0 + 10 * i, state)
    return global_state, uploads


def time_rule(rule: str, global_state: dict[str, torch.Tensor], uploads: dict[str, Contribution],
              repeats: int) -> dict:
    """One untimed call of ``rule`` (default parameters), then ``repeats`` timed ones."""
    aggregator = AGGREGATION_RULES[rule]({})
    aggregator.aggregate(global_state, uploads)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        aggregator.aggregate(global_state, uploads)
        seconds.append(time.perf_counter() - start)
    return {"rule": rule, "seconds": seconds, "min_s": min(seconds), "mean_s": statistics.fmean(seconds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.aggregation_rules",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", help="a built-in model (default cnn)")
    parser.add_argument("--devices", type=int, default=10, help="uploads in the round (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per rule (default 3)")
    parser.add_argument("--rules", default=",".join(AGGREGATION_RULES),
                        help=f"comma-separated (default all: {', '.join(AGGREGATION_RULES)})")
    add_name_option(parser, "aggregation-rules")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file (default benchmarks/results/<UTC date>_<name>/results.json)")
    args = parser.parse_args(argv)
    rules = args.rules.split(",")
    unknown = [r for r in rules if r not in AGGREGATION_RULES]
    if unknown:
        parser.error(f"--rules: unknown {', '.join(unknown)} (known: {', '.join(AGGREGATION_RULES)})")
    if args.devices < 1 or args.repeats < 1:
        parser.error("--devices and --repeats must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)   # as the Fed Server aggregates
    machine = describe_machine()
    global_state, uploads = round_inputs(args.model, args.devices)
    parameters = sum(v.numel() for v in global_state.values() if v.is_floating_point())
    print(f"{args.model}: {parameters:,} floating parameters, {args.devices} uploads, {args.repeats} timed calls a rule",
          flush=True)
    rows = []
    for rule in rules:
        row = time_rule(rule, global_state, uploads, args.repeats)
        rows.append(row)
        print(f"{rule:>13}: fastest {row['min_s'] * 1e3:8.1f} ms, mean {row['mean_s'] * 1e3:8.1f} ms", flush=True)
    out = write_json({"machine": machine, "model": args.model, "devices": args.devices, "parameters": parameters,
                      "load_average_1min_end": os.getloadavg()[0], "rules": rows},
                     args.out or default_out(machine["date_utc"], args.name))
    print(f"results: {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
