"""Where the global model is evaluated, and the sample-weighted mean of the devices' reports."""
from __future__ import annotations

import pytest
import torch

from shared.config import RunConfig
from shared.data import ArrayDataset, DataSpec
from shared.evaluation import combine_reports, evaluate, evaluation_mode, evaluation_sums, server_test_set
from shared.losses import build_loss
from shared.run_config import load_run_config
from shared.schemas import EvaluationReport

LOCAL = {"dataset": "local", "num_classes": 3, "input_shape": [1, 1, 4]}


def _report(device: str, n: int, correct: int, loss_sum: float, squared: float = 0.0,
            absolute: float = 0.0) -> EvaluationReport:
    return EvaluationReport(device_id=device, round_id=1, num_samples=n, correct=correct, loss_sum=loss_sum,
                            squared_error_sum=squared, absolute_error_sum=absolute)


def test_combined_reports_are_the_sample_weighted_means():
    result = combine_reports([_report("a", 10, 9, 2.0), _report("b", 30, 15, 27.0), _report("c", 0, 0, 0.0)])
    # (9 + 15) / 40 correct, (2 + 27) / 40 loss: the 30-sample device weighs three times the other;
    # the device that held nothing out counts for nothing.
    assert result.figures is not None
    assert result.figures.accuracy == pytest.approx(24 / 40) and result.figures.loss == pytest.approx(29 / 40)
    assert result.figures.mse is None and result.figures.mae is None
    assert (result.devices, result.samples) == (2, 40)
    unweighted = (9 / 10 + 15 / 30) / 2
    assert result.figures.accuracy != pytest.approx(unweighted)


def test_combined_regression_reports_are_the_sample_weighted_error_means():
    result = combine_reports([_report("a", 10, 0, 4.0, 8.0, 5.0), _report("b", 30, 0, 6.0, 12.0, 15.0)], "regression")
    assert result.figures is not None and result.figures.accuracy is None
    assert (result.figures.mse, result.figures.mae, result.figures.loss) == pytest.approx((20 / 40, 20 / 40, 10 / 40))


def test_no_evaluated_sample_gives_no_figures():
    for reports in ([], [_report("a", 0, 0, 0.0)]):
        result = combine_reports(reports)
        assert (result.figures, result.devices, result.samples) == (None, 0, 0)


def test_counts_are_what_evaluate_averages():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    data = ArrayDataset(torch.randn(37, 4), torch.randint(0, 3, (37,)), 3)
    sums = evaluation_sums(model, data, batch_size=5)
    figures = evaluate(model, data)
    assert figures.accuracy == pytest.approx(sums.correct / 37) and figures.loss == pytest.approx(sums.loss_sum / 37, rel=1e-5)
    assert figures.mse is None and sums.squared_error_sum == 0.0


def test_regression_figures_are_the_mean_squared_and_absolute_errors():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0]]))
        model.bias.zero_()
    x = torch.tensor([[1.0, 5.0], [2.0, 5.0], [4.0, 5.0]])
    y = torch.tensor([0.0, 2.0, 1.0])           # errors 1, 0, 3: squared 1, 0, 9
    data = ArrayDataset(x, y, 1)
    figures = evaluate(model, data, build_loss("mse"), batch_size=2)
    assert (figures.mse, figures.mae, figures.accuracy) == (pytest.approx(10 / 3), pytest.approx(4 / 3), None)
    assert figures.loss == pytest.approx(10 / 3)          # the loss is the run's: MSE here
    assert evaluate(model, data, build_loss("l1")).loss == pytest.approx(4 / 3)


def test_several_targets_average_each_sample_over_its_targets():
    model = torch.nn.Identity()
    y = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    data = ArrayDataset(torch.zeros(2, 2), y, 2)
    sums = evaluation_sums(model, data, build_loss("mse"))
    assert (sums.squared_error_sum, sums.absolute_error_sum, sums.loss_sum) == pytest.approx((5.0, 2.0, 5.0))


@pytest.mark.parametrize(("data", "mode", "expected"), [
    ({}, "auto", "server"),
    ({}, "federated", "federated"),
    (LOCAL, "auto", "federated"),
    ({**LOCAL, "test_file": "test.npz"}, "auto", "server"),
    ({**LOCAL, "test_file": "test.npz"}, "federated", "federated"),
])
def test_auto_means_server_exactly_when_the_server_has_a_test_set(data, mode, expected):
    config = RunConfig.model_validate({"data": data, "evaluation": {"mode": mode}})
    assert evaluation_mode(config) == expected


def test_server_evaluation_without_a_server_test_set_is_a_config_error():
    with pytest.raises(ValueError, match="evaluation.mode='server' needs a server-side test set"):
        load_run_config({"algorithm": "fedavg", "model": "logreg", "data": LOCAL, "evaluation": {"mode": "server"}})


def test_server_test_set_of_a_local_run_without_test_file_is_none_and_builtin_is_the_test_split():
    assert server_test_set(DataSpec(**LOCAL)) is None
    test = server_test_set(DataSpec(num_devices=2, max_samples=100))
    assert test is not None and len(test) > 0 and test.num_classes == 10


@pytest.mark.parametrize(("fields", "message"), [
    ({"correct": 11}, r"correct \(11\) exceeds num_samples \(10\)"),
    ({"loss_sum": float("inf")}, "finite number"),
    ({"loss_sum": -1.0}, "greater than or equal to 0"),
    ({"num_samples": 0, "correct": 0}, "loss_sum must be 0"),
    ({"round_id": "1"}, "valid integer"),
    ({"num_samples": True}, "valid integer"),
])
def test_bad_reports_are_refused_by_the_schema(fields, message):
    with pytest.raises(ValueError, match=message):
        EvaluationReport.model_validate({"device_id": "a", "round_id": 1, "num_samples": 10, "correct": 5,
                                         "loss_sum": 3.0, **fields})
