"""Shared helpers of the integration tests (importable from test modules and conftest)."""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shared.config import RunConfig, TrainConfig
from shared.data import load_embedded_mnist
from shared.data.datasets import MNIST_MEAN, MNIST_STD
from shared.models import build_model
from shared.run_config import load_run_config
from shared.schemas import Participant, RoundPlan
from shared.tls import tls_context
from shared.wire import encode_state
from testbed.processes import ProcessGroup, Service, free_port, wait_healthy
from testbed.runner import TlsFiles
from testbed.warm_start import shared_starter


def small_config(**overrides) -> RunConfig:
    """A run that finishes in seconds: few devices, short deadlines, fast emulated transfers."""
    data = {
        "algorithm": "s2fl",
        "rounds": 2,
        "data": {"num_devices": 4, "partition": "dirichlet", "alpha": 0.5, "seed": 1, "max_samples": 1200},
        "train": {"lr": 0.05, "batch_size": 64},
        "grouping": {"group_size": 2},
        "deadlines": {"round_s": 120, "join_s": 20, "step_s": 20},
        "devices": {"profiles": ["high"], "time_scale": 1000.0},
        "seed": 1,
    }
    for key, value in overrides.items():
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return load_run_config(data)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@dataclass
class ServerPair:
    """A Fed Server and a Main Server started by :func:`server_pair`, with no device agents."""

    fed_url: str
    main_url: str
    fed: Service
    main: Service


@contextlib.contextmanager
def server_pair(config: RunConfig, prefix: str, *, fed_args: Sequence[str] = (), main_args: Sequence[str] = (),
                main_reports_to: str | None = None, fed_reaches_main: str | None = None, fed_env: dict | None = None,
                main_env: dict | None = None) -> Iterator[ServerPair]:
    """Run both servers as processes on free loopback ports for the tests that drive them by hand.

    Uses its own temporary folder, not pytest's: pytest prunes old basetemp folders, which a
    concurrent pytest run on the same machine could do while these servers still write to it.
    ``main_reports_to`` replaces the Fed Server's URL the Main Server uploads group portions to,
    ``fed_reaches_main`` the Main Server's URL the Fed Server plans rounds on.
    """
    root = Path(tempfile.mkdtemp(prefix=f"sfl-{prefix}-"))
    (root / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    fed_port, main_port = free_port(), free_port()
    fed_url, main_url = f"http://127.0.0.1:{fed_port}", f"http://127.0.0.1:{main_port}"
    group = ProcessGroup(root / "logs", shared_starter())
    try:
        fed = group.start("fed_server", "fed_server", [
            "--config", str(root / "config.yaml"), "--run-dir", str(root / "run"), "--main-server-url", fed_reaches_main or main_url,
            "--port", str(fed_port), *fed_args], env=fed_env)
        main = group.start("main_server", "main_server", [
            "--fed-server-url", main_reports_to or fed_url, "--port", str(main_port), *main_args], env=main_env)
        wait_healthy(fed_url, fed, timeout=60)
        wait_healthy(main_url, main, timeout=60)
        yield ServerPair(fed_url, main_url, fed, main)
    finally:
        group.stop()
        shutil.rmtree(root, ignore_errors=True)


def body_bytes(metrics: str, route: str, direction: str = "sent") -> float:
    """A server's ``sfl_http_body_bytes_total`` on ``route`` (a route template) in ``direction``,
    from its ``/metrics`` text (docs/metrics.md); 0 for a route it never served."""
    # Route templates hold braces themselves: the labels are matched on the whole line, in any order.
    pattern = (r'^sfl_http_body_bytes_total\{(?=.*direction="' + re.escape(direction) + r'")(?=.*route="'
               + re.escape(route) + r'").*\} (\S+)$')
    return sum(float(v) for v in re.findall(pattern, metrics, flags=re.M))


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.1) -> None:
    """Poll ``predicate`` (a test watching a run from outside has no event to wait on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def final_status(fed_url: str, timeout: float, verify: bool | str = True) -> dict:
    """The Fed Server's ``/v1/status`` once the run has finished or its driver failed, or as it
    is after ``timeout`` seconds; held by the server until something is recorded (long-poll).
    ``verify``: an HTTPS server's CA bundle."""
    deadline = time.monotonic() + timeout
    context = tls_context(verify)
    status = httpx.get(f"{fed_url}/v1/status", timeout=10, verify=context).json()
    while status["state"] != "finished" and status["driver_error"] is None and time.monotonic() < deadline:
        wait_s = max(0.0, min(30.0, deadline - time.monotonic()))
        status = httpx.get(f"{fed_url}/v1/status", params={"seen": status["records"], "wait_s": wait_s},
                           timeout=wait_s + 10, verify=context).json()
    return status


def freeze_agent_through_a_failed_attempt(testbed, agent: int = 1, timeout: float = 240.0) -> None:
    """SIGSTOP one agent once every device has registered and thaw it once the Fed Server has
    recorded a failed attempt: with ``deadlines.min_participants`` = all devices, the first
    attempt misses the quorum and the same logical round is retried with everyone."""
    victim = testbed.agent_services[agent]
    expected = testbed.config.data.num_devices
    wait_for(lambda: testbed.status()["registered"] >= expected, timeout, "every device to register")
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: any(r["status"] == "failed" for r in testbed.status()["history"]), timeout,
                 "an attempt to fail")
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)


def write_raw_mnist(path: Path, split: str, rows: slice) -> Path:
    """The embedded digits of ``rows`` as a device would hold them: uint8 pixels [N, 28, 28], int labels."""
    ds = load_embedded_mnist(split)
    order = np.random.default_rng(3).permutation(len(ds))[rows]
    pixels = np.rint((ds.x[order].numpy() * MNIST_STD + MNIST_MEAN) * 255).clip(0, 255).astype(np.uint8)
    np.savez(path, x=pixels.reshape(-1, 28, 28), y=ds.y[order].numpy().astype(np.int32))
    return path


def make_plan(round_id: int = 1, **changes) -> dict:
    """A valid round plan for a Main Server alone (the cnn, two participants cut at block 1, ten
    classes, batches of 8), as a dict, with ``changes`` applied."""
    plan = RoundPlan(
        run_id="plan-run", round_id=round_id, round_index=max(round_id, 1), model="cnn", num_classes=10, input_shape=[1, 28, 28], seed=0,
        participants=[Participant(device_id="dev-a", split_point=1, num_samples=50),
                      Participant(device_id="dev-b", split_point=1, num_samples=50)],
        server_weights=encode_state(build_model("cnn").portion(1, 4).state_dict()),
        train=TrainConfig(batch_size=8), grouping="balanced", group_size=2, group_loss="per_member",
        join_deadline_s=30, step_deadline_s=30,
    ).model_dump()
    plan.update(changes)
    return plan


class RecordingProxy:
    """A TCP proxy on a free loopback port that forwards each connection to ``target_port`` (set
    once the target listens) and keeps every byte the clients sent, per connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.target_port: int | None = None
        self.sent: list[bytearray] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:   # closed
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port or 9), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            record = bytearray()
            self.sent.append(record)
            threading.Thread(target=self._pump, args=(client, upstream, record), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record: bytearray | None) -> None:
        try:
            while data := source.recv(65536):
                if record is not None:
                    record += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def requests(self) -> list[bytes]:
        """Every complete request the clients sent, as raw bytes (head and Content-Length body)."""
        out = []
        for stream in self.sent:
            data, start = bytes(stream), 0
            while (end := data.find(b"\r\n\r\n", start)) >= 0:
                length = re.search(rb"(?im)^content-length:\s*(\d+)", data[start:end])
                stop = end + 4 + (int(length.group(1)) if length else 0)
                if stop > len(data):
                    break
                out.append(data[start:stop])
                start = stop
        return out

    def close(self) -> None:
        self.listener.close()


def make_tls(folder: Path) -> TlsFiles:
    """A throwaway CA and a certificate for 127.0.0.1/localhost signed by it."""
    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("s2fl test CA")).issuer_name(name("s2fl test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return TlsFiles(cert=str(folder / "cert.pem"), key=str(folder / "key.pem"), ca=str(folder / "ca.pem"))
