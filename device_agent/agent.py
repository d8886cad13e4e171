"""An agent process hosting one or many devices, each in its own thread.

Virtual devices of one agent must run concurrently: members of a Main Server group wait for each
other at every step, so training them one after another would deadlock the barrier.
"""
from __future__ import annotations

import logging
import threading

from device_agent.clients import HttpFedClient, main_connector
from device_agent.device import Device
from shared.profiles import kind_for

log = logging.getLogger("device_agent")


def parse_shards(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``."""
    shards: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            shards.extend(range(int(lo), int(hi) + 1))
        else:
            shards.append(int(part))
    if not shards or len(set(shards)) != len(shards) or min(shards) < 0:
        raise ValueError(f"bad shard list {text!r}: use e.g. 0-9 or 0,2,4 (distinct, non-negative)")
    return shards


class Agent:
    """Runs its devices until the run is done (or ``stop`` is set).

    ``model``: the operator's ``--model`` (the only import path its devices will build).
    ``keep_models``: whether each device keeps its model between rounds (see :class:`Device`).
    ``None`` (the default) keeps it only when the agent hosts one device: a real board avoids
    rebuilding its model every round, while an agent hosting 100 virtual VGG-16 devices would
    otherwise hold 100 model copies (about 14 GB) where 10 train at a time.
    """

    def __init__(self, fed_server_url: str, shards: list[int], kinds: list[str] | None, time_scale: float = 1.0,
                 prefix: str = "dev", verify: bool | str = True, metrics=None,
                 enrolment_secret: bytes | None = None, keep_models: bool | None = None,
                 model: str | None = None) -> None:
        self.stop = threading.Event()
        keep = len(shards) == 1 if keep_models is None else keep_models
        connect_main = main_connector(verify)
        self.devices = [
            Device(f"{prefix}-{shard:03d}", shard, HttpFedClient(fed_server_url, verify, enrolment_secret), connect_main,
                   kind_for(shard, kinds) if kinds else None, time_scale, self.stop, keep_model=keep,
                   model_ref=model)
            for shard in shards
        ]
        self.errors: dict[str, BaseException] = {}
        self.metrics = metrics  # device_agent.metrics.AgentMetrics or None (no --metrics-port)
        if metrics is not None:
            for device in self.devices:
                metrics.add_device(device.device_id)
                device.on_upload = metrics.observe_upload

    def _run_device(self, device: Device) -> None:
        try:
            device.run()
        except BaseException as exc:  # report and let the other devices carry on
            self.errors[device.device_id] = exc
            log.exception("%s stopped with an error", device.device_id)

    def run(self) -> int:
        """Start every device thread and wait for them; exit code 1 if any device failed."""
        threads = [threading.Thread(target=self._run_device, args=(d,), name=d.device_id, daemon=True) for d in self.devices]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        except KeyboardInterrupt:
            self.stop.set()
        return 1 if self.errors else 0

