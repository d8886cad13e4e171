"""Registered devices: who they are, which shard they hold, what they say about their speed."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from fed_server.time_table import DeviceProfile
from shared.errors import Conflict, Invalid, NotFound
from shared.schemas import RegisterRequest


@dataclass
class DeviceRecord:
    device_id: str
    shard: int
    num_samples: int
    profile: DeviceProfile
    kind: str
    #: Drawn afresh at every registration and signed into the device's token (shared/auth.py):
    #: registering again revokes the token of the registration before.
    token_nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    last_seen: float = field(default_factory=time.monotonic)


class DeviceRegistry:
    """Devices by id; a shard belongs to one device.

    Re-registering a known device keeps its place (same id and shard) but gives it a new token
    nonce: the restarted agent that registers again gets a new token and the old one is revoked.
    """

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.devices: dict[str, DeviceRecord] = {}

    def register(self, req: RegisterRequest) -> DeviceRecord:
        if req.shard >= self.num_shards:
            raise Invalid(f"shard {req.shard} does not exist: the run has {self.num_shards} shards (0..{self.num_shards - 1})")
        for other in self.devices.values():
            if other.shard == req.shard and other.device_id != req.device_id:
                raise Conflict(f"shard {req.shard} is already held by device {other.device_id!r}")
        record = DeviceRecord(req.device_id, req.shard, req.num_samples,
                              DeviceProfile(flops=req.profile.flops, rate=req.profile.rate), req.profile.kind)
        self.devices[req.device_id] = record
        return record

    def get(self, device_id: str) -> DeviceRecord:
        record = self.devices.get(device_id)
        if record is None:
            raise NotFound(f"unknown device {device_id!r}: register first")
        record.last_seen = time.monotonic()
        return record

    def token_nonce(self, device_id: str) -> str | None:
        """The nonce of ``device_id``'s current token; None for a device that is not registered."""
        record = self.devices.get(device_id)
        return record.token_nonce if record is not None else None

    def ids(self) -> list[str]:
        return sorted(self.devices)

    def __len__(self) -> int:
        return len(self.devices)
