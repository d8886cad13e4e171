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
6. reads summary.json from the ``runs`` volume: finished, the rounds asked for, an accuracy;
7. always tears down containers, network and volumes (images stay cached) and prints PASS/FAIL
   with the timings; on failure, the logs of the services.

Run from the repository root with the project's venv (it needs pyyaml and httpx).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
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


def compose(env: Mapping[str, str], *args: str, capture: bool = False, check: bool = True) -> str:
    """podman-compose on docker-compose.yml + the check's override, with the check's SFL_* variables."""
    files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(HERE / "compose.check.yml")]
    return sh(["podman-compose", "-p", PROJECT, *files, *args], env={**env, **RUN_ENV}, capture=capture, check=check)


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


def read_summary(env: Mapping[str, str], run_id: str) -> dict:
    """summary.json of run ``run_id`` as the Fed Server wrote it into the ``runs`` volume
    (/runs/<run id>: the compose file starts it with ``--runs-root /runs``)."""
    mountpoint = sh(["podman", "volume", "inspect", "--format", "{{.Mountpoint}}", f"{PROJECT}_runs"],
                    env=env, capture=True).strip()
    path = Path(mountpoint) / run_id / "summary.json"
    if not path.is_file():
        raise CheckFailed(f"no summary.json in the runs volume ({path})")
    return json.loads(path.read_text())


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
        status, _ = step("run", watch_run, env, expected_targets(ROOT / "docker/prometheus/prometheus.yml"),
                         args.timeout, Path(env["SFL_PKI_DIR"]) / "ca" / "ca.pem")
        summary = read_summary(env, status["run_id"])
        problems = summary_problems(summary, int(RUN_ENV["SFL_ROUNDS"]))
        if problems:
            raise CheckFailed("summary.json: " + "; ".join(problems))
        log(f"run {status['run_id']}: {summary['rounds']} rounds, accuracy {summary['initial_accuracy']:.3f} -> "
            f"{summary['final_accuracy']:.3f}, {summary['total_bytes']} bytes")
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
