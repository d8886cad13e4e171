"""``python -m benchmarks.run [--quick] [--only a,b,c] [--name NAME] [--out PATH]``: the system benchmark.

(a) the same S2FL run through the services vs in one process (network overhead ratio),
(b) tensor encode/decode throughput, (c) Main Server step latency and throughput with 10, 50 and
100 virtual devices, (d) peak memory of each service (measured during (a)), (e) peak memory of an
agent hosting many virtual devices, models kept vs built per task, (f) FedAvg through the services
vs the same math in one process and vs the 2-core limit, with the whole testbed's peak PSS, (g) harmful devices
against an honest control (benchmarks/attacks.py; about two hours, so only when named), (h) populations of 100 to
10,000 devices and S2FL at 1,000: registration time, round time, memory per device (benchmarks/population.py; only
when named), (i) the Main Server's peak memory against its server portion's size, a ResNet-18 at 3 and 10 devices
(benchmarks/main_server_memory.py; only when named), (j) the sliding split in a fleet that changes mid-run: links
that drop and recover, compute that halves, a fast device among slow ones, against the best fixed split per device
(benchmarks/scenarios.py; only when named), (k) what an honest-but-curious server learns of the devices' labels and
inputs in each privacy setting, and what each setting costs (benchmarks/privacy.py; only when named), (l) secure
aggregation's cost against plain FedAvg at 10 and 100 devices a round, with dropouts
(benchmarks/secure_aggregation.py; only when named), (m) final accuracy against epsilon with central noise, FedAvg
at 100 and 1,000 devices and S2FL's default run (benchmarks/dp_accuracy.py; only when named). Prints a table and writes
every figure plus a description of the machine to a JSON file: by default
``benchmarks/results/<UTC date>_<name>/results.json``, the name saying what the run measured (by default the
parts run, e.g. ``parts-b-c``). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from benchmarks.result_files import add_name_option, default_out, write_json

PARTS = ("a", "b", "c", "e", "f", "g", "h", "i", "j", "k", "l", "m")  # (d) comes with (a)
DEFAULT_PARTS = ("a", "b", "c", "e", "f")   # (g) to (m) run only when named
#: The parts with a module of their own: (results key, module under benchmarks/, report title).
SEPARATE_PARTS = (
    ("attacks", "attacks", "(g) harmful devices against an honest control"),
    ("population", "population", "(h) large populations"),
    ("main_server_memory", "main_server_memory", "(i) the Main Server's peak memory against its server portion"),
    ("scenarios", "scenarios", "(j) the sliding split in a fleet that changes"),
    ("privacy", "privacy", "(k) privacy attacks on what the servers receive"),
    ("secure_aggregation", "secure_aggregation", "(l) secure aggregation's cost"),
    ("dp_accuracy", "dp_accuracy", "(m) accuracy against epsilon"),
)


def default_name(parts: set[str], quick: bool) -> str:
    """The results folder's name for a run of ``parts``: ``parts-a-b-c-e-f``, ``parts-b-c_quick``."""
    return "parts-" + "-".join(p for p in PARTS if p in parts) + ("_quick" if quick else "")


def _log(text: str) -> None:
    print(text, flush=True)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def report(results: dict) -> str:
    """The human-readable summary of ``results``."""
    m = results["machine"]
    out = [f"machine: {m['cpu_model']}, {m['cpus_usable']} of {m['cpu_count']} CPUs usable, {m['memory_gib']} GiB, "
           f"Python {m['python']}, torch {m['torch']}, {m['date_utc']}, load average at start {m['load_average_at_start']}",
           f"mode: {results['mode']}, total {results['total_s']:.0f}s"]
    a = results.get("network_overhead")
    if a:
        c = a["config"]
        out += ["", f"(a) network overhead: {c['algorithm']}, {c['devices']} devices, {c['rounds']} rounds, "
                    f"{c['max_samples']} samples, batch {c['batch_size']}, group size {c['group_size']}, no emulation"]
        rows = [[f"round {i + 1}", f"{s:.2f}", f"{p:.2f}", f"{s / p:.2f}x"]
                for i, (s, p) in enumerate(zip(a["services_round_s"], a["in_process_round_s"]))]
        rows.append(["mean", f"{a['services_mean_round_s']:.2f}", f"{a['in_process_mean_round_s']:.2f}",
                     f"{a['ratio_services_over_in_process']:.2f}x"])
        if a.get("ratio_without_round_1"):
            rows.append(["mean w/o round 1", "", "", f"{a['ratio_without_round_1']:.2f}x"])
        out.append(_table(["", "services s/round", "in-process s/round", "ratio"], rows))
        out.append(f"final accuracy: services {100 * a['services_final_accuracy']:.2f}%, in-process "
                   f"{100 * a['in_process_final_accuracy']:.2f}%; max |weight difference| of the final models "
                   f"{a['max_abs_weight_diff_final_model']:.2e} (member order alone, in-process: "
                   f"{a['max_abs_weight_diff_member_order']:.2e}); same groups: {a['groups_match_services']}")
        out.append(f"services start-up {a['services_startup_s']:.1f}s (not in the rounds); "
                   f"split points per round {a['split_points_per_round']}")
    b = results.get("wire")
    if b:
        out += ["", "(b) tensor encode/decode throughput (float32, MB/s of tensor bytes, one thread)"]
        rows = []
        for r in b["sizes"]:
            json_cell = (f"{r['json_encode_MBps']:.1f} / {r['json_decode_MBps']:.1f}" if "json_encode_MBps" in r else "-")
            rows.append([r["size"], f"{r['encode_MBps']:.0f}", f"{r['encode_join_MBps']:.0f}", f"{r['decode_MBps']:.0f}",
                         f"{r['decode_schema_MBps']:.0f}", f"{r['encode_ms']:.3f} / {r['decode_ms']:.3f}", json_cell])
        out.append(_table(["size", "encode", "encode+join", "decode", "decode+schema", "ms enc / dec", "JSON enc / dec"], rows))
    c = results.get("main_server")
    if c:
        s = c["setup"]
        device = s.get("torch_device", "cpu") + (f" ({s['gpu']})" if s.get("gpu") else "")
        out += ["", f"(c) Main Server steps on {device}: cnn split {s['split_point']}, fx {s['fx_shape']} "
                    f"({s['fx_bytes'] / 1e3:.0f} KB), groups of {s['group_size']}, {c['populations'][0]['steps_per_device']} steps per device"]
        rows = [[str(r.get("replicas", 1)), str(r["devices"]), str(r["groups"]), f"{r['latency_p50_ms']:.1f}",
                 f"{r['latency_p95_ms']:.1f}", f"{r['latency_p99_ms']:.1f}" if "latency_p99_ms" in r else "-",
                 f"{r['server_step_p50_ms']:.1f}", f"{r['device_steps_per_s']:.1f}", f"{r['MB_per_s']:.1f}"]
                for r in c["populations"]]
        out.append(_table(["replicas", "devices", "groups", "p50 ms", "p95 ms", "p99 ms", "server step p50 ms", "steps/s",
                           "MB/s"], rows))
        if "fraction_of_compute_limit" in c["populations"][0]:
            cores = ("server and load generator share all of them" if s["cores_shared"] else
                     f"server on cores {s['server_cores']}, load generator on {s['client_cores']}")
            out += ["", f"one group step in-process: {c['group_step_ms_in_process']:.1f} ms (the faster of "
                        f"before and after the load); compute limit = "
                        f"{c['server_cores']} cores x {s['group_size']} device steps / that ({cores})"]
            out.append(_table(
                ["replicas", "devices", "p99/p50", "p99/p50 after step 0", "client CPU ms/step", "server CPU ms/step",
                 "server faults/step", "of compute limit", "server share of its cores", "client share of its cores",
                 "load avg"],
                [[str(r["replicas"]), str(r["devices"]), f"{r['latency_p99_over_p50']:.2f}",
                  f"{r['later_steps_latency_p99_over_p50']:.2f}", f"{r['client_cpu_ms_per_step']:.2f}",
                  f"{r['server_cpu_ms_per_step']:.2f}", f"{r['server_minor_faults_per_step']:.0f}",
                  f"{r['fraction_of_compute_limit']:.2f}",
                  f"{r['server_cpu_share_of_cores']:.2f}", f"{r['client_cpu_share_of_cores']:.2f}",
                  " -> ".join(f"{x:.1f}" for x in r["load_average_1min"])]
                 for r in c["populations"]]))
        out.append(f"Main Server peak RSS after the load: {c['main_server_peak_rss_mib']} MiB")
    d = results.get("memory")
    if d:
        out += ["", "(d) peak memory of each service during (a) (VmHWM)"]
        out.append(_table(["service", "peak RSS MiB"], [[k, f"{v:.1f}"] for k, v in d["peak_rss_mib"].items()]))
    e = results.get("agent_memory")
    if e:
        c = e["config"]
        out += ["", f"(e) one agent hosting {c['devices']} {c['model']} devices ({c['devices_per_round']} per round, "
                    f"{c['algorithm']}, {c['rounds']} rounds): peak RSS (VmHWM)"]
        out.append(_table(["devices' models", "agent peak RSS MiB", "mean round s"],
                          [["kept for the run", f"{e['agent_peak_rss_mib_kept']:.0f}", f"{e['mean_round_s_kept']:.2f}"],
                           ["built per task", f"{e['agent_peak_rss_mib_per_task']:.0f}", f"{e['mean_round_s_per_task']:.2f}"]]))
        out.append(f"kept / per task: {e['ratio_kept_over_per_task']:.2f}x; identical final models: {e['same_final_model']}")
    for key, module, title in SEPARATE_PARTS:
        if results.get(key):
            out += ["", title, importlib.import_module(f"benchmarks.{module}").report(results[key])]
    f = results.get("fedavg")
    if f:
        c, mem = f["config"], f["memory"]
        out += ["", f"(f) FedAvg through the services vs one process: {c['model']}, {c['devices']} devices, "
                    f"{c['rounds']} rounds, no emulation; 2-core limit = one-thread time / {c['usable_cores']} cores"]
        out.append(_table(["", "median round s", "services over it", "goal"], [
            ["services", f"{f['services_median_round_s']:.2f}", "", ""],
            ["in-process, one thread", f"{f['in_process_median_round_s']:.2f}", f"{f['ratio_services_over_in_process']:.2f}x", ""],
            ["2-core limit", f"{f['two_core_limit_round_s']:.2f}", f"{f['ratio_services_over_limit']:.2f}x",
             f"<= {f['goal_ratio_services_over_limit']:.2f}x"],
            ["critical path (longest device, evaluation)", f"{f['critical_path_round_s']:.2f}",
             f"{f['ratio_services_over_critical_path']:.2f}x", ""]]))
        if f.get("ratio_cpu_services_over_in_process"):
            out.append(f"CPU seconds per round: services (every process) {f['services_cpu_s_per_round']:.2f}, in-process "
                       f"{f['in_process_cpu_s_per_round']:.2f}, ratio {f['ratio_cpu_services_over_in_process']:.2f}x; "
                       "per process " + ", ".join(f"{k} {v:.2f}" for k, v in f["services_cpu_s_per_round_per_process"].items()))
        out.append(f"final accuracy: services {100 * f['services_final_accuracy']:.2f}%, in-process "
                   f"{100 * f['in_process_final_accuracy']:.2f}%; max |weight difference| {f['max_abs_weight_diff_final_model']:.2e}")
        out.append(f"whole testbed peak PSS {mem['peak_pss_sum_mib']:.0f} MiB (goal <= {mem['goal_pss_sum_mib']:.0f} MiB), "
                   f"peak RSS sum {mem['peak_rss_sum_mib']:.0f} MiB; per process PSS "
                   + ", ".join(f"{k} {v:.0f}" for k, v in mem["peak_pss_mib"].items()))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes only (about a minute)")
    add_name_option(parser, None, "parts-<the parts run>, with _quick in quick mode")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file (default benchmarks/results/<UTC date>_<name>/results.json)")
    parser.add_argument("--only", default=",".join(DEFAULT_PARTS),
                        help="comma-separated parts to run: a (with d), b, c, e, f, g, h, i, j, k, l (default: all "
                             "but g to l; g's subsets: python -m benchmarks.attacks --help, h's: python -m "
                             "benchmarks.population --help, k's: python -m benchmarks.privacy --help)")
    parser.add_argument("--main-servers", default="1",
                        help="comma-separated Main Server replica counts for (c), e.g. 1,2 (default 1); more than "
                             "one replica runs 100 devices, their groups spread as the Fed Server spreads them")
    parser.add_argument("--rounds-f", type=int, default=None,
                        help="rounds of part (f) (default 10 in full mode, 2 in quick mode; the goals' FedAvg task has 30)")
    parser.add_argument("--server-cores", type=int, default=None,
                        help="(c) only: pin the Main Servers to this many of the usable cores and the load generator "
                             "to the rest, as when the devices are machines of their own; the compute limit then "
                             "counts these cores (default: both share every core)")
    parser.add_argument("--torch-device", default="cpu",
                        help="where the Main Server of (c) computes: auto, cpu, cuda, cuda:N, mps (default cpu); "
                             "recorded in the results. (a), (d) and (e) stay on the CPU")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    try:
        replica_counts = tuple(int(n) for n in args.main_servers.split(","))
    except ValueError:
        replica_counts = ()
    if not replica_counts or min(replica_counts) < 1:
        parser.error("--main-servers takes positive counts, e.g. 1,2")
    if args.server_cores is not None:
        from benchmarks.main_server_load import split_cores

        try:
            split_cores(args.server_cores)
        except ValueError as exc:
            parser.error(str(exc))
    if not parts <= set(PARTS):
        parser.error(f"--only takes a subset of {','.join(PARTS)}")

    # One torch thread, as every service runs (testbed/processes.py), so the comparison is fair.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from shared.torch_device import resolve_torch_device

    torch.set_num_threads(1)
    try:
        torch_device = str(resolve_torch_device(args.torch_device))
    except ValueError as exc:
        parser.error(str(exc))
    from shared import machine

    results: dict = {"mode": "quick" if args.quick else "full", "machine": machine.describe_machine()}
    started = time.perf_counter()
    if "b" in parts:
        from benchmarks import wire_throughput

        _log("(b) tensor encode/decode throughput")
        results["wire"] = wire_throughput.run(args.quick, _log)
    if "a" in parts:
        from benchmarks import network_overhead

        _log("(a) services vs in-process, (d) peak memory")
        results["network_overhead"], results["memory"] = network_overhead.run(args.quick, _log)
    if "c" in parts:
        from benchmarks import main_server_load

        _log("(c) Main Server step latency and throughput")
        results["main_server"] = main_server_load.run(args.quick, _log, torch_device, replica_counts, args.server_cores)
    if "e" in parts:
        from benchmarks import agent_memory

        _log("(e) agent memory: models kept vs built per task")
        results["agent_memory"] = agent_memory.run(args.quick, _log)
    if "f" in parts:
        from benchmarks import fedavg_overhead

        _log("(f) FedAvg: services vs one process vs the 2-core limit, whole-testbed PSS")
        results["fedavg"] = fedavg_overhead.run(args.quick, _log, args.rounds_f)
    if "g" in parts:
        from benchmarks import attacks

        _log("(g) harmful devices against an honest control")
        results["attacks"] = attacks.run(attacks.Selection.quick() if args.quick else attacks.Selection(), _log)
    if "h" in parts:
        from benchmarks import population

        _log("(h) large populations: registration, rounds, memory per device")
        results["population"] = population.run(population.QUICK_SIZES if args.quick else population.SIZES,
                                               s2fl=not args.quick, log=_log)
    if "i" in parts:
        from benchmarks import main_server_memory

        _log("(i) the Main Server's peak memory against its server portion (ResNet-18)")
        results["main_server_memory"] = main_server_memory.run(*main_server_memory.sizes(args.quick), log=_log)
    if "j" in parts:
        from benchmarks import scenarios

        _log("(j) the sliding split in a fleet that changes: scenarios against the best fixed split")
        results["scenarios"] = scenarios.run(args.quick, _log)
    if "k" in parts:
        from benchmarks import privacy

        _log("(k) privacy attacks on what the servers receive")
        results["privacy"] = privacy.run(privacy.Selection.quick() if args.quick else privacy.Selection(), _log)
    if "l" in parts:
        from benchmarks import secure_aggregation

        _log("(l) secure aggregation's cost against plain FedAvg, with dropouts")
        results["secure_aggregation"] = secure_aggregation.run(
            secure_aggregation.QUICK_SIZES if args.quick else secure_aggregation.SIZES,
            secure_aggregation.QUICK_ROUNDS if args.quick else secure_aggregation.ROUNDS, _log)
    if "m" in parts:
        from benchmarks import dp_accuracy

        _log("(m) accuracy against epsilon: central noise, FedAvg and S2FL")
        results["dp_accuracy"] = dp_accuracy.run(
            dp_accuracy.QUICK_POPULATIONS if args.quick else dp_accuracy.POPULATIONS,
            dp_accuracy.QUICK_EPSILONS if args.quick else dp_accuracy.EPSILONS, not args.quick,
            dp_accuracy.QUICK_ROUNDS if args.quick else dp_accuracy.FEDAVG_ROUNDS, _log)
    results["total_s"] = time.perf_counter() - started
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]

    _log("")
    _log(report(results))
    out = write_json(results, args.out or default_out(results["machine"]["date_utc"],
                                                       args.name or default_name(parts, args.quick)))
    _log(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
