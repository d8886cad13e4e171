"""Agent sessions: one held task request per agent for all its idle devices.

An agent hosting thousands of devices would otherwise hold one long poll per device, and the
Fed Server one waiting request, a wake-up and an answer per device at every post. Here the agent
tells its session which of its devices are idle (as they register or end a task); the session
keeps them as ``device id -> token`` and, while the agent's one request is held, hands each device
that has work its task, once. Finding that work is O(round size), not O(idle devices)
(:meth:`fed_server.task_dispatch.TaskDispatch.with_work`).

A device's own task poll (``GET /v1/devices/{device_id}/task``) is unchanged and may be used
beside a session: a single device, and a device asking for the follow-up of its own task, speak
it. When an attempt closes, the devices a session handed its training tasks that did not upload
(cut at a deadline, or still at work) are named in the session's next answer (``ended``): their
agent gives those tasks up, rather than go on downloading weights nobody will train from. The
session holds nothing that cannot be lost: a session not asked for
:data:`SESSION_IDLE_S` is forgotten (its agent stopped), and an agent whose session is new to the
server (``new_session``: the server restarted or forgot it) adds its idle devices again.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from fed_server.enrolment import DeviceEnrolment
from fed_server.run_core import RunCore
from fed_server.task_dispatch import TaskDispatch
from shared.schemas import AgentTaskRequest, AgentTaskResponse, DeviceTask

#: A session that has not asked for this long is forgotten: far beyond a held request's 30 s and an
#: agent's back-off, so only a stopped agent's session goes.
SESSION_IDLE_S = 120.0
#: How often a session's idle devices are marked seen: well inside the active-device gauge's window
#: (:data:`fed_server.metrics.ACTIVE_WINDOW_S`), and not at every request: an agent asks once for
#: each device that ends a task, and marking its thousands of idle devices each time would cost the
#: population at every one.
SEEN_EVERY_S = 5.0


@dataclass
class _Session:
    idle: dict[str, str | None] = field(default_factory=dict)   # device id -> the token it was added with
    ended: dict[str, int] = field(default_factory=dict)          # device id -> attempt it is to give up, untold
    asked_at: float = field(default_factory=time.monotonic)
    seen_at: float = float("-inf")   # when its idle devices were last marked seen


class AgentSessions:
    """The agents' sessions, by agent id."""

    def __init__(self, core: RunCore, dispatch: TaskDispatch, enrolment: DeviceEnrolment) -> None:
        self.core = core
        self.dispatch = dispatch
        self.enrolment = enrolment
        self._sessions: dict[str, _Session] = {}
        # Device id -> (agent id, attempt) of the training task a session handed it, until the
        # device is added as idle again or the attempt closes without its upload.
        self._busy: dict[str, tuple[str, int]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    async def next_tasks(self, agent_id: str, req: AgentTaskRequest, auth_enabled: bool) -> AgentTaskResponse:
        """Add ``req``'s devices to ``agent_id``'s session as idle, then answer with tasks for any of
        its idle devices, held up to ``req.wait_s`` until there is one (long-poll, woken like a
        device's own poll: :meth:`fed_server.broadcast.Broadcast.hold`).

        A device is added only with its current token (``auth_enabled``); one this server has no
        registration for comes back in ``unknown``, one whose token was replaced in ``refused``.
        Neither changes the session."""
        now = time.monotonic()
        self._forget_idle(now)
        session = self._sessions.get(agent_id)
        answer = AgentTaskResponse(new_session=session is None)
        if session is None:
            session = self._sessions[agent_id] = _Session()
        session.asked_at = now
        devices = self.core.devices
        for device in req.add:
            if devices.token_nonce(device.device_id) is None:
                answer.unknown.append(device.device_id)
            elif not self.enrolment.holds_token(device.device_id, device.token, auth_enabled):
                answer.refused[device.device_id] = (f"the token is not the current token of device "
                                                    f"{device.device_id!r}: the device enrolled again")
            else:
                session.idle[device.device_id] = device.token
                self._busy.pop(device.device_id, None)
        if now - session.seen_at >= SEEN_EVERY_S:   # an idle device whose agent asks is alive (the active-device
            devices.seen(session.idle)             # gauge): marked now and then, not at every request
            session.seen_at = now
        answer.tasks, answer.ended = await self.core.work_posted.hold(
            lambda: (self._hand_out(agent_id, session, auth_enabled), self._take_ended(session)),
            lambda found: bool(found[0] or found[1]), req.wait_s)
        return answer

    def attempt_over(self, devices: Iterable[str], round_id: int) -> None:
        """Attempt ``round_id`` closed without the uploads of ``devices``: each one a session handed
        that attempt's task is named in its session's next answer (``ended``), woken now."""
        told = False
        for device_id in devices:
            held = self._busy.get(device_id)
            if held is None or held[1] != round_id:
                continue
            del self._busy[device_id]
            session = self._sessions.get(held[0])
            if session is not None:
                session.ended[device_id] = round_id
                told = True
        if told:
            self.core.work_posted.post()

    @staticmethod
    def _take_ended(session: _Session) -> dict[str, int]:
        """The session's untold ``ended`` devices, told now."""
        ended, session.ended = session.ended, {}
        return ended

    def _hand_out(self, agent_id: str, session: _Session, auth_enabled: bool) -> list[DeviceTask]:
        """The tasks of the session's idle devices that have work, each taken out of the idle set.
        A device whose token was replaced since it was added is dropped: its agent adds it again
        with the new one."""
        tasks: list[DeviceTask] = []
        for device_id in self.dispatch.with_work(session.idle):
            token = session.idle.pop(device_id)
            if not self.enrolment.holds_token(device_id, token, auth_enabled):
                continue
            task = self.dispatch.task_for(device_id)
            if task.status == "wait":
                session.idle[device_id] = token
                continue
            tasks.append(DeviceTask(device_id=device_id, task=task))
            if task.status == "train" and task.round_id is not None:
                self._busy[device_id] = (agent_id, task.round_id)
        return tasks

    def _forget_idle(self, now: float) -> None:
        """Forget the sessions not asked for :data:`SESSION_IDLE_S` (swept on each request: there
        are as many sessions as agents)."""
        for agent_id in [a for a, s in self._sessions.items() if now - s.asked_at > SESSION_IDLE_S]:
            del self._sessions[agent_id]
