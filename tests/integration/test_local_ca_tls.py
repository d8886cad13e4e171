"""A split run over HTTPS on every hop with what docker/local-ca.sh makes: each server serves its own
certificate, the servers verify each other with the CA, and the device agent, given only the
device folder (the CA certificate and the enrolment secret), verifies both servers."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from integration_support import final_status, read_metrics, small_config
from testbed.processes import ProcessGroup, free_port, wait_healthy
from testbed.warm_start import shared_starter

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def test_a_split_run_over_https_with_the_local_ca(tmp_path):
    pki = tmp_path / "pki"
    subprocess.run(["bash", str(ROOT / "docker" / "local-ca.sh"), str(pki)], check=True, capture_output=True, timeout=60)
    server, device = pki / "server", pki / "device"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small_config(rounds=2).model_dump(mode="json")))
    fed_port, main_port = free_port(), free_port()
    # localhost, not 127.0.0.1: the client checks the certificate's DNS name as well.
    fed_url, main_url = f"https://localhost:{fed_port}", f"https://localhost:{main_port}"
    group = ProcessGroup(tmp_path / "logs", shared_starter())
    try:
        fed = group.start("fed_server", "fed_server", [
            "--config", str(config), "--run-dir", str(tmp_path / "run"), "--port", str(fed_port),
            "--tls-cert", str(server / "fed-server.pem"), "--tls-key", str(server / "fed-server-key.pem"),
            "--ca-file", str(server / "ca.pem"), "--service-secret-file", str(server / "service-secret"),
            "--enrolment-secret-file", str(server / "enrolment-secret"), "--main-server-url", main_url])
        main = group.start("main_server", "main_server", [
            "--port", str(main_port), "--fed-server-url", fed_url,
            "--tls-cert", str(server / "main-server.pem"), "--tls-key", str(server / "main-server-key.pem"),
            "--ca-file", str(server / "ca.pem"), "--service-secret-file", str(server / "service-secret")])
        wait_healthy(fed_url, fed, verify=str(device / "ca.pem"))
        wait_healthy(main_url, main, verify=str(device / "ca.pem"))
        agent = group.start("agent", "device_agent", [
            "--fed-server-url", fed_url, "--ca-file", str(device / "ca.pem"),
            "--enrolment-secret-file", str(device / "enrolment-secret"), "--shards", "0-3"])
        status = final_status(fed_url, 240, verify=str(device / "ca.pem"))
        assert status["state"] == "finished", status
        assert agent.process.wait(60) == 0, agent.log_tail()
        # Both rounds trained in split mode: every device stepped in a Main Server group.
        records = read_metrics(tmp_path / "run")
        assert [r["status"] for r in records] == ["ok", "ok"]
        for record in records:
            assert sorted(m for g in record["groups"] for m in g["members"]) == sorted(record["split_points"]), record
            assert len(record["split_points"]) == 4
        # Without the CA, a client refuses the servers' certificates.
        for url in (fed_url, main_url):
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(url + "/healthz", timeout=5)
    finally:
        group.stop()
