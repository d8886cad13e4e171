"""docker/local-ca.sh: a local CA, a certificate per server that names what it should, secrets,
file modes that keep keys private, and a second run that changes nothing but what changed."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "local-ca.sh"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def make(out: Path, names: str | None = None, group_readable: bool = False) -> str:
    """Run the script into ``out``; its log lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("SFL_TLS_NAMES", "SFL_PKI_GROUP_READABLE")}
    if names is not None:
        env["SFL_TLS_NAMES"] = names
    if group_readable:
        env["SFL_PKI_GROUP_READABLE"] = "1"
    result = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stderr


def contents(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def names_of(cert: x509.Certificate) -> set[str]:
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {*sans.get_values_for_type(x509.DNSName), *map(str, sans.get_values_for_type(x509.IPAddress))}


def test_certificates_are_signed_by_the_ca_and_name_each_server_and_the_given_addresses(tmp_path):
    out = tmp_path / "pki"
    make(out, "fed.example.org, 192.168.1.20")
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for server in ("fed-server", "main-server"):
        cert = x509.load_pem_x509_certificate((out / "server" / f"{server}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert names_of(cert) == {server, "localhost", "127.0.0.1", "fed.example.org", "192.168.1.20"}
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        private = serialization.load_pem_private_key((out / "server" / f"{server}-key.pem").read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.public_key() == cert.public_key()
    # Secrets: random, one for the servers, the enrolment one for servers and devices alike.
    service = (out / "server" / "service-secret").read_text().strip()
    enrolment = (out / "device" / "enrolment-secret").read_text().strip()
    assert len(service) == 64 and len(enrolment) == 64 and service != enrolment
    assert (out / "server" / "enrolment-secret").read_text().strip() == enrolment
    assert (out / "device" / "ca.pem").read_bytes() == (out / "server" / "ca.pem").read_bytes() == ca.public_bytes(
        serialization.Encoding.PEM)


def _private(out: Path) -> list[Path]:
    """What the servers and devices read that nobody else may: the keys and the secrets."""
    return [*out.glob("server/*-key.pem"), out / "server" / "service-secret", out / "server" / "enrolment-secret",
            out / "device" / "enrolment-secret"]


def test_keys_and_secrets_are_private_and_the_device_folder_holds_no_server_secret(tmp_path):
    out = tmp_path / "pki"
    make(out)
    for path in [out / "ca" / "ca-key.pem", *_private(out)]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in [out / "ca" / "ca.pem", *out.glob("server/*.pem"), out / "device" / "ca.pem"]:
        if not path.name.endswith("-key.pem"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE((out / "ca").stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "server").stat().st_mode) == 0o700
    assert sorted(p.name for p in (out / "device").iterdir()) == ["ca.pem", "enrolment-secret"]


def test_a_second_run_changes_nothing_and_new_names_reissue_only_the_certificates(tmp_path):
    out = tmp_path / "pki"
    make(out)
    first = contents(out)
    log = make(out)
    assert contents(out) == first
    assert "issued" not in log and "wrote" not in log and "made a CA" not in log
    log = make(out, "fed.example.org")
    again = contents(out)
    changed = {name for name in first if first[name] != again[name]}
    assert changed == {"server/fed-server.pem", "server/fed-server-key.pem", "server/fed-server.names",
                       "server/main-server.pem", "server/main-server-key.pem", "server/main-server.names"}
    assert "fed.example.org" in names_of(x509.load_pem_x509_certificate(again["server/main-server.pem"]))


def test_group_readable_for_containers_and_private_again_without_it(tmp_path):
    """SFL_PKI_GROUP_READABLE=1 (docker-compose.yml's containers get the operator's group): the
    servers' folder and every key and secret readable by the group, never by others, and never the
    CA's key; a later run without it makes them private again."""
    out = tmp_path / "pki"
    make(out, group_readable=True)
    assert stat.S_IMODE((out / "server").stat().st_mode) == 0o750
    for path in _private(out):
        assert stat.S_IMODE(path.stat().st_mode) == 0o640, path
    assert stat.S_IMODE((out / "ca" / "ca-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca").stat().st_mode) == 0o700
    make(out)
    assert stat.S_IMODE((out / "server").stat().st_mode) == 0o700
    for path in _private(out):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
