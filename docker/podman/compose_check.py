"""`make compose-check`: build the images and run the compose testbed for real, with podman.

What a static check of docker-compose.yml cannot catch (a module missing from an image, a wrong
entrypoint, a volume the non-root user cannot write, a health check that never turns healthy)
shows up here. Steps, each timed:

1. podman set up (docker/podman/setup.sh) and the local Debian base image (base-image.sh, cached);
2. the TLS certificates and secrets the compose file requires (docker/local-ca.sh);
3. the server and device images (docker/*.Dockerfile, with ``BASE_IMAGE`` = the local base) and a
   Prometheus image from Debian's package (docker/podman/prometheus.Dockerfile);
4. ``podman-compose up`` of docker-compose.yml + docker/podman/compose.check.yml without Grafana,
   for a short S2FL run (the compose file's SFL_* variables: 6 rounds, 4 devices);
5. waits for the run to finish (its status read over HTTPS, verified against the local CA); meanwhile every service's own health check must pass (run with
   ``podman healthcheck run``: podman runs health checks on systemd timers, which a CI container
   does not have) and Prometheus' /api/v1/targets must show every target of
   docker/prometheus/prometheus.yml ``up`` (both watched during the run: the agents exit when it ends,
   once Prometheus has scraped them again);
6. reads summary.json and metrics.jsonl of the run (``/runs/<run id>`` in the ``runs`` volume):
   finished, the rounds asked for, an accuracy, every round recorded exactly once;
7. the run lifecycle (docs/operating.md): ``down`` (the volumes stay) and ``up`` again must begin a
   new run, in a directory of its own; once it has recorded a round, the Fed Server's container is
   killed (SIGKILL) and started again, and the same run must resume (the Fed Server logs it) and
   finish with every round recorded exactly once, watched as in 5 and checked as in 6, while the
   first run's directory stays byte for byte as it was;
8. always tears down containers, network and volumes (images stay cached) and prints PASS/FAIL
   with the timings; on failure, the logs of the services.

Run from the repository root with the project's venv (it needs pyyaml and httpx).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PROJECT = "sfl-check"
BASE_IMAGE = "localhost/sfl-base:bookworm-amd64"
PROMETHEUS_IMAGE = "localhost/sfl-prometheus:check"
# The images docker-compose.yml names (podman qualifies them as localhost/...).
SERVER_IMAGE = "s2fl-server:0.1.0"
DEVICE_IMAGE = "s2fl-device:0.1.0"
SERVICES = ("fed-server", "main-server", "agent-high", "agent-mid", "agent-low", "prometheus")
# The run: small enough for CI, still S2FL with every device kind (SFL_* variables of the compose file).
# Prometheus (5 s scrapes) must see each agent up once. An agent exits when the run ends, after
# waiting for one more scrape (SFL_METRICS_LINGER_S in docker-compose.yml): in a fast hour the six
# rounds took about 7 s, and before the agents waited, none of them was ever scraped.
RUN_ENV = {
    "SFL_ALGORITHM": "s2fl", "SFL_ROUNDS": "6", "SFL_NUM_DEVICES": "4", "SFL_TIME_SCALE": "1000",
    "SFL_HIGH_SHARDS": "0-1", "SFL_MID_SHARDS": "2", "SFL_LOW_SHARDS": "3",
}
# The second up's run: the same but shorter (its Fed Server is killed after its first round is
# recorded, and the rounds left must outlast the kill). Its own number of rounds also tells its
# summary from the first run's.
NEXT_RUN_ENV = {**RUN_ENV, "SFL_ROUNDS": "4"}


class CheckFailed(Exception):
    """A step of the check did not hold; the message says which and why."""


def log(message: str) -> None:
    print(f"[compose-check] {message}", flush=True)


def sh(args: list[str], env: Mapping[str, str] | None = None, capture: bool = False, check: bool = True) -> str:
    """Run a command (its output goes to the console unless captured); raise CheckFailed on failure."""
    result = subprocess.run(args, cwd=ROOT, env=None if env is None else {**os.environ, **env},
                            stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None,
                            text=True)
    if check and result.returncode != 0:
        raise CheckFailed(f"{shlex.join(args)} exited {result.returncode}" + (f":\n{result.stdout}" if capture else ""))
    return result.stdout or ""


def podman_env() -> dict[str, str]:
    """SFL_PODMAN_DIR, CONTAINERS_CONF and CONTAINERS_STORAGE_CONF from setup.sh (which also
    installs what is missing)."""
    out = sh([str(HERE / "setup.sh")], capture=True)
    env = {}
    for line in out.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
    return env


def build_args(wheels: Path | None, ca_bundle: Path, workdir: Path) -> list[str]:
    """podman build flags that feed this host's torch wheel and CA bundle into the RUN steps.

    Where download.pytorch.org (the Dockerfiles' CPU index on amd64) cannot be reached, a folder
    holding the CPU torch wheel is mounted and pip finds it there (find-links); torch's own
    dependencies then come from PyPI, which replaces the CPU index. The CA bundle lets pip verify
    PyPI through this host's TLS setup. Users building with docker keep the Dockerfiles' defaults.
    The pip.conf mounted for this is written into ``workdir``.
    """
    pip_conf = workdir / "pip.conf"
    lines = ["[global]", "cert = /etc/ssl/certs/host-ca-bundle.crt"]
    flags = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--volume", f"{ca_bundle}:/etc/ssl/certs/host-ca-bundle.crt:ro"]
    if wheels is not None:
        lines.append("find-links = /wheels")
        flags += ["--volume", f"{wheels}:/wheels:ro", "--build-arg", "TORCH_INDEX_AMD64=https://pypi.org/simple"]
    pip_conf.write_text("\n".join(lines) + "\n")
    return flags + ["--volume", f"{pip_conf}:/etc/pip.conf:ro"]


def local_torch_wheels(folder: Path) -> Path | None:
    """``folder`` when it holds a CPU torch wheel for this host, else None (pip uses the index)."""
    return folder if any(folder.glob("torch-*+cpu-*.whl")) else None


def pki_env(workdir: Path) -> dict[str, str]:
    """The variables docker-compose.yml requires, for a local CA and secrets made in ``workdir/pki``
    by docker/local-ca.sh (kept between checks: it changes nothing a second time). podman-compose
    1.0.3 ignores ``group_add``, so the containers' user (10001) would not get the files' group:
    this throwaway CA's keys and secrets are made readable by everyone instead, which only the
    check does. Grafana is not started; its required password is a random one."""
    pki = workdir / "pki"
    sh(["bash", str(HERE.parent / "local-ca.sh"), str(pki)], capture=True)
    for folder in (pki / "server", pki / "device"):
        folder.chmod(0o755)
        for path in folder.iterdir():
            path.chmod(0o644)
    return {"SFL_PKI_DIR": str(pki), "SFL_PKI_GID": "0", "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(16)}


def compose(env: Mapping[str, str], *args: str, run_env: Mapping[str, str] = RUN_ENV, capture: bool = False,
            check: bool = True) -> str:
    """podman-compose on docker-compose.yml + the check's override, with the run's SFL_* variables."""
    files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(HERE / "compose.check.yml")]
    return sh(["podman-compose", "-p", PROJECT, *files, *args], env={**env, **run_env}, capture=capture, check=check)


def container(service: str) -> str:
    """The container podman-compose 1.0.3 names for ``service``."""
    return f"{PROJECT}_{service}_1"


def healthy(env: Mapping[str, str], service: str) -> bool:
    """Run the container's own health check once (exit 0 = healthy)."""
    return subprocess.run(["podman", "healthcheck", "run", container(service)], env={**os.environ, **env},
                          capture_output=True).returncode == 0


def running(env: Mapping[str, str], service: str) -> bool:
    """Whether ``service``'s container is running (the agents exit when the run ends)."""
    out = subprocess.run(["podman", "inspect", "--format", "{{.State.Running}}", container(service)],
                         env={**os.environ, **env}, capture_output=True, text=True).stdout.strip()
    return out == "true"


def expected_targets(config_path: Path) -> set[str]:
    """Every ``host:port`` that docker/prometheus/prometheus.yml scrapes."""
    config = yaml.safe_load(config_path.read_text())
    return {t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}


def up_targets(targets_response: Mapping) -> set[str]:
    """The instances Prometheus' /api/v1/targets reports with health ``up``."""
    return {t["labels"]["instance"] for t in targets_response["data"]["activeTargets"] if t["health"] == "up"}


def summary_problems(summary: Mapping, rounds: int) -> list[str]:
    """What is wrong with a finished run's summary.json (empty: it is right)."""
    problems = []
    if summary.get("finished") is not True:
        problems.append(f"finished is {summary.get('finished')!r}")
    if summary.get("rounds") != rounds:
        problems.append(f"rounds {summary.get('rounds')!r}, asked for {rounds}")
    if summary.get("algorithm") != RUN_ENV["SFL_ALGORITHM"]:
        problems.append(f"algorithm {summary.get('algorithm')!r}")
    accuracy = summary.get("final_accuracy")
    if not isinstance(accuracy, (int, float)) or not 0.0 <= accuracy <= 1.0:
        problems.append(f"final_accuracy {accuracy!r}")
    return problems


def round_problems(metrics_lines: Iterable[str], rounds: int) -> list[str]:
    """What is wrong with a finished run's metrics.jsonl (empty: it is right). Every round
    1..``rounds`` has exactly one ``ok`` record (a retried attempt may leave ``failed`` ones), so no
    round was lost or counted twice across a restart, and the attempt ids (``round_id``) increase:
    a restarted Fed Server never hands out one again."""
    problems = []
    records = []
    for number, line in enumerate(metrics_lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                problems.append(f"line {number} is not JSON")
    ok = Counter(record.get("round") for record in records if record.get("status") == "ok")
    lost = [n for n in range(1, rounds + 1) if ok[n] == 0]
    repeated = sorted(n for n in range(1, rounds + 1) if ok[n] > 1)
    unknown = sorted(repr(n) for n in ok if n not in range(1, rounds + 1))
    if lost:
        problems.append(f"round(s) {lost} not recorded")
    if repeated:
        problems.append(f"round(s) {repeated} recorded more than once")
    if unknown:
        problems.append(f"round(s) {', '.join(unknown)} recorded, asked for 1..{rounds}")
    ids = [record.get("round_id") for record in records]
    if not all(isinstance(i, int) for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        problems.append(f"attempt ids not increasing: {ids}")
    return problems


def recorded_rounds(metrics_lines: Iterable[str]) -> int:
    """How many rounds a running run's metrics.jsonl has recorded (``ok`` records); a line still
    being appended does not count yet."""
    count = 0
    for line in metrics_lines:
        try:
            count += json.loads(line).get("status") == "ok"
        except ValueError:
            pass
    return count


def resumed_after(fed_log: str, run_id: str) -> int | None:
    """The round after which the Fed Server's log says it resumed run ``run_id`` (the start that
    found it unfinished), or None when it never did."""
    if f"resuming run {run_id}: it is unfinished" not in fed_log:
        return None
    found = re.findall(rf"resumed run {re.escape(run_id)} after round (\d+)", fed_log)
    return int(found[-1]) if found else None


def changed_files(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The files of a run directory that were added, removed or rewritten between two
    :func:`file_digests`."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def wait_until(what: str, timeout: float, predicate, poll_s: float = 2.0) -> None:
    """Poll ``predicate`` until it holds; the containers are watched from outside, with no event to wait on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def watch_run(env: Mapping[str, str], targets: set[str], timeout: float, ca_file: Path) -> tuple[dict, dict[str, float]]:
    """Poll until the run is finished, every service's health check has passed once and
    Prometheus has reported every target up once. Health and targets are collected while the run
    goes on, since the agents exit when it ends. Returns the final /v1/status and the seconds
    after which each service turned healthy."""
    seen: set[str] = set()
    became_healthy: dict[str, float] = {}
    status: dict = {}
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0, verify=str(ca_file)) as client:
        def done() -> bool:
            nonlocal status
            for service in SERVICES:
                if service not in became_healthy and running(env, service) and healthy(env, service):
                    became_healthy[service] = time.monotonic() - t0
            try:
                seen.update(up_targets(client.get("http://127.0.0.1:9090/api/v1/targets").json()))
            except (httpx.HTTPError, ValueError, KeyError):
                pass  # Prometheus not up yet: its health check says so
            try:
                status = client.get("https://127.0.0.1:8080/v1/status").json()
            except (httpx.HTTPError, ValueError):
                return False
            if status.get("driver_error"):
                raise CheckFailed(f"the Fed Server's driver failed: {status['driver_error']}")
            if status.get("state") != "finished" and not any(running(env, s) for s in SERVICES if s.startswith("agent-")):
                raise CheckFailed(f"every agent exited before the run finished (state {status.get('state')})")
            return status.get("state") == "finished" and targets <= seen and set(SERVICES) <= set(became_healthy)

        try:
            wait_until("the run to finish, every health check to pass and Prometheus to scrape every target",
                       timeout, done)
        except CheckFailed as e:
            raise CheckFailed(f"{e}; run state {status.get('state')!r}, round {status.get('rounds_done')}, "
                              f"never healthy: {sorted(set(SERVICES) - set(became_healthy))}, "
                              f"targets never seen up: {sorted(targets - seen)}") from None
    log("healthy after: " + ", ".join(f"{s} {became_healthy[s]:.0f} s" for s in SERVICES))
    log(f"Prometheus scraped every target up: {', '.join(sorted(targets))}")
    return status, became_healthy


def runs_volume(env: Mapping[str, str]) -> Path:
    """Where the ``runs`` volume lies on this host: the Fed Server keeps run ``<id>`` in
    ``/runs/<id>`` (the compose file starts it with ``--runs-root /runs``)."""
    return Path(sh(["podman", "volume", "inspect", "--format", "{{.Mountpoint}}", f"{PROJECT}_runs"],
                   env=env, capture=True).strip())


def read_summary(run_dir: Path) -> dict:
    """summary.json of a run as the Fed Server wrote it into its directory."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise CheckFailed(f"no summary.json in the runs volume ({path})")
    return json.loads(path.read_text())


def read_metrics(run_dir: Path) -> list[str]:
    """The lines of a run's metrics.jsonl (none before its first round is recorded)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file in ``folder``, by name: a run directory to compare later."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def check_finished_run(run_dir: Path, rounds: int) -> dict:
    """The summary and the metrics of the run in ``run_dir`` (:func:`summary_problems`,
    :func:`round_problems`); returns the summary."""
    run_id = run_dir.name
    summary = read_summary(run_dir)
    problems = summary_problems(summary, rounds)
    if problems:
        raise CheckFailed(f"run {run_id}'s summary.json: " + "; ".join(problems))
    metrics = read_metrics(run_dir)
    problems = round_problems(metrics, rounds)
    if problems:
        raise CheckFailed(f"run {run_id}'s metrics.jsonl: " + "; ".join(problems))
    attempts = sum(1 for line in metrics if line.strip())
    log(f"run {run_id}: {summary['rounds']} rounds, each recorded once ({attempts} attempts), accuracy {summary['initial_accuracy']:.3f} -> "
        f"{summary['final_accuracy']:.3f}, {summary['total_bytes']} bytes")
    return summary


def fed_server_log(env: Mapping[str, str]) -> str:
    """Everything the Fed Server's container has logged, over all its starts."""
    return sh(["podman", "logs", container("fed-server")], env=env, capture=True)


def kill_mid_run(env: Mapping[str, str], last_run: str, rounds: int, timeout: float, ca_file: Path) -> tuple[str, int]:
    """After a second ``up``: wait for the new run (its id is not ``last_run``, and the Fed Server
    logs why it began one), kill the Fed Server's container with SIGKILL as soon as the run has
    recorded and checkpointed a round, and start the container again. Returns the run's id and how many rounds it
    had recorded when it was killed (fewer than ``rounds``, or the kill proves nothing)."""
    run_id = ""
    with httpx.Client(timeout=5.0, verify=str(ca_file)) as client:
        def new_run_begun() -> bool:
            nonlocal run_id
            try:
                run_id = client.get("https://127.0.0.1:8080/v1/status").json().get("run_id") or ""
            except (httpx.HTTPError, ValueError):
                return False
            if run_id == last_run:
                raise CheckFailed(f"the second up took up the finished run {last_run} again instead of beginning a new run")
            return bool(run_id)

        wait_until("the Fed Server to begin a new run", timeout, new_run_begun, poll_s=1.0)
    if f"new run {run_id}: the last run, {last_run}, is over" not in fed_server_log(env):
        raise CheckFailed(f"the Fed Server began run {run_id} but did not log that {last_run} is over")
    # A round may take only a second: read the files the Fed Server writes, not its API. The kill
    # waits for the round's checkpoint too, so the resume has a round to continue after (a kill
    # between a round's record and its checkpoint is tests/integration/test_faults.py's).
    run_dir = runs_volume(env) / run_id
    wait_until(f"run {run_id} to record and checkpoint a round", timeout,
               lambda: recorded_rounds(read_metrics(run_dir)) > 0 and (run_dir / "checkpoint.msgpack").is_file(),
               poll_s=0.1)
    sh(["podman", "kill", "--signal", "KILL", container("fed-server")], env=env, capture=True)
    recorded = recorded_rounds(read_metrics(run_dir))
    if recorded >= rounds:
        raise CheckFailed(f"run {run_id} had recorded all {rounds} rounds before the Fed Server was killed")
    log(f"run {run_id}: Fed Server killed (SIGKILL) with {recorded} of {rounds} rounds recorded; starting it again")
    sh(["podman", "start", container("fed-server")], env=env, capture=True)
    return run_id, recorded


def dump_logs(env: Mapping[str, str], services: Iterable[str]) -> None:
    """The last lines of every service's log, to see why the check failed."""
    for service in services:
        print(f"----- logs of {service} -----", flush=True)
        subprocess.run(["podman", "logs", "--tail", "60", container(service)], env={**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 on PASS, 1 on FAIL."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=Path(os.environ.get("SFL_TORCH_WHEELS", "/opt/wheels")),
                        help="a folder with the CPU torch wheel, used when it holds one (env SFL_TORCH_WHEELS)")
    parser.add_argument("--ca-bundle", type=Path, default=Path("/etc/ssl/certs/ca-certificates.crt"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the run may take once started")
    args = parser.parse_args(argv)

    timings: dict[str, float] = {}
    started = time.monotonic()

    def step(name: str, fn, *a, **kw):
        t0 = time.monotonic()
        log(f"{name} ...")
        result = fn(*a, **kw)
        timings[name] = time.monotonic() - t0
        log(f"{name}: {timings[name]:.0f} s")
        return result

    env = step("podman setup", podman_env)
    env = {**env, **step("certificates", pki_env, Path(env["SFL_PODMAN_DIR"]))}
    up = False
    failed: str | None = None
    try:
        step("base image", sh, [str(HERE / "base-image.sh"), BASE_IMAGE], env)
        flags = build_args(local_torch_wheels(args.wheels), args.ca_bundle, Path(env["SFL_PODMAN_DIR"]))
        arch = sh(["podman", "info", "--format", "{{.Host.Arch}}"], env=env, capture=True).strip()
        for name, dockerfile, tag in (("server image", "docker/server.Dockerfile", SERVER_IMAGE),
                                      ("device image", "docker/device.Dockerfile", DEVICE_IMAGE),
                                      ("prometheus image", "docker/podman/prometheus.Dockerfile", PROMETHEUS_IMAGE)):
            # docker format: the OCI format drops SHELL and HEALTHCHECK. TARGETARCH is set by
            # buildx, not by this podman.
            step(name, sh, ["podman", "build", "--quiet", "--layers", "--format", "docker", "--build-arg",
                            f"TARGETARCH={arch}", *flags, "-f", dockerfile, "-t", tag, "."], env, True)
        compose(env, "down", "-v", capture=True, check=False)  # leftovers of an interrupted check
        up = True
        step("compose up", compose, env, "up", "-d", *SERVICES, capture=True)
        targets = expected_targets(ROOT / "docker/prometheus/prometheus.yml")
        ca_file = Path(env["SFL_PKI_DIR"]) / "ca" / "ca.pem"
        status, _ = step("run", watch_run, env, targets, args.timeout, ca_file)
        runs = runs_volume(env)
        first_run = status["run_id"]
        check_finished_run(runs / first_run, int(RUN_ENV["SFL_ROUNDS"]))
        first_files = file_digests(runs / first_run)

        # The lifecycle: the next up begins a new run, and a killed Fed Server resumes it.
        step("compose down", compose, env, "down", capture=True)
        step("second compose up", compose, env, "up", "-d", *SERVICES, run_env=NEXT_RUN_ENV, capture=True)
        second_rounds = int(NEXT_RUN_ENV["SFL_ROUNDS"])
        second_run, _ = step("second run until killed", kill_mid_run, env, first_run, second_rounds, args.timeout, ca_file)
        status, _ = step("resumed run", watch_run, env, targets, args.timeout, ca_file)
        if status["run_id"] != second_run:
            raise CheckFailed(f"the restarted Fed Server finished run {status['run_id']}, not the interrupted {second_run}")
        after = resumed_after(fed_server_log(env), second_run)
        if after is None:
            raise CheckFailed(f"the restarted Fed Server did not log that it resumed run {second_run}")
        log(f"run {second_run}: resumed after round {after}")
        check_finished_run(runs / second_run, second_rounds)
        changed = changed_files(first_files, file_digests(runs / first_run))
        if changed:
            raise CheckFailed(f"the second run changed the first run's directory ({first_run}): {', '.join(changed)}")
        log(f"run {first_run}: its directory is as it was")
    except CheckFailed as e:
        failed = str(e)
        if up:
            dump_logs(env, SERVICES)
    finally:
        if up:
            t0 = time.monotonic()
            compose(env, "down", "-v", capture=True, check=False)
            # podman-compose 1.0.3's down leaves the project's network behind.
            sh(["podman", "network", "rm", "--force", f"{PROJECT}_default"], env=env, capture=True, check=False)
            timings["teardown"] = time.monotonic() - t0
    total = time.monotonic() - started
    log("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total:.0f} s")
    if failed:
        log(f"FAIL: {failed}")
        return 1
    log("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
