"""How a Fed Server process is run, as opposed to what it runs (``shared/config.py``): body limits,
plan retries, metrics detail, authentication, the replicas' TLS and heartbeat."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.auth import Auth


#: The largest population (``data.num_devices``) whose per-device metrics are on by default.
PER_DEVICE_SERIES_LIMIT = 1000


@dataclass
class FedServerSettings:
    """The Fed Server's service settings, from its command line (``fed_server/__main__.py``)."""

    max_update_bytes: int = 512 << 20
    # A registration carries the model fingerprint, ~80 bytes per parameter/buffer: 256 KiB fits
    # models of ~3000 tensors (a ResNet-50 has ~320).
    max_register_bytes: int = 256 << 10
    plan_retries: int = 5
    #: Per-device Prometheus series; None: on for runs of at most PER_DEVICE_SERIES_LIMIT devices
    #: (``data.num_devices``), so that the metrics do not grow with a large population.
    per_device_metrics: bool | None = None
    auth: Auth = field(default_factory=Auth)   # no service secret: open (docs/security.md)
    ca_file: str | None = None        # CA bundle to verify the Main Server's HTTPS certificate
    # Round watch streams (docs/deployment.md, "Main Server replicas"): the heartbeat a replica is
    # asked for, and the silence after which it counts as lost (five missed heartbeats: a busy
    # replica's event loop still answers, a frozen or unreachable one does not).
    heartbeat_s: float = 2.0
    replica_timeout_s: float = 10.0

    def per_device_series(self, num_devices: int) -> bool:
        """Whether to export per-device Prometheus series for a run of ``num_devices`` devices:
        ``per_device_metrics`` when set, else only up to :data:`PER_DEVICE_SERIES_LIMIT`."""
        return self.per_device_metrics if self.per_device_metrics is not None else num_devices <= PER_DEVICE_SERIES_LIMIT
