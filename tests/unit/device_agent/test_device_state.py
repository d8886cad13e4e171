"""What a device's algorithm keeps between its rounds: on disk, one checked file per device and run,
surviving a restart of the agent with ``--state-dir`` and removed with the agent without it."""
from __future__ import annotations

import tracemalloc

import pytest
import torch
from pydantic import Field

from device_agent.device_state import DeviceStates
from shared.algorithms.base import ParameterTensors, Payload, trainable_parameters

MODEL = torch.nn.Linear(256, 256)
PARAMETERS = trainable_parameters(MODEL)


class State(Payload):
    """A state as a device logic declares one (SCAFFOLD's has this shape)."""

    c_i: ParameterTensors
    pending_round: int | None = Field(None, ge=1)


def _state(seed: int) -> State:
    torch.manual_seed(seed)
    return State(c_i={n: torch.randn_like(p) for n, p in PARAMETERS.items()}, pending_round=seed + 1)


def _same(a: State | None, b: State) -> bool:
    return a is not None and a.pending_round == b.pending_round and all(
        torch.equal(a.c_i[n], b.c_i[n]) for n in PARAMETERS)


def test_a_kept_state_survives_a_restart_of_the_agent_with_a_state_dir(tmp_path):
    kept = _state(1)
    DeviceStates(tmp_path).keep("run-a", "dev-000", kept.to_wire())
    restarted = DeviceStates(tmp_path)   # a new agent process on the same --state-dir
    assert _same(restarted.load("run-a", "dev-000", State, PARAMETERS), kept)
    assert restarted.load("run-a", "dev-001", State, PARAMETERS) is None     # another device kept nothing
    assert restarted.load("run-b", "dev-000", State, PARAMETERS) is None     # another run starts afresh


def test_each_keep_replaces_the_device_s_state(tmp_path):
    states = DeviceStates(tmp_path)
    states.keep("r", "dev-000", _state(1).to_wire())
    states.keep("r", "dev-000", _state(2).to_wire())
    assert _same(states.load("r", "dev-000", State, PARAMETERS), _state(2))
    assert [p.name for p in (tmp_path / "run-r").iterdir()] == ["dev-000.msgpack"]   # no temporary file left


def test_without_a_state_dir_the_states_live_in_a_temporary_directory_removed_with_the_agent():
    states = DeviceStates()
    states.keep("r", "dev-000", _state(1).to_wire())
    folder = states.path("r", "dev-000").parent.parent
    assert folder.is_dir() and _same(states.load("r", "dev-000", State, PARAMETERS), _state(1))
    states.close()
    assert not folder.exists()
    assert DeviceStates().load("r", "dev-000", State, PARAMETERS) is None   # a restarted agent starts with none


def test_an_idle_device_s_state_is_on_disk_not_in_the_agent_s_memory(tmp_path):
    states = DeviceStates(tmp_path)
    wire = _state(1).to_wire()   # 257 KiB of tensors
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for device in range(40):
            states.keep("r", f"dev-{device:03d}", wire)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 20_000, held   # 40 states of 257 KiB would be 10 MiB
    assert len(list((tmp_path / "run-r").iterdir())) == 40


def test_a_state_that_does_not_fit_the_model_is_dropped_with_a_warning(tmp_path, caplog):
    states = DeviceStates(tmp_path)
    states.keep("r", "dev-000", _state(1).to_wire())
    other_model = trainable_parameters(torch.nn.Linear(256, 3))
    assert states.load("r", "dev-000", State, other_model) is None
    states.path("r", "dev-001").write_bytes(b"\xc1 not msgpack")
    assert states.load("r", "dev-001", State, PARAMETERS) is None
    assert [r.getMessage().split(" is unusable")[0] for r in caplog.records] == [
        f"dev-000: kept state {states.path('r', 'dev-000')}", f"dev-001: kept state {states.path('r', 'dev-001')}"]


def test_discarding_the_last_state_of_a_run_removes_its_folder(tmp_path):
    states = DeviceStates(tmp_path)
    for device in ("dev-000", "dev-001"):
        states.keep("r", device, _state(1).to_wire())
    states.discard("r", "dev-000")
    assert states.load("r", "dev-000", State, PARAMETERS) is None and (tmp_path / "run-r").is_dir()
    states.discard("r", "dev-001")
    assert list(tmp_path.iterdir()) == []
    states.discard("r", "dev-002")   # nothing kept: nothing to do


@pytest.mark.parametrize("run_id", ["../escape", "a/b", "", "x" * 65])
def test_a_run_id_that_is_not_a_plain_name_cannot_name_a_path_outside_the_directory(tmp_path, run_id):
    path = DeviceStates(tmp_path).path(run_id, "dev-000")
    assert path.parent.parent == tmp_path and path.parent.name.startswith("run-") and "/" not in path.parent.name[4:]


def test_the_state_dir_flag_and_its_environment_variable_reach_the_agent(agent_cli, monkeypatch, tmp_path):
    monkeypatch.delenv("SFL_STATE_DIR", raising=False)
    assert agent_cli.built_with([])["state_dir"] is None
    assert agent_cli.built_with(["--state-dir", str(tmp_path)])["state_dir"] == str(tmp_path)
    monkeypatch.setenv("SFL_STATE_DIR", str(tmp_path / "env"))
    assert agent_cli.built_with([])["state_dir"] == str(tmp_path / "env")
