"""A real Prometheus scrapes a real testbed with the shipped scrape config.

Needs the ``prometheus`` binary (Debian package ``prometheus``; ``.ci/run`` installs it). Nothing is
installed at run time: the test rewrites the targets of ``docker/prometheus/prometheus.yml`` to the
loopback ports of a short run over HTTPS (its CA file to the run's CA) and asks Prometheus's HTTP API for the round and accuracy metrics.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from integration_support import make_tls, small_config
from testbed.processes import free_port
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docker" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed (apt-get install prometheus; .ci/run does)")


def scrape_config_for(fed: str, main: str, ca_file: str) -> dict:
    """The shipped config with the two servers' targets pointed at loopback, their CA file at
    ``ca_file`` and a 1 s interval."""
    config = yaml.safe_load(SHIPPED.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"fed_server", "main_server"} <= set(jobs), "the shipped config must scrape both servers"
    for name, target in (("fed_server", fed), ("main_server", main)):
        jobs[name]["static_configs"][0]["targets"] = [target]
        jobs[name]["tls_config"]["ca_file"] = ca_file
    config["scrape_configs"] = [jobs["fed_server"], jobs["main_server"]]  # no device agents listen here
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    return config


def query(base: str, promql: str) -> list[dict]:
    resp = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5.0)
    resp.raise_for_status()
    body = resp.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(base: str, promql: str, check, timeout: float = 30.0) -> list[dict]:
    """Poll an instant query until ``check(result)`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    result: list[dict] = []
    while time.monotonic() < deadline:
        result = query(base, promql)
        if result and check(result):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{promql}: no satisfying answer within {timeout:.0f}s, last {result}")


def value(result: list[dict]) -> float:
    return float(result[0]["value"][1])


def test_prometheus_scrapes_round_and_accuracy(tmp_path):
    config = small_config(rounds=2)
    tls = make_tls(tmp_path)
    with Testbed(config, tmp_path / "run", tls=tls, warm=shared_starter()) as testbed:
        prom_port = free_port()
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(scrape_config_for(f"127.0.0.1:{testbed.fed_port}",
                                                                f"127.0.0.1:{testbed.main_port}", tls.ca)))
        log = open(tmp_path / "prometheus.log", "wb")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{prom_port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    if httpx.get(f"{base}/-/ready", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.3)

            status = testbed.follow(timeout=240)
            assert status["state"] == "finished"
            final = status["history"][-1]

            up = wait_for(base, "up", lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r))
            assert {x["metric"]["job"] for x in up} == {"fed_server", "main_server"}
            wait_for(base, "sfl_fed_current_round", lambda r: value(r) == 2)
            done = wait_for(base, 'sum(sfl_fed_rounds_completed_total{status="ok"})', lambda r: value(r) == 2)
            assert value(done) == 2
            acc = wait_for(base, "sfl_fed_test_accuracy_ratio", lambda r: abs(value(r) - final["test_accuracy"]) < 1e-9)
            assert 0.0 < value(acc) <= 1.0
            assert value(wait_for(base, "sfl_fed_round_duration_seconds_count", lambda r: value(r) == 2)) == 2
            # The Main Server trained group steps and reported the groups' label distances.
            assert value(wait_for(base, "sfl_main_steps_total", lambda r: value(r) > 0)) > 0
            assert value(wait_for(base, "sfl_main_groups_formed_total", lambda r: value(r) >= 2)) >= 2
            # Per-device split points and bytes by message kind (route template, not raw path).
            splits = wait_for(base, "sfl_fed_device_split_point", lambda r: len(r) == config.data.num_devices)
            assert {x["metric"]["device"] for x in splits} == set(final["split_points"])
            routes = wait_for(base, 'sfl_http_body_bytes_total{job="fed_server",direction="received"}', lambda r: len(r) >= 2)
            assert "/v1/rounds/{round_id}/updates" in {x["metric"]["route"] for x in routes}
        finally:
            prom.terminate()
            try:
                prom.wait(10)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
            log.close()
