"""(g) The attack benchmark: can a device that is alive but wrong stop, stall or steer a run?

Every harmful behaviour of :mod:`benchmarks.adversary` runs as its own device-agent process
(``python -m benchmarks.adversary``) holding the last 1 or 2 of the run's 10 shards, beside an
honest agent holding the others (the ``absent`` row, a reference, starts no process for those
shards: what losing their data costs), against the real Fed Server (and Main Server for split
algorithms), under each algorithm and aggregation policy asked for. Each (algorithm, policy,
evaluation mode) has an honest control in the same invocation: the same configuration, seed and
processes, the adversary's process running ``--behaviour honest``. Every run, controls included,
enrols its devices with per-device enrolment credentials (the testbed's ``enrolment="credentials"``):
the honest agent and the adversary each hold one credential covering exactly their own shards, so
a harmful device can register no device of another shard (``sybil_burst`` measures that).

Per run: logical rounds completed of those planned (a run that has not finished within the
per-run time limit is stopped and counted as incomplete), the run's wall time (servers healthy to
run over) over the controls' mean, and the final model's accuracy minus the controls' mean, in
points. Each control runs ``--controls`` times (default 3): two identical S2FL runs can end
several points apart (the time table picks splits from measured times), so one control cannot
tell a harmful device's effect from that spread; the table gives the controls' range beside it. The
accuracy is the benchmark's own evaluation of the final checkpoint on the test set, not the
recorded one, which a ``fake_evaluation`` device writes (the recorded figure is kept beside it).

``python -m benchmarks.attacks [--behaviours ...] [--algorithms ...] [--harmful 1,2] [--policies ...]``
prints the table and writes it as JSON and Markdown (``benchmarks/results/<UTC date>_attacks/results.json``
and ``results.md`` by default, ``--name`` naming the folder for what the run measured), rewriting
both after every run so that a stopped invocation keeps its figures; ``--docs docs/security.md``
writes the table into the page, beside the cells earlier invocations measured and this one did not
(the whole table takes two and a half to three hours on 2 cores, so it can be measured a part at a
time: each cell names the date of its invocation, and is compared with that invocation's controls).
``python -m benchmarks.run --only g`` runs the same part.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.adversary import ACTION_MARK, BACKDOOR_TARGET, BEHAVIOURS, Absent, Backdoor, Behaviour, add_trigger
from benchmarks.fedavg_overhead import cpu_seconds
from benchmarks.result_files import add_name_option, default_out, finish, markdown_table, replace_between, write
from shared.config import RunConfig, set_dotted
from shared.run_config import load_run_config
from testbed.processes import Service
from testbed.runner import Testbed, TestbedError
from testbed.warm_start import PRELOAD, WarmStarter

ALGORITHMS = ("s2fl", "fedavg")
#: The rows: every harmful behaviour, and ``absent``, the reference (``honest`` is the control's;
#: a behaviour that is no attack, a dropout, belongs to other benchmarks).
ATTACKS = tuple(name for name, behaviour in BEHAVIOURS.items() if name != "honest" and behaviour.attack)
#: The reference row: its devices never start, so it measures what losing their shards' data costs
#: (the most a run can keep when the servers take a harmful device out); no goal applies to it.
REFERENCE = Absent.name
#: The reference's registration deadline: its run waits it out for the shards nobody registers,
#: and the honest agent's devices register within a second or two of the servers' start.
REFERENCE_REGISTRATION_S = 5.0
HARMFUL = (1, 2)
#: The robust aggregation rule the ``robust`` policy selects (``--set aggregation.rule=...``).
ROBUST_RULE = "trimmed_mean"
#: Its trim at each end: the most harmful devices a run holds (2 of 10), as a trimmed mean is meant
#: to be set (at least the number of devices it must withstand); chosen before any robust run.
ROBUST_TRIM = 0.2
#: The member defences the ``robust`` policy adds under a split algorithm (unused at split depth
#: zero): each member's own part of its group's copy goes to the Fed Server, so the trimmed mean
#: compares devices rather than a few group copies, and a member's scaled activations are brought
#: back to its group's. Chosen after exploratory 15-round runs of 2 label-flipping, backdoor and
#: x10-activation devices under each candidate (median, clip, singleton groups, member updates;
#: benchmarks/results/2026-12-05_member-defences-exploration/): with the trimmed mean alone the
#: backdoor kept 97.9 % attack success.
ROBUST_MEMBER_DEFENCES = ["standardise", "member_updates"]
#: Overrides of each aggregation policy: ``default`` is the run's default rule.
POLICIES: dict[str, dict[str, object]] = {
    "default": {},
    "robust": {"aggregation.rule": ROBUST_RULE, "aggregation.params.fraction": ROBUST_TRIM,
               "grouping.member_defences": ROBUST_MEMBER_DEFENCES}}

# The goals printed beside the figures.
GOAL_TIME_RATIO = 1.3        # wall time at most this many times the control's
GOAL_ROBUST_POINTS = 3.0     # robust policy: final accuracy at most this many points below the control's
GOAL_DEFAULT_ACCURACY = 0.5  # default policy: one harmful device leaves the final accuracy at least this
GOAL_ATTACK_SUCCESS = 0.10   # robust policy: a backdoor's attack success at most this
GOAL_BACKDOOR_POINTS = 1.0   # robust policy: a backdoor's clean accuracy at most this many points below the control's

DEVICES = 10
#: Rounds per run: where the honest runs have converged (S2FL controls 91.9 to 92.7 %, FedAvg 91.2
#: to 92.1 %). At 5 rounds the models sit at 72 to 85 %, identical S2FL runs end up to 5 points
#: apart and taking two devices' data out moved FedAvg with trimmed_mean up 5 points: a 3-point goal
#: measured that spread, not the harmful device. Chosen after seeing 5-round tables.
ROUNDS = 15
ROUND_S = 20.0
#: Honest runs per control: enough to show the spread a cell is judged against.
CONTROLS = 3


def base_config(algorithm: str, rounds: int = ROUNDS, federated_evaluation: bool = False) -> dict:
    """The benchmark's run: the small cnn on 2,000 images of the embedded MNIST over 10 real devices
    (no emulated kinds: no sleeps), every device in every round, and deadlines short enough that
    a device that never answers costs seconds, not minutes, yet long enough for an honest round on
    a busy 2-core machine (10 s was not: at a load average of 13, 7 of 10 honest devices missed it)."""
    data = {
        "algorithm": algorithm,
        "rounds": rounds,
        "data": {"num_devices": DEVICES, "partition": "dirichlet", "alpha": 1.0, "seed": 1, "max_samples": 2000},
        "train": {"lr": 0.05, "batch_size": 32},
        "deadlines": {"round_s": ROUND_S, "join_s": 5.0, "step_s": 5.0, "registration_s": 30.0, "evaluate_s": 5.0},
        "devices": {"profiles": []},
        "seed": 1,
    }
    if federated_evaluation:
        data["evaluation"] = {"mode": "federated"}
    return data


def policy_config(data: dict, policy: str) -> RunConfig | None:
    """``data`` under the aggregation ``policy``; None when this build does not know the policy's
    settings (the robust rules came after the benchmark)."""
    data = json.loads(json.dumps(data))
    for key, value in POLICIES[policy].items():
        set_dotted(data, key, value)
    try:
        return load_run_config(data)
    except ValueError:
        if POLICIES[policy]:
            return None
        raise


class HarmfulTestbed(Testbed):
    """The testbed of one run, with the last ``harmful`` shards moved out of its device agents
    (``agents`` of them share the others) to a ``python -m benchmarks.adversary --behaviour NAME``
    process started with an agent's arguments. Every agent, the adversary included, enrols with
    its own enrolment credential covering exactly its shards (``enrolment="credentials"``), as a
    deployment that issues credentials runs: a harmful device holds its own credential, never one
    that covers the others. A behaviour that must act before the honest devices
    (:attr:`Behaviour.goes_first`) gets its process ready before the honest agents start."""

    def __init__(self, config: RunConfig, run_dir: Path, behaviour: type[Behaviour], harmful: int,
                 warm: WarmStarter | None = None, replicas: int = 1, agents: int = 1) -> None:
        super().__init__(config, run_dir, agents=agents, log_level="WARNING", warm=warm, enrolment="credentials",
                         main_servers=replicas if replicas > 1 else None)
        self.behaviour = behaviour
        self.harmful = harmful
        self.adversary: Service | None = None
        devices = config.data.num_devices
        self.harmful_shards = list(range(devices - harmful, devices))
        self.adversary_started = False

    def agent_chunks(self, shards: list[int]) -> list[list[int]]:
        return super().agent_chunks(shards[:len(shards) - self.harmful])

    def start_agent(self, name: str, shards: list[int] | None = None, data: str | None = None, index: int = 0,
                    module: str = "device_agent", extra: Sequence[str] = ()) -> Service:
        if self.adversary_started or not shards or not self.harmful_shards:
            return super().start_agent(name, shards, data, index, module, extra)
        self.adversary_started = True
        if self.behaviour.starts:   # before the first honest agent
            ready = self.processes.log_dir / "adversary.ready"
            self.adversary = super().start_agent("adversary", self.harmful_shards, module="benchmarks.adversary",
                                                 extra=["--behaviour", self.behaviour.name, "--ready-file", str(ready)])
            if self.behaviour.goes_first:
                _wait_ready(ready, self.adversary)
        return super().start_agent(name, shards, data, index, module, extra)


def _wait_ready(path: Path, service: Service, timeout: float = 120.0) -> None:
    """Wait for another process's ready file (the only signal it gives), failing if it dies."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not service.alive():
            raise TestbedError(f"{service.name} exited before it was ready:\n{service.log_tail()}")
        if time.monotonic() > deadline:
            raise TestbedError(f"{service.name} was not ready within {timeout:.0f}s:\n{service.log_tail()}")
        time.sleep(0.1)


@dataclass
class RunResult:
    """One run's figures."""

    rounds_completed: int
    rounds_planned: int
    wall_s: float
    accuracy: float             # the final checkpoint on the test set, evaluated here
    attack_success: float       # the backdoor's trigger on the final checkpoint (final_figures)
    recorded_accuracy: float | None   # the last successful record's, as the Fed Server wrote it
    fed_log_bytes: int          # what the Fed Server's log holds at the end
    harmful_actions: int        # ACTION_MARK lines in the adversary's log
    failed_attempts: int
    error: str | None           # why the run did not finish (time limit, a service that died)
    #: CPU seconds each of the testbed's processes used, by service name, read when the run ended
    #: (the Fed Server's shows what a flood of requests costs it; on one machine the honest
    #: devices train on the same cores).
    cpu_s: dict[str, float]

    @property
    def complete(self) -> bool:
        return self.rounds_completed == self.rounds_planned and self.error is None


def run_once(config: RunConfig, behaviour: str, harmful: int, run_dir: Path, time_limit_s: float,
             warm: WarmStarter | None = None, replicas: int | None = None) -> RunResult:
    """One testbed run with ``harmful`` of its devices behaving as ``behaviour``, and as many Main
    Server replicas as the behaviour needs (or ``replicas``: a control's); stopped after
    ``time_limit_s`` of rounds if it has not finished."""
    testbed = HarmfulTestbed(config, run_dir, BEHAVIOURS[behaviour], harmful, warm,
                             replicas if replicas is not None else BEHAVIOURS[behaviour].replicas)
    error: str | None = None
    finished = False
    stop, disturbed = threading.Event(), [0]
    disturber: threading.Thread | None = None
    try:
        testbed.start()
        started = time.monotonic()
        signals = [main.process.send_signal for main in testbed.mains]
        disturber = threading.Thread(target=lambda: disturbed.__setitem__(
            0, testbed.behaviour.disturb(testbed.fed_url, signals, stop)), name="disturb", daemon=True)
        disturber.start()
        try:
            testbed.follow(timeout=time_limit_s)
            finished = True
        except (TestbedError, TimeoutError, RuntimeError) as exc:
            error = str(exc).splitlines()[0]
        wall = time.monotonic() - started
        cpu = {s.name: used for s in testbed.processes.services
               if (used := cpu_seconds(s.process.pid)) is not None}
    finally:
        stop.set()
        if disturber is not None:
            disturber.join()
        testbed.stop(agent_grace_s=5.0 if finished else 0.0)
    return _result(config, run_dir, wall, error, testbed.processes.log_dir, cpu, disturbed[0])


def _result(config: RunConfig, run_dir: Path, wall: float, error: str | None, log_dir: Path,
            cpu_s: dict[str, float], disturbances: int = 0) -> RunResult:
    from fed_server.run_dir import RunDirectory

    records = RunDirectory(run_dir).read_metrics()
    ok = [r for r in records if r["status"] == "ok"]
    log_path = log_dir / "adversary.log"
    actions = disturbances + (log_path.read_text(errors="replace").count(ACTION_MARK) if log_path.exists() else 0)
    fed_log = log_dir / "fed_server.log"
    accuracy, attack_success = final_figures(config, run_dir)
    return RunResult(rounds_completed=len({r["round"] for r in ok}), rounds_planned=config.rounds, wall_s=wall,
                     accuracy=accuracy, attack_success=attack_success,
                     recorded_accuracy=ok[-1]["test_accuracy"] if ok else None,
                     fed_log_bytes=fed_log.stat().st_size if fed_log.exists() else 0,
                     harmful_actions=actions, failed_attempts=len(records) - len(ok), error=error, cpu_s=cpu_s)


def final_figures(config: RunConfig, run_dir: Path) -> tuple[float, float]:
    """The run's last checkpoint (the initial model when no round completed), evaluated in this
    process: the figures no device can write. Test accuracy, and the backdoor's attack success:
    the share of the test images not of the backdoor's class that, stamped with its trigger, the
    model puts in that class (a control's figure is what the trigger does to an honest model)."""
    from fed_server.run_dir import RunDirectory
    from shared.data import dataset_input_shape, dataset_num_classes, load_dataset
    from shared.evaluation import classification_accuracy
    from shared.models import build_model

    model = build_model(config.model, dataset_num_classes(config.data), dataset_input_shape(config.data),
                        seed=config.seed, params=config.model_params)
    run = RunDirectory(run_dir)
    if run.checkpoint_path.exists():
        model.load_state_dict(run.read_checkpoint()[1])
    test = load_dataset(config.data)[1]
    accuracy = classification_accuracy(model, test)
    others = test.y != BACKDOOR_TARGET
    triggered = add_trigger(test.x[others], float(test.x.max()))
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(part).argmax(dim=1) for part in torch.split(triggered, 512)])
    return float(accuracy), float((predicted == BACKDOOR_TARGET).float().mean())


# --- the part ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    """What to run: behaviours, algorithms, harmful counts, policies."""

    behaviours: tuple[str, ...] = ATTACKS
    algorithms: tuple[str, ...] = ALGORITHMS
    harmful: tuple[int, ...] = HARMFUL
    policies: tuple[str, ...] = tuple(POLICIES)
    rounds: int = ROUNDS
    controls: int = CONTROLS

    @classmethod
    def quick(cls) -> "Selection":
        """``benchmarks.run --quick``: two behaviours, FedAvg, one harmful device, default policy, 3 rounds,
        one control."""
        return cls(behaviours=("update_x1e6", "silent"), algorithms=("fedavg",), harmful=(1,), policies=("default",),
                   rounds=3, controls=1)


def applies(behaviour: str, config: RunConfig) -> bool:
    """Whether ``behaviour`` means anything in a run of ``config`` (activations and label counts
    only exist where a Main Server trains the deeper layers)."""
    from shared.algorithms.registry import build_algorithm

    return not BEHAVIOURS[behaviour].split_only or build_algorithm(config).split_mode() != "zero"


def default_time_limit(rounds: int) -> float:
    """Per run: twice every round held to its deadline, plus a minute."""
    return 2 * rounds * ROUND_S + 60.0


def run(selection: Selection, log: Callable[[str], None] = print, time_limit_s: float | None = None,
        progress: Callable[[dict], object] | None = None) -> dict:
    """Every selected run and its control; the figures and the goals, as a dict (see :func:`report`).
    ``progress`` gets the figures so far (``"finished": False``) after every run, so that an
    invocation of hours that is stopped keeps what it measured."""
    from shared.machine import describe_machine

    limit = time_limit_s or default_time_limit(selection.rounds)
    layout = max(selection.harmful)
    warm = WarmStarter((*PRELOAD, "benchmarks.adversary"))
    root = Path(tempfile.mkdtemp(prefix="sfl-bench-g-"))
    results: dict = {"machine": describe_machine(), "settings": {
        "devices": DEVICES, "rounds": selection.rounds, "round_s": ROUND_S, "time_limit_s": limit,
        "robust_rule": (f"aggregation.rule={ROBUST_RULE} (fraction {ROBUST_TRIM}), grouping.member_defences="
                        f"{','.join(ROBUST_MEMBER_DEFENCES)} (split algorithms)"), "model": "cnn",
        "data": "2,000 images of the embedded MNIST, Dirichlet 1.0",
        "control": f"the same run with the last {layout} shard(s) in a --behaviour honest process",
        "controls": selection.controls},
        "goals": {"time_ratio_max": GOAL_TIME_RATIO, "robust_points_below_control_max": GOAL_ROBUST_POINTS,
                  "default_one_harmful_accuracy_min": GOAL_DEFAULT_ACCURACY,
                  "attack_success_max": GOAL_ATTACK_SUCCESS, "backdoor_points_below_control_max": GOAL_BACKDOOR_POINTS},
        "controls": [], "runs": [], "finished": False}
    started = time.perf_counter()
    count = 0

    def measured() -> None:
        results["total_s"] = time.perf_counter() - started
        results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        if progress is not None:
            progress(results)
    try:
        for algorithm in selection.algorithms:
            for policy in selection.policies:
                # By evaluation mode and replica count: a cell's control runs as the cell's run does.
                controls: dict[tuple[bool, int], dict] = {}
                for behaviour in selection.behaviours:
                    cell = {"behaviour": behaviour, "algorithm": algorithm, "policy": policy}
                    federated = BEHAVIOURS[behaviour].federated_evaluation
                    replicas = BEHAVIOURS[behaviour].replicas
                    data = base_config(algorithm, selection.rounds, federated)
                    if behaviour == REFERENCE:
                        data["deadlines"]["registration_s"] = REFERENCE_REGISTRATION_S
                    config = policy_config(data, policy)
                    if config is None or not applies(behaviour, config):
                        status = "unsupported" if config is None else "n/a"
                        results["runs"] += [{**cell, "harmful": k, "status": status} for k in selection.harmful]
                        continue
                    if (federated, replicas) not in controls:
                        repeats = []
                        for repeat in range(1, selection.controls + 1):
                            count += 1
                            result = run_once(config, "honest", layout, root / f"{count:03d}-control", limit, warm,
                                              replicas=replicas)
                            repeats.append(_figures(result))
                            log(f"  control {repeat}/{selection.controls} {algorithm}/{policy}"
                                f"{' (federated evaluation)' if federated else ''}"
                                f"{f' ({replicas} Main Server replicas)' if replicas > 1 else ''}: {_line(result)}")
                        controls[(federated, replicas)] = control_summary(repeats)
                        results["controls"].append({"algorithm": algorithm, "policy": policy,
                                                    "federated_evaluation": federated, "replicas": replicas,
                                                    "harmful_layout": layout, **controls[(federated, replicas)]})
                        measured()
                    control = controls[(federated, replicas)]
                    for k in selection.harmful:
                        count += 1
                        result = run_once(config, behaviour, k, root / f"{count:03d}-{behaviour}-{k}", limit, warm)
                        row = {**cell, "harmful": k, "status": "ran", **_figures(result),
                               "time_ratio": result.wall_s / control["wall_s"],
                               "accuracy_points_vs_control": 100 * (result.accuracy - control["accuracy"]),
                               "fed_cpu_ratio": result.cpu_s.get(FED_SERVER, 0.0) / control["fed_cpu_s"]}
                        row["goals_missed"] = goals_missed(row)
                        results["runs"].append(row)
                        measured()
                        log(f"  {behaviour} x{k} {algorithm}/{policy}: {_line(result)}, "
                            f"{row['time_ratio']:.2f}x control, {row['accuracy_points_vs_control']:+.1f} points")
    finally:
        warm.close()
        shutil.rmtree(root, ignore_errors=True)
    results["finished"] = True
    measured()
    return results


def _figures(result: RunResult) -> dict:
    return {"rounds_completed": result.rounds_completed, "rounds_planned": result.rounds_planned,
            "wall_s": round(result.wall_s, 2), "accuracy": result.accuracy, "attack_success": result.attack_success,
            "fed_log_bytes": result.fed_log_bytes,
            "recorded_accuracy": result.recorded_accuracy, "harmful_actions": result.harmful_actions,
            "failed_attempts": result.failed_attempts, "complete": result.complete, "error": result.error,
            "cpu_s": {name: round(used, 2) for name, used in result.cpu_s.items()}}


def control_summary(repeats: list[dict]) -> dict:
    """One control's figures from its honest runs: the means a cell is compared with, the range
    of their accuracies (the spread of identical runs), and each run's figures."""
    accuracies = [r["accuracy"] for r in repeats]
    return {"runs": repeats, "rounds_completed": min(r["rounds_completed"] for r in repeats),
            "rounds_planned": repeats[0]["rounds_planned"],
            "wall_s": sum(r["wall_s"] for r in repeats) / len(repeats),
            "accuracy": sum(accuracies) / len(accuracies),
            "accuracy_min": min(accuracies), "accuracy_max": max(accuracies),
            "attack_success": sum(r["attack_success"] for r in repeats) / len(repeats),
            "fed_log_bytes": sum(r["fed_log_bytes"] for r in repeats) / len(repeats),
            "fed_cpu_s": sum(r["cpu_s"].get(FED_SERVER, 0.0) for r in repeats) / len(repeats)}


def _line(result: RunResult) -> str:
    return (f"{result.rounds_completed}/{result.rounds_planned} rounds, {result.wall_s:.1f}s, "
            f"accuracy {100 * result.accuracy:.1f}%, {result.harmful_actions} harmful actions"
            + (f" ({result.error})" if result.error else ""))


def goals_missed(row: dict) -> list[str]:
    """The goals a run missed: ``rounds`` (not every round completed), ``time`` (over
    :data:`GOAL_TIME_RATIO` x the control), ``accuracy`` (robust policy: more than
    :data:`GOAL_ROBUST_POINTS` below the control; default policy, one harmful device: below
    :data:`GOAL_DEFAULT_ACCURACY`)."""
    missed: list[str] = []
    if row["behaviour"] == REFERENCE:
        return missed
    if not row["complete"]:
        missed.append("rounds")
    if row["time_ratio"] > GOAL_TIME_RATIO:
        missed.append("time")
    # Accuracies are whole test images over the test set's size, so a difference of exactly the
    # bound is one; compared unrounded, 30 images of 1,000 read 3.0000000000000027 points.
    bound = GOAL_BACKDOOR_POINTS if row["behaviour"] == Backdoor.name else GOAL_ROBUST_POINTS
    if row["policy"] == "robust" and round(row["accuracy_points_vs_control"], 9) < -bound:
        missed.append("accuracy")
    if row["policy"] == "robust" and row["behaviour"] == Backdoor.name and row["attack_success"] > GOAL_ATTACK_SUCCESS:
        missed.append("attack success")
    if row["policy"] == "default" and row["harmful"] == 1 and row["accuracy"] < GOAL_DEFAULT_ACCURACY:
        missed.append("accuracy")
    return missed


# --- the table ---------------------------------------------------------------------------------

#: The behaviours whose cells also give the Fed Server's log growth and its CPU time over the control's.
LOG_ROWS = ("silent_reregistration", "registration_loop")
#: The testbed's name for the Fed Server's process (:class:`testbed.runner.Testbed`).
FED_SERVER = "fed_server"


def _cell(row: dict | None) -> list[str]:
    """rounds, time vs control, accuracy vs control (with a backdoor's attack success, a
    re-registration's log growth and Fed Server CPU), goals: one policy's cells of a table row, the goals cell
    ending with the date its invocation ran."""
    if row is None:
        return ["", "", "", ""]
    if row["status"] != "ran":
        return [row["status"], "", "", ""]
    goals = "reference" if row["behaviour"] == REFERENCE else ", ".join(row["goals_missed"]) or "met"
    accuracy = f"{row['accuracy_points_vs_control']:+.1f}"
    if row["behaviour"] == Backdoor.name:
        accuracy += f"; attack success {100 * row['attack_success']:.1f} %"
    if row["behaviour"] in LOG_ROWS:
        # The log's size, not its ratio to the control's: a quiet control's log can be empty.
        accuracy += f"; log {row['fed_log_bytes'] / 1024:.1f} KiB"
        if "fed_cpu_ratio" in row:   # measured since the benchmark reads it; older result files lack it
            accuracy += f"; Fed Server CPU {row['fed_cpu_ratio']:.2f}x"
    return [f"{row['rounds_completed']}/{row['rounds_planned']}", f"{row['time_ratio']:.2f}x", accuracy,
            f"{goals} ({row['date']})"]


def _dated(results: dict) -> dict:
    """``results`` with each run and control carrying the date its invocation ran (``date``), as
    a table that merges invocations (:func:`merge`) needs."""
    date = results["machine"]["date_utc"][:10]
    return {**results, "runs": [{"date": date, **r} for r in results["runs"]],
            "controls": [{"date": date, **c} for c in results["controls"]]}


def table(results: dict) -> list[str]:
    """The attack table and its controls as Markdown lines (what :func:`report` and the docs show);
    a run or control without a ``date`` has its invocation's."""
    results = _dated(results)
    s = results["settings"]
    policies = [p for p in POLICIES if any(r["policy"] == p for r in results["runs"])]
    header = ["behaviour", "algorithm", "harmful"] + [f"{p}: {c}" for p in policies
                                                      for c in ("rounds", "time", "accuracy", "goals")]
    rows: dict[tuple, dict[str, dict]] = {}
    for r in results["runs"]:
        rows.setdefault((r["behaviour"], r["algorithm"], r["harmful"]), {})[r["policy"]] = r
    lines = [header] + [[b, a, f"{k} of {s['devices']}"] + [c for p in policies for c in _cell(cells.get(p))]
                        for (b, a, k), cells in rows.items()]
    out = markdown_table(lines)
    out += ["", "Controls (each cell above is compared with the mean of its algorithm's, policy's and evaluation's "
                "control measured in the same invocation, the same date):", ""]
    out += markdown_table([["algorithm", "policy", "evaluation", "measured", "rounds", "wall s (mean)",
                            "accuracy % (mean)", "accuracy % (range)", "spread (points)", "attack success % (mean)",
                            "log KiB (mean)", "Fed Server CPU s (mean)", "each run: wall s, accuracy %"]] + [
        [c["algorithm"], c["policy"], ("federated" if c["federated_evaluation"] else "server")
         + (f", {c['replicas']} replicas" if c.get("replicas", 1) > 1 else ""), c["date"],
         f"{c['rounds_completed']}/{c['rounds_planned']}", f"{c['wall_s']:.1f}", f"{100 * c['accuracy']:.1f}",
         f"{100 * c['accuracy_min']:.1f} to {100 * c['accuracy_max']:.1f}",
         f"{100 * (c['accuracy_max'] - c['accuracy_min']):.1f}", f"{100 * c['attack_success']:.1f}",
         f"{c['fed_log_bytes'] / 1024:.1f}", f"{c['fed_cpu_s']:.1f}" if "fed_cpu_s" in c else "",
         "; ".join(f"{r['wall_s']:.1f}, {100 * r['accuracy']:.1f}" for r in c["runs"])]
        for c in results["controls"]])
    return out


def report(results: dict) -> str:
    """The part as Markdown: the machine, the goals, the table, the controls."""
    m, s, g = results["machine"], results["settings"], results["goals"]
    out = [f"Machine: {m['cpu_model']}, {m['cpus_usable']} of {m['cpu_count']} CPUs usable, {m['memory_gib']} GiB, "
           f"Python {m['python']}, torch {m['torch']}, {m['date_utc']}, load average {m['load_average_at_start']} "
           f"at the start, {m.get('load_average_at_end')} at the end; {results['total_s'] / 60:.1f} min in all.",
           *([] if results.get("finished", True) else
             ["", "**Unfinished**: the figures of the runs done so far (the invocation was stopped, or is running)."]),
           "",
           f"Runs: {s['model']} on {s['data']}, {s['devices']} devices, {s['rounds']} rounds, deadlines.round_s "
           f"{s['round_s']:g}, stopped after {s['time_limit_s']:g} s (incomplete); robust policy: {s['robust_rule']}; "
           f"control: {s['control']}, run {s['controls']} times: a cell compares with the controls' mean.",
           "",
           f"Goals: every run completes all rounds; wall time <= {g['time_ratio_max']}x the control's; robust policy: "
           f"final accuracy at most {g['robust_points_below_control_max']:g} points below the control's (a backdoor: "
           f"at most {g.get('backdoor_points_below_control_max', GOAL_BACKDOOR_POINTS):g}, with attack success at "
           f"most {100 * g.get('attack_success_max', GOAL_ATTACK_SUCCESS):.0f} %); default policy: one harmful "
           f"device leaves the final accuracy >= {100 * g['default_one_harmful_accuracy_min']:.0f} %. "
           "Accuracy and attack success: the final checkpoint on the test set, evaluated by the benchmark.",
           ""]
    out += table(results)
    fakes = [r for r in results["runs"] if r["status"] == "ran" and r["behaviour"] == "fake_evaluation"]
    if fakes:
        out += ["", "Recorded against evaluated accuracy (fake_evaluation): " + "; ".join(
            f"{r['algorithm']}/{r['policy']} x{r['harmful']}: recorded {_percent(r['recorded_accuracy'])}, "
            f"evaluated {_percent(r['accuracy'])}" for r in fakes)]
    return "\n".join(out)


#: Where a docs page holds the table :func:`update_docs` writes.
DOCS_BEGIN = "<!-- attack table: written by python -m benchmarks.attacks --docs; do not edit by hand -->"
DOCS_END = "<!-- end of attack table -->"
#: The line in that place naming the results files the table merges, relative to the page.
DOCS_SOURCES = "<!-- attack table sources:"


def merge(sources: Sequence[tuple[str, dict]]) -> tuple[dict, list[str]]:
    """One table's results from several invocations' (``(name, results)``, oldest first): a cell
    (behaviour, algorithm, harmful count, policy) comes from the newest invocation that measured
    it, a control from every invocation whose cells are shown, each with its date. The merged
    results and the names of the invocations still shown."""
    cells: dict[tuple, tuple[str, dict]] = {}
    dated = [(name, _dated(results)) for name, results in sources]
    for name, results in dated:
        for r in results["runs"]:
            cells[(r["behaviour"], r["algorithm"], r["harmful"], r["policy"])] = (name, r)
    shown = {name for name, _ in cells.values()}
    pairs = {(name, r["algorithm"], r["policy"]) for name, r in cells.values()}
    # A control is named by its invocation's folder (which starts with its date): two invocations
    # of one day may both have cells shown.
    controls = [{**c, "date": Path(name).parent.name} for name, results in dated for c in results["controls"]
                if (name, c["algorithm"], c["policy"]) in pairs]
    return ({**dated[-1][1], "runs": [r for _, r in cells.values()], "controls": controls},
            [name for name, _ in sources if name in shown])


def update_docs(results: dict, page: Path, results_file: Path) -> None:
    """Write the attack table into ``page`` between :data:`DOCS_BEGIN` and :data:`DOCS_END`: the
    cells ``results`` measured, beside those the page's earlier invocations measured and this one
    did not (their results files, named in the place's sources line, are read again: see
    :func:`merge`); ValueError when the page has no such place."""
    text = page.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{page} has no place for the attack table: add the lines {DOCS_BEGIN} and {DOCS_END}")
    block = text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0]
    new = os.path.relpath(results_file.resolve(), page.resolve().parent)
    earlier = [name for line in block.splitlines() if line.startswith(DOCS_SOURCES)
               for name in line[len(DOCS_SOURCES):].removesuffix("-->").split() if name != new]
    sources = [(name, json.loads((page.parent / name).read_text())) for name in earlier
               if (page.parent / name).is_file()]
    merged, shown = merge([*sources, (new, results)])
    invocations = dict([*sources, (new, results)])
    lines = [f"{DOCS_SOURCES} {' '.join(shown)} -->", "",
             "Measured (each cell's date names its invocation; figures in each folder):", ""]
    for name in shown:
        m, inv = invocations[name]["machine"], invocations[name]
        what = sorted({f"{r['algorithm']}/{r['policy']}" for r in inv["runs"]})
        lines.append(f"- {m['date_utc'][:10]}, {', '.join(what)}, {inv['settings']['rounds']} rounds, "
                     f"{inv['settings']['controls']} controls: {m['cpu_model']} ({m['cpus_usable']} CPUs usable, "
                     f"load average {m['load_average_at_start']} at the start, {m.get('load_average_at_end')} at "
                     f"the end), {inv['total_s'] / 60:.0f} min; [{Path(name).parent.name}/]({name})")
    page.write_text(replace_between(text, DOCS_BEGIN, DOCS_END, [*lines, "", *table(merged), ""]))


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


# --- the command ------------------------------------------------------------------------------

def _names(text: str, allowed: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        parser.error(f"{flag} takes a comma-separated subset of {','.join(allowed)}" +
                     (f"; unknown: {','.join(unknown)}" if unknown else ""))
    return names


def parse_selection(argv: list[str] | None = None) -> tuple[Selection, argparse.Namespace]:
    """The command line's selection and the other options."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attacks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--behaviours", default=",".join(ATTACKS), help="harmful behaviours (default: all)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="algorithms (default: s2fl,fedavg)")
    parser.add_argument("--harmful", default=",".join(map(str, HARMFUL)), help="harmful devices of 10 (default: 1,2)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"aggregation policies: default, robust (aggregation.rule={ROBUST_RULE}, "
                             f"aggregation.params.fraction={ROBUST_TRIM}, grouping.member_defences="
                             f"{','.join(ROBUST_MEMBER_DEFENCES)}) (default: both)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per run (default {ROUNDS})")
    parser.add_argument("--controls", type=int, default=CONTROLS,
                        help=f"honest runs per control, whose mean each cell is compared with (default {CONTROLS})")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds of rounds after which a run is stopped and counted incomplete "
                             "(default: 2 x rounds x deadlines.round_s + 60)")
    parser.add_argument("--docs", type=Path, default=None, metavar="PAGE",
                        help="also write the table into PAGE (docs/security.md) between its attack-table markers")
    add_name_option(parser, "attacks")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file; the Markdown table goes beside it with .md "
                             "(default benchmarks/results/<UTC date>_<name>/results.json)")
    args = parser.parse_args(argv)
    try:
        harmful = tuple(int(n) for n in args.harmful.split(","))
    except ValueError:
        harmful = ()
    if not harmful or not all(1 <= k < DEVICES for k in harmful):
        parser.error(f"--harmful takes counts between 1 and {DEVICES - 1}, e.g. 1,2")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.controls < 1:
        parser.error("--controls must be at least 1")
    if args.docs is not None:   # checked now, not after hours of runs
        text = args.docs.read_text() if args.docs.is_file() else ""
        if DOCS_BEGIN not in text or DOCS_END not in text:
            parser.error(f"--docs {args.docs}: no place for the attack table (the lines {DOCS_BEGIN} and {DOCS_END})")
    selection = Selection(_names(args.behaviours, ATTACKS, "--behaviours", parser),
                          _names(args.algorithms, ALGORITHMS, "--algorithms", parser), harmful,
                          _names(args.policies, tuple(POLICIES), "--policies", parser), args.rounds, args.controls)
    return selection, args


def main(argv: list[str] | None = None) -> int:
    selection, args = parse_selection(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = args.out or default_out(datetime.now(timezone.utc).isoformat(), args.name)
    print(f"results (rewritten after every run): {out}", flush=True)
    results = run(selection, lambda text: print(text, flush=True), args.time_limit,
                  progress=lambda so_far: write(so_far, out, report))
    finish(results, out, report, args.docs, update_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
