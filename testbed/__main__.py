"""``python -m testbed``: run one configuration on a local testbed and write its run directory."""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path

from fed_server.records import read_round_records
from shared.config import DeviceMixConfig
from shared.service import interrupt_on_sigterm
from testbed.config_check import CheckFailed, CheckRequest, check_in_child
from testbed.follow import format_done, format_resumed, format_round
from testbed.runner import ENROLMENTS, Testbed, TestbedError, main_servers_for

# The launcher imports no torch (the memory it saves: benchmarks/why-the-code-is-as-it-is.md,
# "The launcher imports no torch"): the configuration is checked in a child
# (testbed/config_check.py), so the help texts point to the docs for the algorithm, model and
# torch device names instead of importing the registries that list them; a wrong name is refused
# by the check with the valid choices.


#: ``--paper-scale``: the paper's device population (100 devices, 10 sampled per round) and 30
#: rounds (the paper's round count). The default run is 10 devices, all per round, 20 rounds,
#: sized for the time goal of benchmarks/README.md, "Goals".
PAPER_SCALE = ("data.num_devices=100", "devices_per_round=10", "rounds=30")


def main(argv: list[str] | None = None) -> None:
    """``python -m testbed``: parse the flags, start the testbed, print each round as it is recorded
    and a summary at the end. Most of its length is the flags' declarations, kept in one place so
    ``--help`` and the README's testbed section can be read side by side."""
    parser = argparse.ArgumentParser(
        prog="python -m testbed",
        description="Run split federated learning on a local testbed: the Fed Server, the Main Server and "
                    "device agents start as separate processes on loopback and talk HTTP. Prints one line per "
                    "round and writes a run directory (config, metrics.jsonl, checkpoint, summary, logs).")
    parser.add_argument("--config", help="run configuration file (YAML/JSON); see docs/configuration.md")
    parser.add_argument("--algorithm", help="an algorithm: s2fl, sfl, fedavg, ... (all in docs/configuration.md; default s2fl)")
    parser.add_argument("--model", help="a built-in model (cnn, resnet8, ...: docs/builtin-models.md) or an import path "
                                        "package.module:function (docs/models.md; default cnn)")
    parser.add_argument("--rounds", type=int, help="number of rounds (default 20)")
    parser.add_argument("--devices", type=int, help="number of devices / data shards (default 10)")
    parser.add_argument("--per-round", type=int, help="devices selected per round (default: all)")
    parser.add_argument("--seed", type=int, help="seed of data partition, model init and selection")
    parser.add_argument("--paper-scale", action="store_true",
                        help="the S2FL paper's scale: " + ", ".join(PAPER_SCALE) + " (the emulated 5:3:2 mix as "
                             "always; the other flags and --set win over it); see docs/s2fl.md")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config value, e.g. --set data.alpha=0.1 --set train.lr=0.02 (repeatable)")
    parser.add_argument("--agents", type=int, default=1, help="device agent processes hosting the devices (default 1)")
    parser.add_argument("--main-servers", type=int, default=None,
                        help="Main Server processes (replicas) the round's groups are spread over (default 1; none for "
                             "a split-depth-zero algorithm such as fedavg, which never calls it)")
    parser.add_argument("--device-data", action="append", default=[], metavar="PATH",
                        help="for a run with data.dataset: local, one device agent started with --data PATH (repeatable; "
                             "docs/data.md); data.num_devices defaults to the number of devices these paths make")
    parser.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword passed (as a string) to a --device-data function package.module:function: every "
                             "agent started with --device-data gets it as its --data-arg (repeatable; docs/data.md)")
    parser.add_argument("--enrolment", choices=ENROLMENTS, default="secret",
                        help="how the devices enrol: secret, every agent with the run's shared enrolment secret "
                             "(default); credentials, each agent with its own enrolment credential covering exactly "
                             "its shards, under a fresh enrolment key (docs/security.md); not with --device-data")
    parser.add_argument("--real-links", action="store_true",
                        help="run each device's agent in a network namespace of its own, its link shaped with tbf to "
                             "its kind's rate times devices.time_scale (a number, not auto); emulates compute only. "
                             "Linux, root and iproute2 (ip, tc); docs/real-links.md")
    parser.add_argument("--agent-per-device", action="store_true",
                        help="one agent process per device, its kind (transfers included) emulated on loopback: the "
                             "layout of --real-links without the namespaces, to compare the two")
    parser.add_argument("--rtt-ms", type=float, default=0.0, metavar="MS",
                        help="a round-trip delay the agents add to each request of their devices (default 0): "
                             "application-level, as the shaped links add none (tc netem may be missing)")
    parser.add_argument("--run-dir", help="run directory (default runs/<time>-<algorithm>)")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    parser.add_argument("--log-level", default="INFO", help="log level of the services (their logs go to <run-dir>/logs)")
    parser.add_argument("--torch-device", default=None,
                        help="where the Main Server, the device agents and the Fed Server's evaluation compute: "
                             "auto, cpu, cuda, cuda:N, mps (default: each service's own default, cpu, or SFL_TORCH_DEVICE)")
    args = parser.parse_args(argv)
    if (args.real_links or args.agent_per_device) and (args.agents != 1 or args.device_data):
        parser.error("--real-links and --agent-per-device start one agent per device of the built-in data set: "
                     "not with --agents or --device-data")
    if args.data_arg and not args.device_data:
        parser.error("--data-arg is for the functions of --device-data")

    shortcuts = {"algorithm": args.algorithm, "model": args.model, "rounds": args.rounds,
                 "data.num_devices": args.devices, "devices_per_round": args.per_round, "seed": args.seed}
    if args.seed is not None:
        shortcuts["data.seed"] = args.seed
    overrides = ([*PAPER_SCALE] if args.paper_scale else []) + [
        f"{k}={v}" for k, v in shortcuts.items() if v is not None] + args.overrides  # --set wins
    request = CheckRequest(config_file=args.config, overrides=overrides, device_data=args.device_data,
                           count_given=args.devices is not None or any(o.startswith("data.num_devices=")
                                                                       for o in args.overrides),
                           torch_device=args.torch_device)
    try:
        checked = check_in_child(request)   # exits with status 2 and its lines on a bad configuration
    except CheckFailed as exc:
        print(f"testbed failed: {exc}", file=sys.stderr)
        sys.exit(1)
    if checked.usage_error:
        parser.error(checked.usage_error)
    config = checked.config
    assert config is not None and checked.split_mode is not None   # no usage error: the child checked it
    main_servers = args.main_servers if args.main_servers is not None else main_servers_for(checked.split_mode)
    run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.algorithm}"
    data = "local data" if config.data.dataset == "local" else (
        f"{config.data.dataset} {config.data.partition}{f'({config.data.alpha})' if config.data.partition == 'dirichlet' else ''}")
    print(f"testbed: {config.algorithm} | model {config.model} | {data} | {config.data.num_devices} devices, "
          f"{config.per_round} per round | {config.rounds} rounds | {_emulation(config.devices)}"
          f"{_layout(args.real_links, args.agent_per_device, args.rtt_ms)}", flush=True)
    print(f"run directory: {run_dir}", flush=True)
    for warning in checked.warnings:
        print(f"warning: {warning}", flush=True)
    interrupt_on_sigterm()
    # SIGINT too, even when it arrived ignored: a shell starts a background command of a script
    # (`python -m testbed ... &`) with SIGINT ignored, and Python then leaves it so; the run would
    # go on to its end after a `kill -INT` meant to stop it and print the command that resumes it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        testbed = Testbed(config, run_dir, agents=args.agents, log_level=args.log_level, device_data=args.device_data,
                          data_args=args.data_arg, torch_device=checked.torch_device, main_servers=main_servers,
                          enrolment=args.enrolment, real_links=args.real_links,
                          agent_per_device=args.agent_per_device, rtt_ms=args.rtt_ms)
        with testbed:
            mains = ", ".join(testbed.main_urls) or "none (split depth zero)"
            print(f"fed server {testbed.fed_url}, main server {mains}; waiting for devices ...",
                  flush=True)
            status = testbed.follow(lambda r, s: print(format_round(r, s), flush=True), timeout=args.timeout,
                                    on_resumed=lambda rounds: print(format_resumed(rounds), flush=True))
    except (TestbedError, TimeoutError, RuntimeError) as exc:
        print(f"testbed failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        summary = _summary(run_dir)
        if summary is not None:   # it finished while it was being interrupted
            print(format_done(summary))
            print(f"finished; services stopped. Results: {run_dir}", file=sys.stderr)
            sys.exit(0)
        resume = shlex.join(["python", "-m", "testbed", *(sys.argv[1:] if argv is None else argv),
                             *([] if args.run_dir else ["--run-dir", run_dir])])
        print(f"interrupted after {_rounds_done(run_dir)} of {config.rounds} rounds; services stopped. Resume from "
              f"its checkpoint with: {resume}", file=sys.stderr)
        sys.exit(130)
    print(format_done(status["summary"]))
    print(f"results: {run_dir}/metrics.jsonl, {run_dir}/summary.json, {run_dir}/checkpoint.msgpack")


def _summary(run_dir: str) -> dict | None:
    """``summary.json`` of a finished run (None while the run is not finished)."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _rounds_done(run_dir: str) -> int:
    """Completed rounds the run directory's records hold (what a resumed run starts after)."""
    return sum(1 for record in read_round_records(Path(run_dir) / "metrics.jsonl") if record.status == "ok")


def _emulation(devices: DeviceMixConfig) -> str:
    """The header's device-kind part: the kinds, and with emulated kinds the time scale."""
    text = f"kinds {','.join(devices.profiles)}"
    if not devices.profiles:
        return text
    text += f" | time scale {devices.time_scale}"
    if devices.time_scale == "auto":
        text += " (each agent logs what it measured: <run dir>/logs/agent-*.log)"
    return text


def _layout(real_links: bool, agent_per_device: bool, rtt_ms: float) -> str:
    """The header's part on the agents' layout, links and round-trip delay (nothing for the default)."""
    text = (" | real links: an agent per device, each in its own network namespace, shaped with tbf" if real_links
            else " | an agent per device, links emulated" if agent_per_device else "")
    return text + (f" | rtt {rtt_ms:g} ms" if rtt_ms else "")


if __name__ == "__main__":
    main()
