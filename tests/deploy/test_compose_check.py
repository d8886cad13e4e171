"""The pieces of `make compose-check` (docker/podman/compose_check.py) that need no containers:
its verdicts on summary.json, on metrics.jsonl (no round lost or repeated), on the Fed Server's log
of a resume, on a run directory left unchanged and on Prometheus' targets, and that its override
and run settings fit docker-compose.yml. The check itself runs with `make compose-check`, not in the suite."""
from __future__ import annotations

import importlib.util
import json
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
    for variable in {**compose_check.RUN_ENV, **compose_check.NEXT_RUN_ENV}:
        assert "${" + variable + ":-" in text, f"{variable} is not a variable of docker-compose.yml"
    # The second run is killed once it has recorded a round: rounds must be left after it.
    assert int(compose_check.NEXT_RUN_ENV["SFL_ROUNDS"]) >= 3
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


def metrics_lines(*records: tuple[int, int, str]) -> list[str]:
    """metrics.jsonl lines of (round, attempt id, status) records, as the Fed Server writes them."""
    return [json.dumps({"round": r, "round_id": attempt, "status": status, "test_accuracy": 0.5})
            for r, attempt, status in records]


def test_rounds_verdict_finds_lost_repeated_and_reused_attempts():
    rounds = compose_check.round_problems
    assert rounds(metrics_lines((1, 1, "ok"), (2, 2, "ok"), (3, 3, "ok")), 3) == []
    # A retried round (its failed attempt first) and a resume that skipped attempt ids are right.
    assert rounds(metrics_lines((1, 1, "ok"), (2, 2, "failed"), (2, 5, "ok"), (3, 6, "ok")), 3) == []
    assert rounds(metrics_lines((1, 1, "ok"), (3, 3, "ok")), 3) == ["round(s) [2] not recorded"]
    assert rounds(metrics_lines((1, 1, "ok"), (2, 2, "ok"), (2, 3, "ok"), (3, 4, "ok")), 3) == [
        "round(s) [2] recorded more than once"]
    assert rounds(metrics_lines((1, 1, "ok"), (2, 2, "ok"), (3, 3, "ok"), (4, 4, "ok")), 3) == [
        "round(s) 4 recorded, asked for 1..3"]
    assert rounds(metrics_lines((1, 1, "ok"), (2, 2, "ok"), (3, 2, "ok")), 3) == ["attempt ids not increasing: [1, 2, 2]"]
    assert rounds(metrics_lines((1, 1, "ok"), (2, 2, "ok"), (3, 3, "failed")), 3) == ["round(s) [3] not recorded"]
    assert rounds([*metrics_lines((1, 1, "ok")), "", '{"round": 2'], 2) == [
        "line 3 is not JSON", "round(s) [2] not recorded"]
    assert rounds([], 2) == ["round(s) [1, 2] not recorded"]


def test_recorded_rounds_counts_done_rounds_and_not_a_line_being_written():
    lines = metrics_lines((1, 1, "ok"), (2, 2, "failed"), (2, 3, "ok"))
    assert compose_check.recorded_rounds(lines) == 2
    assert compose_check.recorded_rounds([*lines, '{"round": 3, "round_id": 4, "sta']) == 2
    assert compose_check.recorded_rounds([]) == 0


def test_resume_is_read_from_the_fed_servers_log():
    run = "20261205-121933-s2fl-3fa0"
    log = ("fed_server INFO new run 20261205-121933-s2fl-3fa0: the last run, 20261205-120000-s2fl-0001, is over\n"
           "fed_server INFO round 1 (attempt 1) ...\n"
           f"fed_server INFO resuming run {run}: it is unfinished\n"
           f"fed_server INFO resumed run {run} after round 2 (attempt 3)\n")
    assert compose_check.resumed_after(log, run) == 2
    assert compose_check.resumed_after(log, "20261205-120000-s2fl-0001") is None
    # A finished run served again is not a resume of an unfinished one.
    assert compose_check.resumed_after(f"fed_server INFO resumed run {run} after round 6 (attempt 6)\n", run) is None


def test_changed_files_of_a_run_directory(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    before = compose_check.file_digests(tmp_path)
    assert compose_check.changed_files(before, compose_check.file_digests(tmp_path)) == []
    (tmp_path / "metrics.jsonl").write_text("{}\n{}\n")
    (tmp_path / "summary.json").unlink()
    (tmp_path / "checkpoint.msgpack").write_bytes(b"\x00")
    assert compose_check.changed_files(before, compose_check.file_digests(tmp_path)) == [
        "checkpoint.msgpack", "metrics.jsonl", "summary.json"]
