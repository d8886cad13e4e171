"""The Fed Server validates every algorithm payload that arrives (reports, upload extras) against
the algorithm's model: a malformed one is refused as Invalid (422) naming the field, and nothing
is stored; what the server sends (task extras, follow-ups) keeps the algorithms' wire keys."""
from __future__ import annotations

import pytest
import torch

from fed_server.coordinator import Coordinator
from fed_server.run_dir import RunDirectory
from shared.algorithms.base import trainable_parameters
from shared.config import RunConfig
from shared.errors import Conflict, Invalid
from shared.portions import portion_state
from shared.schemas import DeviceProfileMsg, DeviceTimings, RegisterRequest, ReportRequest, UpdateRequest
from shared.wire import encode_state

TIMINGS = DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1)


def _coordinator(tmp_path, algorithm: str, **data) -> Coordinator:
    config = RunConfig.model_validate({"algorithm": algorithm, "rounds": 1, "seed": 3,
                                       "data": {"num_devices": 2, "max_samples": 200, **data}})
    coordinator = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    for i in range(2):
        coordinator.enrolment.register(RegisterRequest(device_id=f"d{i}", shard=i, num_samples=coordinator.enrolment.shard_sizes[i],
                                             profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    fed_round = coordinator.begin_round()
    fed_round.ready = True
    # The tests below speak for d0: make it a participant whatever the seeded selection drew.
    assert "d0" in fed_round.assignments, "d0 was not selected; pick the device from fed_round.assignments"
    return coordinator


def _upload(coordinator: Coordinator, device: str, extras: dict) -> UpdateRequest:
    state = portion_state(coordinator.core.model, 0, coordinator.core.num_blocks)
    assert coordinator.core.round is not None
    return UpdateRequest(device_id=device, round_id=coordinator.core.round.round_id,
                         num_samples=coordinator.core.devices.get(device).num_samples, steps=1,
                         train_loss=1.0, weights=encode_state(state), timings=TIMINGS, bytes_up=0, bytes_down=0,
                         extras=extras)


def _fedbc_extras(c: Coordinator, **changes) -> dict:
    """FedBC upload extras that fit d0's registered count (train_samples + local_total)."""
    return {"d": 0.0, "local_correct": 1, "local_total": 4, "train_samples": c.core.devices.get("d0").num_samples - 4,
            **changes}


@pytest.mark.parametrize("changes, refusal", [
    ({"local_total": -4}, "^extras: local_total: Input should be greater than or equal to 0$"),
    ({"d": float("nan")}, "^extras: d: Input should be a finite number$"),
    # the algorithm's own check (needs the upload's num_samples) also ends as Invalid
    ({"train_samples": 15}, "train_samples=15 \\+ local_total=4 must equal"),
])
def test_fedbc_bad_upload_extras_are_refused(tmp_path, changes, refusal):
    c = _coordinator(tmp_path, "fedbc")
    with pytest.raises(Invalid, match=refusal):
        c.uploads.accept_update(c.core.round.round_id, _upload(c, "d0", _fedbc_extras(c, **changes)), 100)
    assert c.core.round.updates == {}


def test_fedbc_task_extras_keep_their_wire_keys_and_upload_extras_are_stored_typed(tmp_path):
    c = _coordinator(tmp_path, "fedbc")
    task = c.dispatch.task_for("d0")
    assert task.status == "train" and set(task.extras) == {"lambda", "gamma", "split_seed"}
    good = _fedbc_extras(c)
    c.uploads.accept_update(c.core.round.round_id, _upload(c, "d0", good), 100)
    assert c.core.round.updates["d0"].extras.train_samples == good["train_samples"]  # stored typed, for aggregate and metrics


def test_fedavg_takes_no_upload_extras(tmp_path):
    c = _coordinator(tmp_path, "fedavg")
    with pytest.raises(Invalid, match="^extras: note: Extra inputs are not permitted$"):
        c.uploads.accept_update(c.core.round.round_id, _upload(c, "d0", {"note": 1}), 100)
    assert c.core.round.updates == {}


def test_fnr_fl_malformed_report_is_refused_and_not_stored(tmp_path):
    c = _coordinator(tmp_path, "fnr-fl", public_samples=20)
    assert c.dispatch.task_for("d0").report is True
    round_id = c.core.round.round_id
    bad = ReportRequest(device_id="d0", round_id=round_id,
                        extras={"public_accuracy": 0.5, "feature_norms": {"1": -2.0}, "num_samples": 20})
    with pytest.raises(Invalid, match="^report: feature_norms.1: Input should be greater than or equal to 0$"):
        c.uploads.accept_report(round_id, bad)
    assert c.core.round.reports == {}
    good = ReportRequest(device_id="d0", round_id=round_id,
                         extras={"public_accuracy": 0.5, "feature_norms": {"1": 2.0}, "num_samples": 20})
    c.uploads.accept_report(round_id, good)
    assert c.core.round.reports["d0"].feature_norms == {1: 2.0}
    c.uploads.plan_follow_ups(c.core.round)
    follow_up = c.dispatch.task_for("d0")
    assert follow_up.phase == "follow_up" and follow_up.extras == {"refine": False}  # p=0.5 of one reporter: none


def test_an_algorithm_without_two_phases_asks_for_no_report_and_takes_none(tmp_path):
    c = _coordinator(tmp_path, "fedavg")
    assert c.dispatch.task_for("d0").report is False
    report = ReportRequest(device_id="d0", round_id=c.core.round.round_id, extras={})
    with pytest.raises(Conflict, match="^algorithm fedavg takes no reports$"):
        c.uploads.accept_report(c.core.round.round_id, report)
    assert c.core.round.reports == {}


def _scaffold_delta(c: Coordinator, change: str) -> dict:
    """SCAFFOLD upload extras over the whole model's trainable parameters, its last one changed."""
    delta = {n: torch.full_like(p, 0.5) for n, p in trainable_parameters(c.core.model).items()}
    last = list(delta)[-1]
    if change == "nan":
        delta[last] = torch.full_like(delta[last], float("nan"))
    elif change == "shape":
        delta[last] = torch.zeros(delta[last].numel() + 1)
    elif change == "missing":
        del delta[last]
    return {"delta_c": encode_state(delta)}


@pytest.mark.parametrize("change, refusal", [
    ("nan", r"^extras: delta_c: delta_c\[blocks\.[\w.]+\]: contains NaN or Inf$"),
    ("shape", r"^extras: delta_c: delta_c\[blocks\.[\w.]+\]: shape \[\d+\] where \[[\d, ]+\] was expected$"),
    ("missing", r"^extras: delta_c: parameter names do not match the expected portion \(missing \['blocks\.[\w.]+'\], "
                r"unexpected \[\]\)$"),
])
def test_scaffold_upload_tensors_that_do_not_fit_the_uploaded_portion_are_refused(tmp_path, change, refusal):
    c = _coordinator(tmp_path, "scaffold")
    with pytest.raises(Invalid, match=refusal):
        c.uploads.accept_update(c.core.round.round_id, _upload(c, "d0", _scaffold_delta(c, change)), 100)
    assert c.core.round.updates == {}


def test_scaffold_task_tensors_go_out_and_upload_tensors_are_stored_typed(tmp_path):
    c = _coordinator(tmp_path, "scaffold")
    task = c.dispatch.task_for("d0")
    assert set(task.extras) == {"c", "round_index"}   # no last_aggregated: never aggregated
    assert list(task.extras["c"]) == list(trainable_parameters(c.core.model))
    c.uploads.accept_update(c.core.round.round_id, _upload(c, "d0", _scaffold_delta(c, "none")), 100)
    stored = c.core.round.updates["d0"].extras.delta_c
    assert all(torch.equal(t, torch.full_like(t, 0.5)) for t in stored.values())
