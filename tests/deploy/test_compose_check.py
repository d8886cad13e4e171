"""The pieces of `make compose-check` (docker/podman/compose_check.py) that need no containers:
its verdicts on summary.json and on Prometheus' targets, and that its override and run settings
fit docker-compose.yml. The check itself runs with `make compose-check`, not in the suite."""
from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compose_check", ROOT / "docker" / "podman" / "compose_check.py")
compose_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compose_check)

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE = yaml.safe_load((ROOT / "docker" / "podman" / "compose.check.yml").read_text())


def good_summary(**changes) -> dict:
    summary = {"algorithm": "s2fl", "rounds": 2, "finished": True, "final_accuracy": 0.41, "initial_accuracy": 0.1}
    return {**summary, **changes}


def test_summary_verdict():
    assert compose_check.summary_problems(good_summary(), 2) == []
    assert compose_check.summary_problems(good_summary(finished=False), 2) == ["finished is False"]
    assert compose_check.summary_problems(good_summary(rounds=1), 2) == ["rounds 1, asked for 2"]
    assert compose_check.summary_problems(good_summary(final_accuracy=None), 2) == ["final_accuracy None"]
    assert compose_check.summary_problems(good_summary(final_accuracy=1.5), 2) == ["final_accuracy 1.5"]
    assert compose_check.summary_problems(good_summary(algorithm="fedavg"), 2) == ["algorithm 'fedavg'"]


def test_targets_verdict():
    response = {"status": "success", "data": {"activeTargets": [
        {"labels": {"instance": "fed-server:8080", "job": "fed_server"}, "health": "up"},
        {"labels": {"instance": "agent-low:9100", "job": "device_agents"}, "health": "down"},
        {"labels": {"instance": "main-server:8081", "job": "main_server"}, "health": "unknown"},
    ]}}
    assert compose_check.up_targets(response) == {"fed-server:8080"}
    expected = compose_check.expected_targets(ROOT / "docker" / "prometheus" / "prometheus.yml")
    assert {"fed-server:8080", "main-server:8081", "agent-high:9100", "agent-mid:9100", "agent-low:9100"} == expected


def test_check_starts_every_service_but_grafana_and_overrides_only_known_ones():
    assert set(compose_check.SERVICES) == set(COMPOSE["services"]) - {"grafana"}
    assert set(OVERRIDE["services"]) <= set(COMPOSE["services"])
    assert OVERRIDE["services"]["prometheus"]["image"] == compose_check.PROMETHEUS_IMAGE
    # The images the check builds are the ones the compose file runs.
    assert COMPOSE["services"]["fed-server"]["image"] == compose_check.SERVER_IMAGE
    assert COMPOSE["services"]["agent-low"]["image"] == compose_check.DEVICE_IMAGE


def test_check_run_settings_are_compose_variables_and_cover_every_shard():
    text = (ROOT / "docker-compose.yml").read_text()
    for variable in compose_check.RUN_ENV:
        assert "${" + variable + ":-" in text, f"{variable} is not a variable of docker-compose.yml"
    shards: list[int] = []
    for kind in ("HIGH", "MID", "LOW"):
        first, _, last = compose_check.RUN_ENV[f"SFL_{kind}_SHARDS"].partition("-")
        shards += range(int(first), int(last or first) + 1)
    assert sorted(shards) == list(range(int(compose_check.RUN_ENV["SFL_NUM_DEVICES"])))


def test_local_torch_wheels_are_used_only_when_present(tmp_path):
    assert compose_check.local_torch_wheels(tmp_path) is None
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert compose_check.local_torch_wheels(tmp_path) == tmp_path


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_check_gives_the_compose_file_every_variable_it_requires_and_the_files_it_mounts(tmp_path):
    """The check's certificates and secrets (docker/local-ca.sh) set exactly the variables
    docker-compose.yml requires, and every file the services read from them is there."""
    env = compose_check.pki_env(tmp_path)
    text = (ROOT / "docker-compose.yml").read_text()
    assert set(env) == set(re.findall(r"\$\{(\w+):\?", text))
    pki = Path(env["SFL_PKI_DIR"])
    for name in ("fed-server", "main-server"):
        flags = COMPOSE["services"][name]["command"]
        for flag in ("--tls-cert", "--tls-key", "--ca-file", "--service-secret-file"):
            assert (pki / "server" / Path(flags[flags.index(flag) + 1]).name).is_file(), (name, flag)
    agent = COMPOSE["x-agent"]["environment"]
    for variable in ("SFL_CA_FILE", "SFL_ENROLMENT_SECRET_FILE"):
        assert (pki / "device" / Path(agent[variable]).name).is_file(), variable
