"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1, option II) against the paper's equations:
the corrected local step, c_i+, the server's x and c updates with η_g and |S|/N, and the pending
c_i+ that only the round the Fed Server aggregated confirms, so that c stays the mean of the c_i
through lost uploads and failed attempts."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext, parse_payload, trainable_parameters
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.algorithms.scaffold import Scaffold, ScaffoldLogic, ScaffoldState, ScaffoldTaskExtras, ScaffoldUploadExtras
from shared.config import RunConfig, TrainConfig
from shared.run_config import ConfigError, resolve_run_config
from shared.wire import packb, unpackb

LR = 0.1
N = 4


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


PARAMETERS = trainable_parameters(_model())


def _algorithm(global_lr: float = 1.0) -> Scaffold:
    algorithm = build_algorithm(RunConfig(algorithm="scaffold", algorithm_params={"global_lr": global_lr},
                                          aggregation={"rule": "mean"}, data={"num_devices": N}))
    assert isinstance(algorithm, Scaffold) and ALGORITHMS["scaffold"] is Scaffold
    algorithm.bind_model(_model())
    return algorithm


def _wire(payload, model):
    """``payload`` as its receiver gets it: packed, unpacked and parsed against the parameters."""
    return parse_payload(model, unpackb(packb(payload.to_wire())), "payload", PARAMETERS)


def _batches(device: int, round_index: int, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 * device + round_index)
    return [(torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(steps)]


def _device_round(algorithm: Scaffold, device: str, ctx: RoundContext, global_state: dict, kept: ScaffoldState | None,
                  batches) -> tuple[dict, ScaffoldUploadExtras, ScaffoldState, ScaffoldLogic]:
    """One device's round as its agent runs it: the task's extras and its kept state through the
    wire, K local steps of SGD on the logic's loss, the upload's extras and the state it keeps."""
    model = _model()
    model.load_state_dict(global_state)
    logic = Scaffold.device_logic(algorithm.device_params(), None, TrainConfig(lr=LR))
    assert isinstance(logic, ScaffoldLogic)
    logic.restore_state(None if kept is None else _wire(kept, ScaffoldState))
    logic.begin_round(model, _wire(algorithm.task_extras(device, ctx), ScaffoldTaskExtras), None)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        loss = logic.loss(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    extras = _wire(logic.upload_extras(model, None), ScaffoldUploadExtras)   # type: ignore[arg-type]
    state = logic.kept_state()
    assert state is not None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, extras, state, logic


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p, value) for n, p in PARAMETERS.items()}


def test_each_local_step_is_y_minus_lr_times_the_gradient_minus_c_i_plus_c():
    algorithm = _algorithm()
    algorithm.c = {n: torch.randn_like(p) for n, p in PARAMETERS.items()}
    c_i = {n: torch.randn_like(p) for n, p in PARAMETERS.items()}
    kept = ScaffoldState(c_i=_tensors(0.0), pending=c_i, pending_round=1)
    algorithm.last_aggregated["dev-0"] = 1          # round 1 aggregated its upload: c_i is confirmed
    batches = _batches(0, 2)
    x = _model().state_dict()
    trained, _, _, logic = _device_round(algorithm, "dev-0", RoundContext(2, 5), x, kept, batches)
    y = _model()
    for xb, yb in batches:                          # the paper's step, written out
        y.zero_grad()
        F.cross_entropy(y(xb), yb).backward()
        with torch.no_grad():
            for n, p in y.named_parameters():
                p -= LR * (p.grad - c_i[n] + algorithm.c[n])
    for n, p in y.named_parameters():
        assert torch.allclose(trained[n], p.detach(), atol=1e-6), n
    assert logic.steps == 3


def test_the_correction_changes_the_gradient_and_not_the_loss_the_round_records():
    algorithm = _algorithm()
    algorithm.c = _tensors(5.0)
    model = _model()
    logic = Scaffold.device_logic({}, None, TrainConfig(lr=LR))
    logic.restore_state(None)
    logic.begin_round(model, _wire(algorithm.task_extras("dev-0", RoundContext(1, 1)), ScaffoldTaskExtras), None)  # type: ignore[arg-type]
    x, y = _batches(0, 1, 1)[0]
    assert torch.equal(logic.loss(model, x, y), F.cross_entropy(model(x), y))


def test_c_i_plus_is_option_ii_and_the_upload_carries_its_change():
    algorithm = _algorithm()
    algorithm.c = {n: torch.randn_like(p) for n, p in PARAMETERS.items()}
    x = _model().state_dict()
    trained, extras, state, _ = _device_round(algorithm, "dev-1", RoundContext(3, 7), x, None, _batches(1, 3))
    for n in PARAMETERS:   # a device never aggregated before: c_i = 0
        c_plus = 0 - algorithm.c[n] + (x[n] - trained[n]) / (3 * LR)
        assert torch.allclose(state.pending[n], c_plus, atol=1e-5), n
        assert torch.allclose(extras.delta_c[n], c_plus, atol=1e-5), n
        assert torch.equal(state.c_i[n], torch.zeros_like(c_plus))
    assert state.pending_round == 3   # kept pending until a task says round 3 aggregated it


@pytest.mark.parametrize("last_aggregated, confirmed", [(4, "pending"), (3, "c_i"), (None, "c_i")])
def test_a_pending_c_i_is_confirmed_only_by_the_round_that_aggregated_it(last_aggregated, confirmed):
    algorithm = _algorithm()
    kept = ScaffoldState(c_i=_tensors(1.0), pending=_tensors(2.0), pending_round=4)
    if last_aggregated is not None:
        algorithm.last_aggregated["dev-0"] = last_aggregated
    _, _, state, logic = _device_round(algorithm, "dev-0", RoundContext(6, 9), _model().state_dict(), kept,
                                       _batches(0, 6, 1))
    expected = 2.0 if confirmed == "pending" else 1.0
    assert all(torch.equal(logic.c_i[n], _tensors(expected)[n]) for n in PARAMETERS)
    assert all(torch.equal(state.c_i[n], _tensors(expected)[n]) for n in PARAMETERS)


def test_the_server_steps_x_by_global_lr_and_c_by_the_sum_of_delta_c_over_n():
    algorithm = _algorithm(global_lr=2.0)
    x = _model().state_dict()
    ups = {"dev-0": _model(1).state_dict(), "dev-2": _model(2).state_dict()}
    deltas = {"dev-0": _tensors(1.0), "dev-2": _tensors(3.0)}
    contributions = {d: Contribution(weight=1.0, client_state=s) for d, s in ups.items()}
    new = algorithm.aggregate(RoundContext(1, 1), x, contributions,
                              {d: ScaffoldUploadExtras(delta_c=t) for d, t in deltas.items()})
    for n in x:   # Δx is the rule's (here the plain) mean of the Δy_i
        assert torch.allclose(new[n], x[n] + 2.0 * ((ups["dev-0"][n] + ups["dev-2"][n]) / 2 - x[n]), atol=1e-6)
    for n in PARAMETERS:   # c + |S|/N * mean(Δc_i) = c + (1 + 3) / 4
        assert torch.allclose(algorithm.c[n], _tensors(1.0)[n])
    assert algorithm.last_aggregated == {"dev-0": 1, "dev-2": 1}
    extras = algorithm.task_extras("dev-2", RoundContext(2, 3))
    assert extras.last_aggregated == 1 and extras.round_index == 2 and algorithm.task_extras("dev-1", RoundContext(2, 3)).last_aggregated is None


def test_a_global_lr_of_one_takes_the_aggregation_rule_s_model_as_it_is():
    algorithm, fedavg = _algorithm(), build_algorithm(RunConfig(algorithm="fedavg", aggregation={"rule": "mean"}))
    x = _model().state_dict()
    contributions = {"dev-0": Contribution(weight=3.0, client_state=_model(1).state_dict()),
                     "dev-1": Contribution(weight=1.0, client_state=_model(2).state_dict())}
    new = algorithm.aggregate(RoundContext(1, 1), x, contributions,
                              {d: ScaffoldUploadExtras(delta_c=_tensors(0.0)) for d in contributions})
    expected = fedavg.aggregate(RoundContext(1, 1), x, contributions, {})
    assert all(torch.equal(new[n], expected[n]) for n in x)


def _confirmed(state: ScaffoldState | None, last_aggregated: int | None) -> dict[str, torch.Tensor]:
    """A device's c_i as its next round would take it (0 before anything was kept)."""
    if state is None:
        return _tensors(0.0)
    if state.pending_round is not None and state.pending_round == last_aggregated:
        return state.pending
    return state.c_i


def test_c_stays_the_mean_of_the_devices_c_i_through_partial_participation_and_lost_uploads():
    algorithm = _algorithm()
    x = _model().state_dict()
    kept: dict[str, ScaffoldState | None] = {f"dev-{i}": None for i in range(N)}
    schedule = [(["dev-0", "dev-1"], None), (["dev-1", "dev-2"], "dev-2"), (["dev-0", "dev-3"], "all"),
                (["dev-0", "dev-3"], None), (["dev-2", "dev-1"], None), (["dev-3", "dev-2"], "dev-3")]
    round_index = 1
    for attempt, (selected, lost) in enumerate(schedule, start=1):
        ctx = RoundContext(round_index, attempt)
        uploads = {}
        for device in selected:
            state, extras, kept[device], _ = _device_round(algorithm, device, ctx, x, kept[device],
                                                            _batches(int(device[-1]), attempt))
            uploads[device] = (state, extras)
        if lost == "all":   # the attempt failed after the uploads: nothing aggregated, the round is retried
            continue
        used = {d: u for d, u in uploads.items() if d != lost}   # a lost upload: kept state, never aggregated
        x = algorithm.aggregate(ctx, x, {d: Contribution(1.0, s) for d, (s, _) in used.items()},
                                {d: e for d, (_, e) in used.items()})
        round_index += 1
    assert all(float(c.abs().max()) > 0.01 for c in algorithm.c.values())
    for n in PARAMETERS:
        mean = torch.stack([_confirmed(kept[d], algorithm.last_aggregated.get(d))[n] for d in kept]).mean(0)
        assert torch.allclose(algorithm.c[n], mean, atol=1e-5), n


def test_the_checkpoint_keeps_c_and_the_devices_last_aggregated_rounds():
    algorithm = _algorithm()
    algorithm.c = {n: torch.randn_like(p) for n, p in PARAMETERS.items()}
    algorithm.last_aggregated = {"dev-0": 3, "dev-2": 5}
    restored = _algorithm()
    restored.load_state_dict(unpackb(packb(algorithm.state_dict())))   # the checkpoint is msgpack
    assert restored.last_aggregated == algorithm.last_aggregated
    assert all(torch.equal(restored.c[n], algorithm.c[n]) for n in PARAMETERS)
    restored.c[next(iter(PARAMETERS))] += 1   # writable: not a view of the checkpoint's bytes


def test_a_device_whose_kept_c_i_was_lost_says_so(caplog):
    algorithm = _algorithm()
    algorithm.last_aggregated["dev-0"] = 2
    with caplog.at_level(logging.WARNING):
        _device_round(algorithm, "dev-0", RoundContext(4, 4), _model().state_dict(), None, _batches(0, 4, 1))
    assert "round 4: this device's c_i from round 2 is lost" in caplog.text


@pytest.mark.parametrize("override, message", [
    ("train.momentum=0.9", "algorithm 'scaffold' takes plain SGD steps (option II reads K steps of train.lr back "
                           "from the model's move): set train.momentum to 0 (got 0.9)"),
    ("split.sliding=true", "algorithm 'scaffold' trains the whole model on the device (split depth zero), so "
                           "split.sliding does not apply: leave it unset"),
    ("grouping.method=random", "algorithm 'scaffold' trains the whole model on the device (split depth zero), so "
                               "grouping.method does not apply: leave it unset"),
    ("algorithm_params.global_lr=0", "algorithm_params.global_lr: must be greater than 0 (got 0)"),
])
def test_what_scaffold_cannot_run_is_refused_at_the_configuration_check_in_one_line(override, message):
    with pytest.raises(ConfigError) as refused:
        resolve_run_config(overrides=["algorithm=scaffold", override])
    assert refused.value.lines == [message]
