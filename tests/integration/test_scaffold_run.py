"""SCAFFOLD end to end through the real services, with every process restarted halfway: the devices'
control variates c_i cross rounds on their agent's ``--state-dir`` (and its restart), c travels in
every task and Δc_i with every upload as tensors, and the Fed Server's c, kept in its checkpoint,
is the mean of the N devices' c_i, exactly as the paper's update keeps it."""
from __future__ import annotations

import torch

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config, wait_for
from shared.algorithms.base import parse_payload, trainable_parameters
from shared.algorithms.scaffold import ScaffoldState
from shared.models import build_model_layout
from shared.wire import decode_state, unpackb
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

DEVICES = 4


def _checkpoint_round(run_dir) -> int:
    path = RunDirectory(run_dir).checkpoint_path
    return RunDirectory(run_dir).read_checkpoint()[0] if path.exists() else 0


def _run_until(config, run_dir, rounds: int) -> None:
    """Run the testbed until its checkpoint holds ``rounds`` rounds, then stop every process at once
    (as Ctrl-C does), mid-round if one has begun."""
    testbed = Testbed(config, run_dir, warm=shared_starter())
    try:
        testbed.start()
        wait_for(lambda: _checkpoint_round(run_dir) >= rounds, 300, f"round {rounds}")
    finally:
        testbed.stop(interrupted=True)


def test_c_is_the_mean_of_the_devices_kept_c_i_after_the_agent_restarted(tmp_path, monkeypatch):
    states = tmp_path / "states"
    monkeypatch.setenv("SFL_STATE_DIR", str(states))   # every agent process of both testbeds
    # More rounds than run: the run never ends, so no device forgets its state before the check.
    config = small_config(algorithm="scaffold", rounds=20, devices_per_round=2,
                          **{"data.num_devices": DEVICES, "devices.profiles": []})
    run_dir = tmp_path / "run"
    _run_until(config, run_dir, 2)
    kept_before = sorted(p.name for p in states.rglob("*.msgpack"))
    assert kept_before, "the devices that trained keep their c_i in the state directory"
    _run_until(config, run_dir, 4)   # new processes: the Fed Server resumes, the agent finds its states
    assert "resumed run" in (run_dir / "logs" / "fed_server.log").read_text()
    assert "is lost" not in (run_dir / "logs" / "agent-0.log").read_text()

    _, _, extra = RunDirectory(run_dir).read_checkpoint()
    parameters = trainable_parameters(build_model_layout("cnn", 10, (1, 28, 28)))
    c = decode_state(extra["algorithm_state"]["c"], expect=parameters)
    last_aggregated = extra["algorithm_state"]["last_aggregated"]
    (folder,) = states.iterdir()
    assert folder.name == f"run-{extra['run_id']}"
    assert set(kept_before) <= {p.name for p in folder.iterdir()}
    confirmed = []
    for device in (f"dev-{i:03d}" for i in range(DEVICES)):
        path = folder / f"{device}.msgpack"
        if not path.exists():   # never selected: c_i = 0
            assert device not in last_aggregated
            continue
        state = parse_payload(ScaffoldState, unpackb(path.read_bytes()), "kept state", parameters)
        confirmed.append(state.pending if state.pending_round == last_aggregated.get(device) else state.c_i)
    assert len(last_aggregated) >= 2
    for name in parameters:
        mean = torch.stack([c_i[name] for c_i in confirmed]).sum(0) / DEVICES
        assert torch.allclose(c[name], mean, rtol=1e-4, atol=1e-6), name
    assert max(float(t.abs().max()) for t in c.values()) > 1e-3   # c moved: the check is not 0 == 0

    ok = [m for m in read_metrics(run_dir) if m["status"] == "ok"]
    assert [m["round"] for m in ok][:4] == [1, 2, 3, 4]
    assert ok[3]["test_accuracy"] > 0.3   # it trains (chance: 0.1)
    assert all(m["algorithm_metrics"]["c_norm"] > 0 for m in ok)
