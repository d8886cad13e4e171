"""An agent's session: its devices registered in batches, then one held request for the tasks of
all its idle devices, not one long poll each.

The agent draws a random session id at start. Each device that is idle (registered, or done with
a task) is *added* to the session with its token; the Fed Server then hands out tasks for any
idle device while the agent's one request is held, each task once (``POST
/v1/agents/{agent_id}/tasks``, docs/api.md). A device given a task runs it on a thread of its
own (the members of a Main Server group must train at once) and is added again when it is done
with it.

Two threads talk to the session: the *holder* keeps a request held at the Fed Server (adding
nothing), and the *adder* sends, without waiting, the devices that became idle since its last
request, so a device that finishes its task need not wait for the held request's end to be
available again. Both hand the tasks they get to the same place.

Devices are registered by the session's :class:`device_agent.registrar.Registrar` (in batches)
and added as idle once registered. What the Fed Server answers besides tasks: a device it does
not know (it restarted) registers again; a device whose token was replaced stops; a device whose
task's attempt closed without its upload (``ended``) gives that task up (:meth:`Device.taken_out`);
a session the server did not know (restarted, or forgotten while the agent was unreachable) gets
every idle device again.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

from device_agent.api import AgentApi, Unreachable
from device_agent.device import Device, TASK_WAIT_S
from device_agent.pending import PendingDevices
from device_agent.registrar import Registrar
from shared.errors import DomainError
from shared.schemas import MAX_AGENT_DEVICES, AgentDevice, AgentTaskRequest, AgentTaskResponse, DeviceTask
from shared.wire import packb

log = logging.getLogger("device_agent")

#: Called once for a device that cannot go on (its registration refused, its token replaced, the
#: Fed Server unreachable for too long), with the error.
FailureHook = Callable[[Device, BaseException], None]


class AgentTasks:
    """The session of one agent's devices (:mod:`device_agent.agent_tasks`).

    ``api``: the session's client (no retries of its own: a failed request is sent again here,
    with its devices). ``on_failure``: told of each device that stops with an error. ``max_downtime_s``:
    how long the Fed Server may be unreachable before every device not yet ended fails, as a device
    on its own gives up (:meth:`Device.run`)."""

    def __init__(self, api: AgentApi, devices: list[Device], stop: threading.Event, on_failure: FailureHook,
                 wait_s: float = TASK_WAIT_S, max_downtime_s: float = 600.0, retry_s: float = 0.2) -> None:
        self.api = api
        self.agent_id = secrets.token_hex(16)
        self.stop = stop
        self.on_failure = on_failure
        self.wait_s = wait_s
        self.max_downtime_s = max_downtime_s
        self.retry_s = retry_s
        #: Set once every device has ended (the run is done for it, or it failed).
        self.ended = threading.Event()
        self._devices = {device.device_id: device for device in devices}
        self._lock = threading.Lock()
        # Idle, not yet told to the session; taken into _idle in step with each batch (one lock).
        self._to_add = PendingDevices(MAX_AGENT_DEVICES, self._lock)
        self._idle: dict[str, Device] = {}      # told to the session as idle: it may hand them tasks
        self._left = len(self._devices)         # devices not ended
        self._opened = False                    # a request was answered: the session exists
        self._down_since: float | None = None
        self.registrar = Registrar(api, stop, self._over, self.idle, self.end)

    def start(self) -> None:
        """Start the holder and the adder; they end with the session (:attr:`ended`, or ``stop``)."""
        for name, loop in (("session-holder", self._hold), ("session-adder", self._add)):
            threading.Thread(target=loop, name=name, daemon=True).start()
        self.registrar.start()

    def register(self, device: Device) -> None:
        """Register ``device`` (with the next batch); it is added as idle once registered."""
        self.registrar.add(device)

    def idle(self, device: Device) -> None:
        """``device`` is registered and has no task: add it to the session."""
        self._to_add.add([device])

    def end(self, device: Device, error: BaseException | None = None) -> None:
        """``device`` is done with the run, or (``error``) cannot go on."""
        if error is not None:
            self.on_failure(device, error)
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self.ended.set()
        self._to_add.wake()   # the adder ends too
        self.registrar.wake()

    # --- the two requesters -----------------------------------------------------------------
    def _hold(self) -> None:
        """Keep a request held at the Fed Server for the session's tasks."""
        while not self._over():
            self._request([], self.wait_s)

    def _add(self) -> None:
        """Tell the session of idle devices as they come, without waiting (several at once when
        they come while a request is out)."""
        self._to_add.send_all(self._over, self._send_added, taken=self._idle_now)

    def _idle_now(self, batch: list[Device]) -> None:
        """``batch`` is being told to the session: it may hand them tasks from now on (under the lock)."""
        self._idle.update((device.device_id, device) for device in batch)

    def _send_added(self, batch: list[Device]) -> None:
        """Add ``batch`` to the session; a request that failed is sent again with the next batch."""
        if not self._request(batch, 0.0):
            with self._lock:
                again = [device for device in batch if self._idle.pop(device.device_id, None) is not None]
            self._to_add.add(again)

    def _over(self) -> bool:
        return self.stop.is_set() or self.ended.is_set()

    def _request(self, batch: list[Device], wait_s: float) -> bool:
        """One session request adding ``batch``; its answer is acted on. False when it failed (it
        was logged, and the caller waited a little before it returns)."""
        req = AgentTaskRequest(add=[AgentDevice(device_id=d.device_id, token=d.token) for d in batch], wait_s=wait_s)
        opened = self._opened   # before this request: a session new to the server then was forgotten
        try:
            answer = self.api.agent_tasks(self.agent_id, req)
        except (Unreachable, DomainError) as exc:
            self._failed_request(exc)
            return False
        self._down_since = None
        self._take(answer, forgotten=answer.new_session and opened)
        return True

    def _failed_request(self, exc: Exception) -> None:
        """A request went unanswered or was refused: wait a little; after ``max_downtime_s`` without
        an answer, every device that has not ended fails."""
        now = time.monotonic()
        # Read once: another thread's answered request sets it back to None at any moment.
        down_since = self._down_since
        if down_since is None:
            down_since = self._down_since = now
            log.warning("agent session: the Fed Server did not take the request (%s); retrying", exc)
        if now - down_since > self.max_downtime_s:
            log.error("agent session: no answer from the Fed Server for %.0f s: its devices stop", now - down_since)
            with self._lock:
                waiting = [*self._idle.values(), *self._to_add.waiting.values()]
                self._idle.clear()
                self._to_add.waiting.clear()
            for device in waiting:
                self.end(device, exc)
            return
        self.stop.wait(self.retry_s if isinstance(exc, Unreachable) else 1.0)

    # --- what an answer says --------------------------------------------------------------------
    def _take(self, answer: AgentTaskResponse, forgotten: bool) -> None:
        """Run the answer's tasks, register its unknown devices again, stop its refused ones;
        ``forgotten``: the server had lost the session, so the devices still idle are added again."""
        received_at = time.monotonic()
        with self._lock:
            self._opened = True
            tasks = [(device, t) for t in answer.tasks if (device := self._claim(t.device_id)) is not None]
            unknown = [self._idle.pop(i) for i in answer.unknown if i in self._idle]
            refused = [(self._idle.pop(i), why) for i, why in answer.refused.items() if i in self._idle]
            if forgotten:
                log.warning("agent session: the Fed Server did not know the session (it restarted?): its %d idle "
                            "devices are added again", len(self._idle))
                self._to_add.waiting.update(self._idle)
                self._idle.clear()
                self._to_add.wake()
        for device_id, round_id in answer.ended.items():
            if (device := self._devices.get(device_id)) is not None:
                device.taken_out(round_id)
        for device, device_task in tasks:
            self._thread(device, self._run_task, device, device_task, received_at)
        for device in unknown:
            log.info("%s: Fed Server does not know this device (restart?); registering again", device.device_id)
            self.register(device)
        for device, why in refused:
            self.end(device, RuntimeError(f"the Fed Server refused the device's token: {why}"))

    def _claim(self, device_id: str) -> Device | None:
        """The device an answer's task is for, taken out of the idle set, or out of the devices
        waiting to be added (under the lock); None for one that is neither (it runs a task).

        The server hands each task once, to whichever request it holds, so a task for a waiting
        device must run: when one request's answer says the session is new (the server restarted)
        the idle devices are queued to be added again, yet the other request, held in the session
        that answer opened, can already carry a task for one of them; dropped, that device would
        be given nothing until the attempt's deadline."""
        device = self._idle.pop(device_id, None)
        return device if device is not None else self._to_add.waiting.pop(device_id, None)

    def _thread(self, device: Device, target: Callable[..., None], *args: object) -> None:
        threading.Thread(target=target, args=args, name=device.device_id, daemon=True).start()

    def _run_task(self, device: Device, device_task: DeviceTask, received_at: float) -> None:
        """One device's task on its own thread; then the device is idle again, or ended."""
        task = device_task.task
        # The task's share of the answer, as the device's own poll would have counted its body.
        try:
            done = device.handle(task, len(packb(task.model_dump())), received_at)
        except BaseException as exc:   # handle() gives failed tasks up itself: this is a fault
            log.exception("%s stopped with an error", device.device_id)
            self.end(device, exc)
            return
        if done:
            self.end(device)
        else:
            self.idle(device)
