"""Devices waiting to be sent to the Fed Server, sent in batches by one thread.

An agent's session adds its idle devices, and its registrar registers its set-up devices, the same
way: devices come one by one from many threads, and one sender sends whoever waits, up to a batch
limit, so a batch is as large as the devices that came while the previous one was out.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable

from device_agent.device import Device


class PendingDevices:
    """Devices by id, waiting for the sender (:meth:`send_all`). ``lock`` guards them; its owner
    may share it to change other state in step with a batch's taking (:meth:`send_all`'s ``taken``)."""

    def __init__(self, limit: int, lock: threading.Lock | None = None) -> None:
        self.limit = limit
        self.lock = lock or threading.Lock()
        self.waiting: dict[str, Device] = {}
        self._ready = threading.Event()

    def add(self, devices: Iterable[Device]) -> None:
        """Queue ``devices`` for the next batch (and wake the sender)."""
        with self.lock:
            self.waiting.update((device.device_id, device) for device in devices)
        self._ready.set()

    def wake(self) -> None:
        """Wake the sender to look at its ``over`` again."""
        self._ready.set()

    def send_all(self, over: Callable[[], bool], send: Callable[[list[Device]], None],
                 taken: Callable[[list[Device]], None] = lambda batch: None) -> None:
        """Until ``over()``: wait for devices, then ``send`` them in batches of at most
        :attr:`limit` until none waits. ``taken`` is called with each batch under :attr:`lock`, as
        it leaves :attr:`waiting`."""
        while not over():
            self._ready.wait()
            self._ready.clear()
            while not over():
                with self.lock:
                    batch = list(itertools.islice(self.waiting.values(), self.limit))
                    for device in batch:
                        del self.waiting[device.device_id]
                    taken(batch)
                if not batch:
                    break
                send(batch)
