"""Agent sessions without HTTP: idle devices added with their tokens, each task handed out once,
a held request woken by the round's opening, unknown and replaced tokens, forgotten sessions."""
from __future__ import annotations

import asyncio
import time

from fed_server.agent_sessions import SESSION_IDLE_S
from fed_server.coordinator import Coordinator
from fed_server.run_dir import RunDirectory
from fed_server.update_checks import trained_samples
from shared.run_config import load_run_config
from shared.schemas import AgentDevice, AgentTaskRequest, AgentTaskResponse, DeviceProfileMsg, RegisterRequest

AGENT = "0" * 32
OTHER_AGENT = "1" * 32
DEVICES = ["d0", "d1", "d2", "d3"]


def _coordinator(tmp_path) -> Coordinator:
    config = load_run_config({"algorithm": "fedavg", "rounds": 2, "devices_per_round": 2, "seed": 3,
                              "data": {"num_devices": 4, "max_samples": 400}})
    coordinator = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    for shard, device in enumerate(DEVICES):
        samples = trained_samples(coordinator.enrolment.shard_sizes[shard], coordinator.enrolment.run_info().holdout)
        coordinator.enrolment.register(RegisterRequest(device_id=device, shard=shard, num_samples=samples,
                                             profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    return coordinator


def _ask(coordinator: Coordinator, add: list[str] | list[AgentDevice] = (), wait_s: float = 0.0,
         agent: str = AGENT, auth: bool = False) -> AgentTaskResponse:
    devices = [d if isinstance(d, AgentDevice) else AgentDevice(device_id=d) for d in add]
    return asyncio.run(coordinator.agents.next_tasks(agent, AgentTaskRequest(add=devices, wait_s=wait_s), auth))


def _open_round(coordinator: Coordinator):
    fed_round = coordinator.begin_round()
    coordinator.dispatch.open_tasks(fed_round)
    return fed_round


def test_the_round_s_devices_among_the_idle_get_their_tasks_each_once(tmp_path):
    c = _coordinator(tmp_path)
    first = _ask(c, DEVICES)
    assert first.new_session and first.tasks == [] and not first.unknown and not first.refused
    fed_round = _open_round(c)
    answer = _ask(c)
    assert not answer.new_session
    assert sorted(t.device_id for t in answer.tasks) == sorted(fed_round.assignments)
    assert all(t.task.status == "train" and t.task.round_id == fed_round.round_id for t in answer.tasks)
    assert _ask(c).tasks == []   # handed out once; the others have no work in this attempt


def test_a_held_request_is_answered_when_the_round_opens(tmp_path):
    c = _coordinator(tmp_path)

    async def main() -> tuple[AgentTaskResponse, float]:
        held = asyncio.create_task(c.agents.next_tasks(AGENT, AgentTaskRequest(add=[AgentDevice(device_id=d)
                                                                                   for d in DEVICES], wait_s=10), False))
        await asyncio.sleep(0.1)
        assert not held.done()
        opened = time.monotonic()
        _open_round(c)
        return await held, time.monotonic() - opened
    answer, took = asyncio.run(main())
    assert len(answer.tasks) == 2 and took < 1.0


def test_a_device_the_server_does_not_know_or_with_a_replaced_token_stays_out_of_the_session(tmp_path):
    c = _coordinator(tmp_path)
    for device in DEVICES:
        c.enrolment.tokens.issued(device, f"old-{device}")
        c.enrolment.tokens.issued(device, f"token-{device}")
    add = [AgentDevice(device_id="d0", token="old-d0"), AgentDevice(device_id="d1", token=None),
           AgentDevice(device_id="nobody", token="token-d2"), AgentDevice(device_id="d2", token="token-d3"),
           AgentDevice(device_id="d3", token="token-d3")]
    answer = _ask(c, add, auth=True)
    assert answer.unknown == ["nobody"] and sorted(answer.refused) == ["d0", "d1", "d2"]
    for _ in range(4):   # whichever two are selected, only d3 can be handed a task
        fed_round = _open_round(c)
        tasks = _ask(c, auth=True).tasks
        assert [t.device_id for t in tasks] == (["d3"] if "d3" in fed_round.assignments else [])
        if tasks:
            return
        c.close_round()
    raise AssertionError("d3 was never selected")


def test_a_device_enrolled_again_after_it_was_added_is_dropped_until_added_with_its_new_token(tmp_path):
    c = _coordinator(tmp_path)
    for device in DEVICES:
        c.enrolment.tokens.issued(device, f"token-{device}")
    _ask(c, [AgentDevice(device_id=d, token=f"token-{d}") for d in DEVICES], auth=True)
    fed_round = _open_round(c)
    replaced = sorted(fed_round.assignments)[0]
    c.enrolment.tokens.issued(replaced, f"new-{replaced}")
    assert replaced not in [t.device_id for t in _ask(c, auth=True).tasks]
    answer = _ask(c, [AgentDevice(device_id=replaced, token=f"new-{replaced}")], auth=True)
    assert [t.device_id for t in answer.tasks] == [replaced]


def test_sessions_are_separate_and_one_not_asked_for_long_is_forgotten(tmp_path):
    c = _coordinator(tmp_path)
    _ask(c, DEVICES[:2])
    assert _ask(c, DEVICES[2:], agent=OTHER_AGENT).new_session and len(c.agents) == 2
    c.agents._sessions[AGENT].asked_at -= SESSION_IDLE_S + 1
    forgotten = _ask(c)
    assert forgotten.new_session and len(c.agents) == 2   # the old session went; this request opened a new one
    fed_round = _open_round(c)
    given = [t.device_id for t in _ask(c, agent=OTHER_AGENT).tasks]
    assert sorted(given) == sorted(d for d in fed_round.assignments if d in DEVICES[2:])
    assert _ask(c).tasks == []   # the forgotten session's devices were not added again


def test_a_finished_run_tells_every_idle_device_it_is_done(tmp_path):
    c = _coordinator(tmp_path)
    _ask(c, DEVICES)
    c.core.finished = True
    answer = _ask(c)
    assert sorted(t.device_id for t in answer.tasks) == DEVICES
    assert {t.task.status for t in answer.tasks} == {"done"}


def test_an_attempt_closed_without_a_device_s_upload_is_named_once_in_its_session_s_next_answer(tmp_path):
    c = _coordinator(tmp_path)
    _ask(c, DEVICES)
    fed_round = _open_round(c)
    handed = sorted(t.device_id for t in _ask(c).tasks)
    assert handed == sorted(fed_round.assignments) and len(handed) == 2
    finished, still_at_work = handed
    _ask(c, [finished])   # done with its task (added as idle again): its attempt is not its own to give up
    c.close_round()
    assert _ask(c).ended == {still_at_work: fed_round.round_id}
    assert _ask(c).ended == {}   # told once


def test_a_held_request_is_answered_when_an_attempt_ends_for_one_of_its_devices(tmp_path):
    c = _coordinator(tmp_path)
    _ask(c, DEVICES)
    fed_round = _open_round(c)
    handed = [t.device_id for t in _ask(c).tasks]

    async def main() -> tuple[AgentTaskResponse, float]:
        held = asyncio.create_task(c.agents.next_tasks(AGENT, AgentTaskRequest(wait_s=10), False))
        await asyncio.sleep(0.1)
        assert not held.done()
        closed = time.monotonic()
        c.close_round()
        return await held, time.monotonic() - closed
    answer, took = asyncio.run(main())
    assert answer.ended == {d: fed_round.round_id for d in handed} and took < 1.0


def test_only_the_attempt_a_device_was_handed_ends_its_task(tmp_path):
    c = _coordinator(tmp_path)
    _ask(c, DEVICES)
    fed_round = _open_round(c)
    handed = [t.device_id for t in _ask(c).tasks]
    c.agents.attempt_over(handed, fed_round.round_id + 1)   # another attempt's close
    c.agents.attempt_over([d for d in DEVICES if d not in handed], fed_round.round_id)   # devices not handed it
    assert _ask(c).ended == {}
