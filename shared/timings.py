"""The seconds a device measured in one round: sent with every upload (``UpdateRequest.timings``)
and kept in every round record (``RoundRecord.device_times``).

Apart from ``shared/schemas.py``, which imports torch through the wire format, so that a reader of
round records (the testbed's launcher, which never imports torch) can type them.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DeviceTimings(BaseModel):
    """Measured seconds of one device in one round (emulated stretching included)."""

    model_config = ConfigDict(extra="forbid")

    compute_s: float = Field(ge=0, allow_inf_nan=False)
    transfer_s: float = Field(ge=0, allow_inf_nan=False)
    wait_s: float = Field(ge=0, allow_inf_nan=False)   # barrier waits at the Main Server
    server_s: float = Field(ge=0, allow_inf_nan=False) # server-side training of this device's steps
    total_s: float = Field(ge=0, allow_inf_nan=False)  # task received -> upload sent
