"""Registering an agent's devices in batches (``POST /v1/devices/registrations``), not one request each.

Devices come to the registrar as their set-up ends (or when the Fed Server no longer knows them);
one thread sends whoever is waiting, up to :data:`shared.schemas.MAX_REGISTRATION_BATCH` at a time,
so a batch is as large as the devices that became ready while the previous one was out. Each
device of a batch is registered or refused on its own, exactly as its own registration would be.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from device_agent.api import AgentApi, Unreachable
from device_agent.clients import error_for_status
from device_agent.device import Device, registration_error
from device_agent.pending import PendingDevices
from shared.errors import DomainError, Failed, TooSoon
from shared.schemas import MAX_REGISTRATION_BATCH, RegistrationBatch

log = logging.getLogger("device_agent")

#: Told of a device that is registered now, or (with its error) that cannot be.
Registered = Callable[[Device], None]
Refused = Callable[[Device, BaseException], None]


class Registrar:
    """Registers devices in batches on a thread of its own until ``over()``. ``tries``: how many
    times a batch is sent to a Fed Server that does not answer before its devices fail (as a
    device's own registration retries)."""

    def __init__(self, api: AgentApi, stop: threading.Event, over: Callable[[], bool], registered: Registered,
                 refused: Refused, tries: int = 4, retry_s: float = 1.0) -> None:
        self.api = api
        self.stop = stop
        self.over = over
        self.registered = registered
        self.refused = refused
        self.tries = tries
        self.retry_s = retry_s
        self._pending = PendingDevices(MAX_REGISTRATION_BATCH)

    def start(self) -> None:
        threading.Thread(target=self._run, name="registrar", daemon=True).start()

    def add(self, device: Device) -> None:
        """Register ``device`` (set up, or forgotten by the Fed Server) with the next batch."""
        self._pending.add([device])

    def wake(self) -> None:
        """Look at :attr:`over` again (the session ended)."""
        self._pending.wake()

    def _again_after(self, device: Device, error: TooSoon) -> None:
        """The Fed Server asked ``device`` to register later (it registered again moments ago):
        queue it again once the answer's ``Retry-After`` has passed."""
        log.info("%s: the Fed Server asks it to register again in %.0f s (%s)", device.device_id,
                 error.retry_after_s, error.detail)
        timer = threading.Timer(error.retry_after_s, self.add, (device,))
        timer.daemon = True
        timer.start()

    def _run(self) -> None:
        self._pending.send_all(self.over, self._send)

    def _send(self, batch: list[Device]) -> None:
        """One batch, sent again while the Fed Server does not answer (up to :attr:`tries`)."""
        request = RegistrationBatch(devices=[device.registration() for device in batch])
        for attempt in range(1, self.tries + 1):
            try:
                answer = self.api.register_batch(request)
                break
            except (Unreachable, DomainError) as exc:   # the whole request: none of its devices was registered
                if attempt == self.tries or isinstance(exc, DomainError) or self.stop.is_set():
                    error = registration_error(exc) if isinstance(exc, DomainError) else exc
                    for device in batch:
                        self.refused(device, error)
                    return
                log.warning("registering %d devices: the Fed Server did not answer (%s); retrying", len(batch), exc)
                self.stop.wait(self.retry_s)
        by_id = {device.device_id: device for device in batch}
        for registration in answer.registered:
            device = by_id.pop(registration.device_id)
            device.fed.use_token(registration.token)
            device.registered(registration)
            self.registered(device)
        for device_id, refusal in answer.refused.items():
            device = by_id.pop(device_id)
            error = error_for_status(refusal.status, refusal.detail, refusal.retry_after_s)
            if isinstance(error, TooSoon):
                self._again_after(device, error)
            else:
                self.refused(device, registration_error(error))
        for device in by_id.values():   # an answer that left a device out: as a failed registration
            self.refused(device, Failed(f"{device.device_id}: the Fed Server's answer did not mention the device"))
