"""An agent's task session against an in-memory Fed Server: idle devices added in batches, tasks
run and their devices added again, done devices ended, forgotten sessions and devices, refusals,
and a Fed Server gone for too long."""
from __future__ import annotations

import queue
import threading
import time

from device_agent.agent_tasks import AgentTasks
from device_agent.api import Unreachable
from device_agent.device import RegistrationRefused
from shared.errors import Failed
from shared.schemas import (
    AgentTaskRequest, AgentTaskResponse, DeviceProfileMsg, DeviceTask, Refusal, RegisterRequest, RegisterResponse,
    RegistrationBatch, RegistrationBatchResponse, TaskResponse,
)

WAIT = 5.0


class FakeClient:
    def __init__(self) -> None:
        self.token: str | None = None

    def use_token(self, token: str | None) -> None:
        self.token = token


class FakeDevice:
    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        self.fed = FakeClient()
        self.handled: list[str] = []
        self.registrations = 0
        self.taken_out_of: list[int] = []

    @property
    def token(self) -> str | None:
        return self.fed.token

    def handle(self, task: TaskResponse, task_bytes: int, received_at: float) -> bool:
        assert task_bytes > 0
        self.handled.append(task.status)
        return task.status == "done"

    def taken_out(self, round_id: int) -> None:
        self.taken_out_of.append(round_id)

    def registration(self) -> RegisterRequest:
        return RegisterRequest(device_id=self.device_id, shard=0, num_samples=1, profile=DeviceProfileMsg(flops=1))

    def registered(self, answer: RegisterResponse) -> None:
        self.registrations += 1


class FakeServer:
    """Held requests (``wait_s`` > 0) take the answers the test puts; adds are answered by ``on_add``."""

    def __init__(self) -> None:
        self.answers: queue.Queue[AgentTaskResponse | Exception] = queue.Queue()
        self.added: list[list[str]] = []
        self.batches: list[list[str]] = []
        self.refuse: dict[str, int] = {}   # device id -> the status its registration is refused with
        self.retry_after_s: float | None = None   # a 429's Retry-After
        self.on_add = lambda req: AgentTaskResponse()
        self.agent_ids: set[str] = set()
        self.changed = threading.Condition()

    def register_batch(self, req: RegistrationBatch) -> RegistrationBatchResponse:
        with self.changed:
            self.batches.append([d.device_id for d in req.devices])
            self.changed.notify_all()
        answer = RegistrationBatchResponse()
        for device in req.devices:
            if device.device_id in self.refuse:
                status = self.refuse[device.device_id]
                answer.refused[device.device_id] = Refusal(
                    status=status, detail="no", retry_after_s=self.retry_after_s if status == 429 else None)
                if status == 429:
                    del self.refuse[device.device_id]   # it may register once its Retry-After passed
            else:
                answer.registered.append(RegisterResponse(run_id="r", device_id=device.device_id, shard=0,
                                                          token=f"token-{device.device_id}-{len(self.batches)}"))
        return answer

    def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
        self.agent_ids.add(agent_id)
        if req.add:
            with self.changed:
                self.added.append([d.device_id for d in req.add])
                self.changed.notify_all()
            return self.on_add(req)
        try:
            answer = self.answers.get(timeout=req.wait_s)
        except queue.Empty:
            return AgentTaskResponse()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def wait_added(self, predicate, timeout: float = WAIT) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: predicate(self.added), timeout), self.added


def _task(device: str, status: str = "train") -> DeviceTask:
    return DeviceTask(device_id=device, task=TaskResponse(status=status, round_id=1, round_index=1))


def _session(server: FakeServer, devices: list[FakeDevice], **kwargs) -> tuple[AgentTasks, list]:
    failures: list = []
    session = AgentTasks(server, devices, threading.Event(),   # type: ignore[arg-type]
                         lambda device, exc: failures.append((device.device_id, exc)), wait_s=0.2, **kwargs)
    session.start()
    return session, failures


def _flat(batches: list[list[str]]) -> list[str]:
    return [device for batch in batches for device in batch]


def test_idle_devices_are_added_their_tasks_run_and_they_are_added_again_until_done():
    server, devices = FakeServer(), [FakeDevice(f"d{i}") for i in range(3)]
    session, failures = _session(server, devices)
    for device in devices:
        session.register(device)
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d1", "d2"])
    server.answers.put(AgentTaskResponse(tasks=[_task("d0"), _task("d1")]))
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d0", "d1", "d1", "d2"])
    assert devices[0].handled == ["train"] and devices[2].handled == []
    server.answers.put(AgentTaskResponse(tasks=[_task(d.device_id, "done") for d in devices]))
    assert session.ended.wait(WAIT) and failures == []
    assert [d.handled[-1] for d in devices] == ["done"] * 3
    assert len(server.agent_ids) == 1 and len(next(iter(server.agent_ids))) == 32


def test_a_task_for_a_device_that_is_not_idle_is_not_run_twice():
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1")]
    session, _ = _session(server, devices)
    session.register(devices[0])
    server.wait_added(lambda added: _flat(added) == ["d0"])
    server.answers.put(AgentTaskResponse(tasks=[_task("d0"), _task("d1")]))   # d1 was never added
    server.wait_added(lambda added: _flat(added) == ["d0", "d0"])
    assert devices[0].handled == ["train"] and devices[1].handled == []


def test_a_session_the_server_forgot_gets_its_idle_devices_again():
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1")]
    session, _ = _session(server, devices)
    session.register(devices[0])
    session.register(devices[1])
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d1"])
    server.answers.put(AgentTaskResponse())   # the first held answer: the session exists
    time.sleep(0.3)
    server.answers.put(AgentTaskResponse(new_session=True, tasks=[_task("d0")]))
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d0", "d1", "d1"])
    assert devices[0].handled == ["train"]


def test_a_task_for_a_device_queued_to_be_added_again_runs_and_takes_it_off_the_queue():
    # One request's answer says the session is new (the Fed Server restarted): the idle devices
    # are queued to be added again. The other request, held in the session the first one opened,
    # brings d0's task before the adder sent d0: the server hands each task once, so it must run.
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1")]
    session = AgentTasks(server, devices, threading.Event(), lambda device, exc: None,   # type: ignore[arg-type]
                         wait_s=0.2)   # not started: the adder sends nothing, the queue stays
    # Both devices told to the session as idle, as the adder marks a batch it sends (under the lock).
    with session._lock:
        session._idle_now(devices)   # type: ignore[arg-type]
    session._take(AgentTaskResponse(new_session=True), forgotten=True)
    assert sorted(session._to_add.waiting) == ["d0", "d1"] and session._idle == {}
    session._take(AgentTaskResponse(tasks=[_task("d0")]), forgotten=False)
    deadline = time.monotonic() + WAIT
    while devices[0].handled != ["train"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert devices[0].handled == ["train"] and devices[1].handled == []
    assert sorted(session._to_add.waiting) == ["d0", "d1"]   # d0 queued again once its task ran, d1 still


def test_a_device_the_server_does_not_know_registers_again_and_a_refused_one_stops():
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1"), FakeDevice("d2")]
    server.on_add = lambda req: AgentTaskResponse(
        unknown=["d0"] if devices[0].registrations == 1 and "d0" in [d.device_id for d in req.add] else [],
        refused={"d1": "replaced"} if "d1" in [d.device_id for d in req.add] else {})
    session, failures = _session(server, devices)
    for device in devices:
        session.register(device)
    server.wait_added(lambda added: _flat(added).count("d0") == 2)
    assert devices[0].registrations == 2 and _flat(server.batches).count("d0") == 2
    assert [f[0] for f in failures] == ["d1"]
    assert "replaced" in str(failures[0][1])
    server.answers.put(AgentTaskResponse(tasks=[_task("d0", "done"), _task("d2", "done")]))
    assert session.ended.wait(WAIT)


def test_a_fed_server_unreachable_for_longer_than_allowed_fails_the_waiting_devices():
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1")]
    server.on_add = lambda req: (_ for _ in ()).throw(Unreachable("connection refused"))
    for _ in range(100):
        server.answers.put(Unreachable("connection refused"))
    session, failures = _session(server, devices, max_downtime_s=0.5, retry_s=0.05)
    for device in devices:
        session.register(device)
    assert session.ended.wait(WAIT)
    assert sorted(f[0] for f in failures) == ["d0", "d1"]
    assert all(isinstance(f[1], Unreachable) for f in failures)


def test_a_request_answered_on_another_thread_while_one_fails_leaves_the_failure_handled(monkeypatch):
    # The failing request's thread sees the session up again between its checks (another thread's
    # request was answered): it waits and retries instead of raising.
    import device_agent.agent_tasks as agent_tasks

    session = AgentTasks(FakeServer(), [], threading.Event(), lambda device, exc: None,   # type: ignore[arg-type]
                         wait_s=0.2, retry_s=0.01)

    def answered_elsewhere(*args: object) -> None:
        session._down_since = None
    monkeypatch.setattr(agent_tasks.log, "warning", answered_elsewhere)
    session._failed_request(Unreachable("connection refused"))
    assert not session.ended.is_set()


def test_devices_register_in_batches_with_their_tokens_and_a_refused_one_fails_with_its_reason():
    server, devices = FakeServer(), [FakeDevice(f"d{i}") for i in range(4)]
    server.refuse = {"d1": 409, "d2": 500}
    session, failures = _session(server, devices)
    for device in devices:
        session.register(device)
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d3"])
    assert sorted(_flat(server.batches)) == ["d0", "d1", "d2", "d3"] and len(server.batches) <= 4
    assert devices[0].token.startswith("token-d0-") and devices[0].registrations == 1
    assert sorted((device, type(exc)) for device, exc in failures) == [("d1", RegistrationRefused), ("d2", Failed)]
    assert "refused by the Fed Server: no" in str(dict(failures)["d1"])


def test_a_device_asked_to_register_later_registers_once_its_retry_after_has_passed():
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1")]
    server.refuse, server.retry_after_s = {"d1": 429}, 0.3
    session, failures = _session(server, devices)
    asked = time.monotonic()
    for device in devices:
        session.register(device)
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d1"])
    assert time.monotonic() - asked >= 0.3
    assert failures == [] and _flat(server.batches).count("d1") == 2 and devices[1].registrations == 1


def test_a_device_whose_attempt_ended_without_its_upload_is_told_to_give_its_task_up():
    server, devices = FakeServer(), [FakeDevice("d0"), FakeDevice("d1")]
    session, failures = _session(server, devices)
    for device in devices:
        session.register(device)
    server.wait_added(lambda added: sorted(_flat(added)) == ["d0", "d1"])
    server.answers.put(AgentTaskResponse(ended={"d1": 7, "not-ours": 7}))
    server.answers.put(AgentTaskResponse(tasks=[_task(d.device_id, "done") for d in devices]))
    assert session.ended.wait(WAIT) and failures == []
    assert devices[0].taken_out_of == [] and devices[1].taken_out_of == [7]
