"""Registered devices: who they are, which shard (or slot) they hold, what they say about their speed."""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from fed_server.time_table import DeviceProfile
from shared.auth import Enrolment
from shared.errors import Conflict, Invalid, NotAllowed, NotFound
from shared.schemas import RegisterRequest

T = TypeVar("T")


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
    #: Samples per class, sent at registration only in a run whose Fed Server forms the groups
    #: (several Main Server replicas); None otherwise.
    label_counts: list[int] | None = None
    #: Who enrolled the device (shared/auth.py ``Enrolment.holder``): the enrolment credential or
    #: the shared enrolment secret. Only that holder may enrol the device again. None on an open
    #: server. Kept as long as the registration; a restarted Fed Server forgets it with the rest.
    holder: str | None = None


class DeviceRegistry:
    """Devices by id; a shard belongs to one device.

    Re-registering a known device keeps its place (same id and shard) but gives it a new token
    nonce: the restarted agent that registers again gets a new token and the old one is revoked.
    Only the holder that enrolled a device may enrol it again (:meth:`enrol`).

    With ``local_data`` (``dataset="local"``) there is no partition: a device registers without a
    shard and gets the lowest free slot ``0..num_shards-1`` (kept when it registers again); a run
    whose slots are all taken refuses newcomers. The slot stands where the shard stands elsewhere
    (the device's place in the run, e.g. for emulated kinds), so the rest of the server is the same.
    """

    def __init__(self, num_shards: int, local_data: bool = False) -> None:
        self.num_shards = num_shards
        self.local_data = local_data
        self.devices: dict[str, DeviceRecord] = {}

    def _place(self, req: RegisterRequest) -> int:
        """The shard or slot ``req`` gets; raises (changing nothing) when it cannot have one."""
        if self.local_data:
            if req.shard is not None:
                raise Invalid(f"this run uses the devices' own data (dataset 'local'): register without a shard, "
                              f"got shard {req.shard}")
            known = self.devices.get(req.device_id)
            if known is not None:
                return known.shard
            taken = {record.shard for record in self.devices.values()}
            free = [slot for slot in range(self.num_shards) if slot not in taken]
            if not free:
                raise Conflict(f"the run is full: all {self.num_shards} device slots (data.num_devices) are taken")
            return free[0]
        if req.shard is None:
            raise Invalid("this run partitions a built-in data set: register with the shard the device holds")
        if req.shard >= self.num_shards:
            raise Invalid(f"shard {req.shard} does not exist: the run has {self.num_shards} shards (0..{self.num_shards - 1})")
        for other in self.devices.values():
            if other.shard == req.shard and other.device_id != req.device_id:
                raise Conflict(f"shard {req.shard} is already held by device {other.device_id!r}")
        return req.shard

    def register(self, req: RegisterRequest) -> DeviceRecord:
        """Add or refresh ``req``'s device in its shard (or slot) with a new token nonce."""
        record = DeviceRecord(req.device_id, self._place(req), req.num_samples,
                              DeviceProfile(flops=req.profile.flops, rate=req.profile.rate), req.profile.kind,
                              label_counts=req.label_counts)
        self.devices[req.device_id] = record
        return record

    def enrol(self, req: RegisterRequest, enrolment: Enrolment | None, register: Callable[[], T]) -> T:
        """Register ``req``'s device through ``register`` (the run's registration, which ends in
        :meth:`register`) if ``enrolment`` may, and record it as the device's holder. Refused,
        changing nothing: a device outside the enrolment's scope (NotAllowed), a device held under
        another credential or secret (Conflict: taking it over would revoke its holder's token and
        stop that device), a new device beyond the enrolment's cap (NotAllowed). ``None`` (an open
        server) registers as before."""
        if enrolment is not None:
            enrolment.check_scope(req.device_id, req.shard)
            known = self.devices.get(req.device_id)
            if known is not None and known.holder != enrolment.holder:
                raise Conflict(f"device {req.device_id!r} is held under another enrolment credential: only the "
                               f"credential it registered with can enrol it again")
            if known is None and enrolment.max_devices is not None:
                held = sum(record.holder == enrolment.holder for record in self.devices.values())
                if held >= enrolment.max_devices:
                    raise NotAllowed(f"{enrolment.holder} may register at most {enrolment.max_devices} devices and "
                                     f"holds {held}: enrol further devices with their own enrolment credentials")
        answer = register()
        self.devices[req.device_id].holder = enrolment.holder if enrolment is not None else None
        return answer

    def get(self, device_id: str) -> DeviceRecord:
        record = self.devices.get(device_id)
        if record is None:
            raise NotFound(f"unknown device {device_id!r}: register first")
        record.last_seen = time.monotonic()
        return record

    def seen(self, device_ids: Iterable[str]) -> None:
        """``device_ids`` asked for work just now (through their agent's session)."""
        now = time.monotonic()
        for device_id in device_ids:
            record = self.devices.get(device_id)
            if record is not None:
                record.last_seen = now

    def token_nonce(self, device_id: str) -> str | None:
        """The nonce of ``device_id``'s current token; None for a device that is not registered."""
        record = self.devices.get(device_id)
        return record.token_nonce if record is not None else None

    def ids(self) -> list[str]:
        return sorted(self.devices)

    def __len__(self) -> int:
        return len(self.devices)
