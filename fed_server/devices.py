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
        # Kept beside ``devices`` so that a registration costs the same at any population: the
        # device holding each shard or slot, and how many devices each enrolment holder holds.
        self._by_place: dict[int, str] = {}
        self._held_by: dict[str, int] = {}
        # Link rates measured from the devices' rounds (fed_server/split_planner.py), by device id:
        # a registration's claimed rate never replaces a measured one, so registering again
        # cannot reset a device's link to what it says (docs/security.md).
        self._measured_rate: dict[str, float] = {}

    def _place(self, req: RegisterRequest) -> int:
        """The shard or slot ``req`` gets; raises (changing nothing) when it cannot have one."""
        if self.local_data:
            if req.shard is not None:
                raise Invalid(f"this run uses the devices' own data (dataset 'local'): register without a shard, "
                              f"got shard {req.shard}")
            known = self.devices.get(req.device_id)
            if known is not None:
                return known.shard
            free = next((slot for slot in range(len(self._by_place) + 1) if slot not in self._by_place), self.num_shards)
            if free >= self.num_shards:
                raise Conflict(f"the run is full: all {self.num_shards} device slots (data.num_devices) are taken")
            return free
        if req.shard is None:
            raise Invalid("this run partitions a built-in data set: register with the shard the device holds")
        if req.shard >= self.num_shards:
            raise Invalid(f"shard {req.shard} does not exist: the run has {self.num_shards} shards (0..{self.num_shards - 1})")
        holder = self._by_place.get(req.shard)
        if holder is not None and holder != req.device_id:
            raise Conflict(f"shard {req.shard} is already held by device {holder!r}")
        return req.shard

    def register(self, req: RegisterRequest) -> DeviceRecord:
        """Add or refresh ``req``'s device in its shard (or slot) with a new token nonce."""
        record = DeviceRecord(req.device_id, self._place(req), req.num_samples,
                              DeviceProfile(flops=req.profile.flops, rate=req.profile.rate), req.profile.kind,
                              label_counts=req.label_counts)
        known = self.devices.get(req.device_id)
        if known is not None:   # the same place (_place keeps it); the holder is set again by enrol
            record.holder = known.holder
        self.devices[req.device_id] = record
        self._by_place[record.shard] = req.device_id
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
                held = self._held_by.get(enrolment.holder, 0)
                if held >= enrolment.max_devices:
                    raise NotAllowed(f"{enrolment.holder} may register at most {enrolment.max_devices} devices and "
                                     f"holds {held}: enrol further devices with their own enrolment credentials")
        answer = register()
        self._hold(req.device_id, enrolment.holder if enrolment is not None else None)
        return answer

    def _hold(self, device_id: str, holder: str | None) -> None:
        """Record ``holder`` as the one that enrolled ``device_id`` (and count it)."""
        record = self.devices[device_id]
        if record.holder is not None:
            self._held_by[record.holder] -= 1
        record.holder = holder
        if holder is not None:
            self._held_by[holder] = self._held_by.get(holder, 0) + 1

    def held_by(self, holders: Iterable[str]) -> dict[str, str]:
        """Each device enrolled by one of ``holders`` -> that holder (a pass over the registry: an
        operator's revocation, not a request's work)."""
        wanted = set(holders)
        return {d: record.holder for d, record in sorted(self.devices.items())
                if record.holder is not None and record.holder in wanted}

    def remove(self, device_id: str) -> None:
        """Forget ``device_id``: its shard or slot is free, and its id may be enrolled again, by any
        holder its scope allows."""
        record = self.devices.pop(device_id)
        if self._by_place.get(record.shard) == device_id:
            del self._by_place[record.shard]
        if record.holder is not None:
            self._held_by[record.holder] -= 1

    def holds(self, place: int | str) -> bool:
        """Whether a registered device holds ``place``: a shard or slot, or with the devices' own
        data a device id."""
        return place in self.devices if isinstance(place, str) else place in self._by_place

    def kinds(self, device_ids: Iterable[str]) -> dict[str, str]:
        """The registered kind of each of ``device_ids`` that is registered."""
        return {d: self.devices[d].kind for d in device_ids if d in self.devices}

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

    def weight(self, device_id: str) -> int:
        """The device's registered sample count, at least 1, as round plans weigh it; 1 for a
        device no longer registered (taken out during the attempt, its credential revoked)."""
        record = self.devices.get(device_id)
        return max(1, record.num_samples) if record is not None else 1

    def work(self, device_id: str) -> float:
        """The device's compute per round as the deadline rule compares devices (samples over the
        FLOP/s it registered); 0 when not known or no longer registered."""
        record = self.devices.get(device_id)
        return record.num_samples / record.profile.flops if record is not None and record.profile.flops > 0 else 0.0

    def measure_rate(self, device_id: str, rate: float) -> None:
        """Record ``device_id``'s link rate (bytes/s) as measured from one of its rounds."""
        self._measured_rate[device_id] = rate

    def measured_rate(self, device_id: str) -> float | None:
        """The link rate measured from the device's rounds; None before its first."""
        return self._measured_rate.get(device_id)

    def link_rate(self, device_id: str) -> float | None:
        """The device's link rate as Eq. 1 uses it: measured, else the one it registered (None:
        neither; a real device registers none)."""
        measured = self._measured_rate.get(device_id)
        return measured if measured is not None else self.devices[device_id].profile.rate

    def label_counts(self, device_id: str) -> list[int]:
        """The label counts the device registered with (empty: none sent, or no longer registered)."""
        record = self.devices.get(device_id)
        return (record.label_counts if record is not None else None) or []

    def token_nonce(self, device_id: str) -> str | None:
        """The nonce of ``device_id``'s current token; None for a device that is not registered."""
        record = self.devices.get(device_id)
        return record.token_nonce if record is not None else None

    def ids(self) -> list[str]:
        return sorted(self.devices)

    def __len__(self) -> int:
        return len(self.devices)
