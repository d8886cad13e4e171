"""How a Fed Server process is run, as opposed to what it runs (``shared/config.py``): body limits,
plan retries, metrics detail, authentication, the replicas' TLS and heartbeat."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.auth import Auth


@dataclass
class FedServerSettings:
    """The Fed Server's service settings, from its command line (``fed_server/__main__.py``)."""

    max_update_bytes: int = 512 << 20
    # A registration carries the model fingerprint, ~80 bytes per parameter/buffer: 256 KiB fits
    # models of ~3000 tensors (a ResNet-50 has ~320).
    max_register_bytes: int = 256 << 10
    plan_retries: int = 5
    per_device_metrics: bool = True   # per-device Prometheus series (off for very large deployments)
    auth: Auth = field(default_factory=Auth)   # no service secret: open (docs/security.md)
    ca_file: str | None = None        # CA bundle to verify the Main Server's HTTPS certificate
    # Round watch streams (docs/deployment.md, "Main Server replicas"): the heartbeat a replica is
    # asked for, and the silence after which it counts as lost (five missed heartbeats: a busy
    # replica's event loop still answers, a frozen or unreachable one does not).
    heartbeat_s: float = 2.0
    replica_timeout_s: float = 10.0
