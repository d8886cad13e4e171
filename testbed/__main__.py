"""``python -m testbed``: run one configuration on a local testbed and write its run directory."""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from shared.algorithms.registry import ALGORITHMS
from shared.run_config import resolve_run_config
from shared.models.zoo import MODEL_NAMES
from testbed.processes import interrupt_on_sigterm
from testbed.runner import Testbed, TestbedError


def format_round(record: dict, status: dict) -> str:
    """One progress line per round."""
    splits = Counter(record["split_points"].values())
    split_text = " ".join(f"{k}:{n}" for k, n in sorted(splits.items()))
    flag = "" if record["status"] == "ok" else f"  [{record['status']}]"
    dropped = f"  dropped {len(record['dropped'])}" if record["dropped"] else ""
    return (f"round {record['round']:>3}/{status['rounds_total']}  acc {100 * record['test_accuracy']:6.2f}%  "
            f"loss {record['test_loss']:.3f}  round {record['round_time_s']:5.1f}s  elapsed {record['elapsed_s']:6.1f}s  "
            f"moved {record['bytes_total'] / 1e6:7.1f} MB (total {record['cumulative_bytes'] / 1e6:8.1f} MB)  "
            f"splits {split_text}{dropped}{flag}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m testbed",
        description="Run split federated learning on a local testbed: the Fed Server, the Main Server and "
                    "device agents start as separate processes on loopback and talk HTTP. Prints one line per "
                    "round and writes a run directory (config, metrics.jsonl, checkpoint, summary, logs).")
    parser.add_argument("--config", help="run configuration file (YAML/JSON); see docs/configuration.md")
    parser.add_argument("--algorithm", help=f"one of {', '.join(ALGORITHMS)} (default s2fl)")
    parser.add_argument("--model", help=f"a built-in model ({', '.join(MODEL_NAMES)}) or an import path "
                                        "package.module:function (docs/models.md; default cnn)")
    parser.add_argument("--rounds", type=int, help="number of rounds (default 30)")
    parser.add_argument("--devices", type=int, help="number of devices / data shards (default 10)")
    parser.add_argument("--per-round", type=int, help="devices selected per round (default: all)")
    parser.add_argument("--seed", type=int, help="seed of data partition, model init and selection")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config value, e.g. --set data.alpha=0.1 --set train.lr=0.02 (repeatable)")
    parser.add_argument("--agents", type=int, default=1, help="device agent processes hosting the devices (default 1)")
    parser.add_argument("--run-dir", help="run directory (default runs/<time>-<algorithm>)")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    parser.add_argument("--log-level", default="INFO", help="log level of the services (their logs go to <run-dir>/logs)")
    args = parser.parse_args(argv)

    shortcuts = {"algorithm": args.algorithm, "model": args.model, "rounds": args.rounds,
                 "data.num_devices": args.devices, "devices_per_round": args.per_round, "seed": args.seed}
    if args.seed is not None:
        shortcuts["data.seed"] = args.seed
    overrides = [f"{k}={v}" for k, v in shortcuts.items() if v is not None] + args.overrides  # --set wins
    try:
        config = resolve_run_config(args.config, overrides)
    except ValueError as exc:
        parser.error(str(exc))
    run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.algorithm}"
    print(f"testbed: {config.algorithm} | model {config.model} | {config.data.dataset} {config.data.partition}"
          f"{f'({config.data.alpha})' if config.data.partition == 'dirichlet' else ''} | {config.data.num_devices} devices, "
          f"{config.per_round} per round | {config.rounds} rounds | kinds {','.join(config.devices.profiles)}", flush=True)
    print(f"run directory: {run_dir}", flush=True)
    testbed = Testbed(config, run_dir, agents=args.agents, log_level=args.log_level)
    interrupt_on_sigterm()
    try:
        with testbed:
            print(f"fed server {testbed.fed_url}, main server {testbed.main_url}; waiting for devices ...", flush=True)
            status = testbed.follow(lambda r, s: print(format_round(r, s), flush=True), timeout=args.timeout)
    except (TestbedError, TimeoutError, RuntimeError) as exc:
        print(f"testbed failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted; services stopped", file=sys.stderr)
        sys.exit(130)
    s = status["summary"]
    print(f"done: {s['rounds']} rounds, final accuracy {100 * s['final_accuracy']:.2f}% (best {100 * s['best_accuracy']:.2f}%), "
          f"median round {s['median_round_time_s']:.1f}s, total {s['total_time_s']:.1f}s, {s['total_bytes'] / 1e6:.1f} MB moved")
    print(f"results: {run_dir}/metrics.jsonl, {run_dir}/summary.json, {run_dir}/checkpoint.msgpack")


if __name__ == "__main__":
    main()
