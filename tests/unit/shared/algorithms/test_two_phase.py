"""The two-phase protocol is FNR-FL's alone: ``two_phase`` tells it apart for the Fed Server (the
algorithm), the device agent (the algorithm's class and its device logic), and a device refuses a
task that asks for a report its algorithm does not send."""
from __future__ import annotations

import pytest

from device_agent.task_training import _task_terms
from shared.algorithms.fnr_fl import FNRFL, FNRFLFollowUp, FNRFLLogic
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.algorithms.two_phase import two_phase
from shared.config import TrainConfig
from shared.errors import Invalid
from shared.losses import build_loss
from shared.models import build_model, build_model_layout
from shared.run_config import load_run_config
from shared.schemas import TaskResponse

LAYOUT = build_model_layout("cnn", 10, (1, 28, 28))

FNR_FL_DATA = {"num_devices": 2, "partition": "iid", "seed": 1, "max_samples": 200, "public_samples": 20}


def _fnr_fl() -> FNRFL:
    algo = build_algorithm(load_run_config({"algorithm": "fnr-fl", "model": "cnn", "data": FNR_FL_DATA}))
    assert isinstance(algo, FNRFL)
    algo.bind_model(build_model("cnn", 10, (1, 28, 28)))
    return algo


def _task(algorithm: str, params: dict, report: bool) -> TaskResponse:
    return TaskResponse(status="train", round_id=1, split_point=2, num_blocks=2, algorithm=algorithm,
                        params=params, train=TrainConfig(), report=report)


def test_only_fnr_fl_is_two_phase():
    assert {name for name, algorithm in ALGORITHMS.items() if two_phase(algorithm) is not None} == {"fnr-fl"}
    fnr_fl = _fnr_fl()
    assert two_phase(fnr_fl) is fnr_fl
    assert two_phase(FNRFL.device_logic(fnr_fl.device_params())) is not None
    fedavg = build_algorithm(load_run_config({"algorithm": "fedavg"}))
    assert two_phase(fedavg) is None and two_phase(fedavg.device_logic({})) is None


def test_a_two_phase_task_brings_the_logic_and_the_follow_up_model():
    phases, logic, _ = _task_terms(_task("fnr-fl", _fnr_fl().device_params(), report=True), build_loss(), LAYOUT)
    assert phases is not None and phases[0] is logic and isinstance(logic, FNRFLLogic)
    assert phases[1] is FNRFLFollowUp
    assert _task_terms(_task("fnr-fl", _fnr_fl().device_params(), report=False), build_loss(), LAYOUT)[0] is None


def test_a_task_asking_for_a_report_its_algorithm_does_not_send_is_refused():
    with pytest.raises(Invalid, match="^the task asks for a report, which algorithm 'fedavg' does not send$"):
        _task_terms(_task("fedavg", {}, report=True), build_loss(), LAYOUT)
