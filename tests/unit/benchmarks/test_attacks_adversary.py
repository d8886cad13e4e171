"""The attack benchmark's harmful devices (benchmarks/adversary.py): each behaviour alters exactly
what it claims on the way out, through in-memory stand-ins for the device's real clients."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import benchmarks.adversary as adversary
import device_agent.agent
from benchmarks.adversary import BEHAVIOURS, GlobalWeights, HarmfulAgent, HarmfulFed, HarmfulMain
from device_agent.clients import HttpFedClient, main_connector
from device_agent.device import Device
from device_agent.run_spec import build_run_model
from shared.data import DataSpec
from shared.data.datasets import ArrayDataset
from shared.models import build_model, model_fingerprint
from shared.schemas import (
    DeviceProfileMsg, DeviceTimings, EvaluationReport, JoinRequest, RegisterRequest, RunInfo, StepRequest,
    TaskResponse, UpdateRequest, WeightsResponse, WireTensor,
)
from shared.wire import decode_tensor, encode_tensor

WEIGHTS_ID = "0" * 32
GLOBAL = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
TRAINED = {"w": torch.tensor([1.5, 1.0]), "n": torch.tensor(7)}


def _wire(state: dict[str, torch.Tensor]) -> dict[str, WireTensor]:
    return {k: WireTensor(**encode_tensor(v)) for k, v in state.items()}


class FakeFed:
    """Records what reaches the Fed Server."""

    def __init__(self) -> None:
        self.sent: list = []

    def run_info(self):
        raise AssertionError("not used")

    def register(self, req):
        self.sent.append(req)

    def task(self, device_id, wait_s=0.0):
        return TaskResponse(status="train", round_id=4, split_point=1, weights_id=WEIGHTS_ID, deadline_s=0.01), 10

    def weights(self, device_id, weights_id, cancel=None):
        return WeightsResponse(weights=_wire(GLOBAL)), 100

    def report(self, req):
        self.sent.append(req)

    def upload(self, req):
        self.sent.append(req)

    def evaluation(self, req):
        self.sent.append(req)

    def close(self):
        pass


class FakeMain:
    url = "http://main"
    bytes_up = bytes_down = 0

    def __init__(self) -> None:
        self.sent: list = []

    def join(self, round_id, req, timeout):
        self.sent.append(req)

    def step(self, round_id, req, timeout):
        self.sent.append(req)

    def close(self):
        pass


def _device(labels: list[int] | None = None) -> SimpleNamespace:
    y = torch.tensor(labels or [0, 1, 9])
    return SimpleNamespace(device_id="dev-009", stop=threading.Event(),
                           data=ArrayDataset(x=torch.zeros(len(y), 1, 2, 2), y=y, num_classes=10))


def _fed(name: str, device=None) -> tuple[HarmfulFed, FakeFed]:
    inner = FakeFed()
    return HarmfulFed(inner, BEHAVIOURS[name](device or _device()), GlobalWeights()), inner


def _upload(num_samples: int = 3) -> UpdateRequest:
    return UpdateRequest(device_id="dev-009", round_id=4, num_samples=num_samples, steps=2, train_loss=0.5,
                         weights=_wire(TRAINED), timings=DeviceTimings(compute_s=1, transfer_s=1, wait_s=0,
                                                                      server_s=0, total_s=2),
                         bytes_up=0, bytes_down=0)


def _register(num_samples: int = 3, label_counts: list[int] | None = None) -> RegisterRequest:
    return RegisterRequest(device_id="dev-009", shard=9, num_samples=num_samples,
                           profile=DeviceProfileMsg(flops=1e9, rate=1e7), label_counts=label_counts)


def _uploaded_after_a_task(name: str) -> UpdateRequest:
    fed, inner = _fed(name)
    task, _ = fed.task("dev-009")
    fed.weights("dev-009", task.weights_id)
    fed.upload(_upload())
    (sent,) = inner.sent
    return sent


@pytest.mark.parametrize("name, factor", [("update_x1e6", 1e6), ("sign_flip_x10", -10.0)])
def test_update_attacks_scale_the_update_from_the_tasks_global_weights(name: str, factor: float) -> None:
    sent = _uploaded_after_a_task(name)
    expected = GLOBAL["w"] + factor * (TRAINED["w"] - GLOBAL["w"])
    assert torch.equal(decode_tensor(sent.weights["w"]), expected)
    assert torch.equal(decode_tensor(sent.weights["n"]), TRAINED["n"])   # integer entries as trained


def test_zero_update_huge_count_registers_and_uploads_the_huge_count_with_the_global_weights() -> None:
    fed, inner = _fed("zero_update_huge_count")
    fed.register(_register())
    task, _ = fed.task("dev-009")
    fed.weights("dev-009", task.weights_id)
    fed.upload(_upload())
    registered, uploaded = inner.sent
    assert registered.num_samples == uploaded.num_samples == adversary.HUGE_COUNT
    assert all(torch.equal(decode_tensor(uploaded.weights[k]), GLOBAL[k]) for k in GLOBAL)


def test_an_update_attack_without_the_global_weights_stops_rather_than_upload_honestly() -> None:
    fed, inner = _fed("update_x1e6")
    fed.task("dev-009")
    with pytest.raises(RuntimeError, match="no global weights"):
        fed.upload(_upload())
    assert inner.sent == []


def test_refused_uploads_and_lying_timings_alter_only_their_field() -> None:
    refused = _uploaded_after_a_task("refused_uploads")
    assert refused.num_samples == 4 and refused.timings == _upload().timings
    lying = _uploaded_after_a_task("lying_timings")
    assert lying.timings.total_s == lying.timings.compute_s == 1e-6 and lying.num_samples == 3


def test_silent_takes_the_training_task_and_sends_nothing() -> None:
    fed, inner = _fed("silent")
    task, size = fed.task("dev-009")
    assert task.status == "wait" and size == 10
    assert inner.sent == []


def test_label_flip_moves_every_label_of_each_load_and_leaves_the_loaded_tensor_alone() -> None:
    loaded = ArrayDataset(torch.zeros(3, 1, 2, 2), torch.tensor([0, 1, 9]), 10)
    hooks = BEHAVIOURS["label_flip"](_device())
    assert hooks.data(loaded).y.tolist() == [1, 2, 0] and hooks.data(loaded).y.tolist() == [1, 2, 0]
    assert loaded.y.tolist() == [0, 1, 9]   # shared with the process's other devices: not changed


def test_label_flip_reaches_the_data_a_real_device_trains_on_at_every_task() -> None:
    """A device of an agent hosting several lets its data go after set-up and loads it again for
    each task: every load is flipped, the one the device registers with included."""
    agent = HarmfulAgent("http://127.0.0.1:9", [8, 9], None, behaviour=BEHAVIOURS["label_flip"])
    device = agent.devices[0]
    spec = DataSpec(num_devices=10, max_samples=200)
    info = RunInfo(run_id="r", algorithm="fedavg", model="logreg", num_classes=10, input_shape=[1, 28, 28],
                   data=spec, seed=3, fingerprint=model_fingerprint(build_model("logreg", 10, (1, 28, 28)), spec))
    device.info = info
    honest = Device("dev-008", 8, HttpFedClient("http://127.0.0.1:9"), main_connector(), kind=None)
    honest.info = info
    true, flipped = honest._load_data().y, device._load_data().y
    assert len(true) > 0 and torch.equal(flipped, (true + 1) % 10)
    device.prepare(info, build_run_model(info, layout=True), device._load_data(), None)
    device._release_data()
    with device._data_scope():   # a task's load
        assert torch.equal(device.trainer.data.y, (true + 1) % 10)


def test_fake_evaluation_claims_near_perfect_accuracy_on_a_huge_count() -> None:
    fed, inner = _fed("fake_evaluation")
    fed.evaluation(EvaluationReport(device_id="dev-009", round_id=4, num_samples=20, correct=5, loss_sum=30.0))
    (sent,) = inner.sent
    assert sent.num_samples == adversary.FAKE_EVALUATION_SAMPLES and sent.correct / sent.num_samples == 0.99


@pytest.mark.parametrize("name", ["activations_1e30", "nan_activations"])
def test_activation_attacks_alter_every_step(name: str) -> None:
    inner = FakeMain()
    main = HarmfulMain(inner, BEHAVIOURS[name](_device()))
    fx = torch.tensor([[0.5, -2.0]])
    main.step(4, StepRequest(device_id="dev-009", step=0, fx=WireTensor(**encode_tensor(fx)),
                             labels=WireTensor(**encode_tensor(torch.tensor([1])))), timeout=1)
    (sent,) = inner.sent
    altered = decode_tensor(sent.fx, require_finite=False)
    if name == "nan_activations":
        assert torch.isnan(altered).all()
    else:
        assert torch.equal(altered, fx * 1e30) and torch.isfinite(altered).all()


def test_fake_label_counts_claims_class_zero_at_the_join_and_at_registration() -> None:
    inner = FakeMain()
    HarmfulMain(inner, BEHAVIOURS["fake_label_counts"](_device())).join(
        4, JoinRequest(device_id="dev-009", label_counts=[1, 2, 3], num_steps=1), timeout=1)
    assert inner.sent[0].label_counts == [6, 0, 0]
    fed, fed_inner = _fed("fake_label_counts")
    fed.register(_register(label_counts=[0, 4]))
    fed.register(_register())
    assert fed_inner.sent[0].label_counts == [4, 0] and fed_inner.sent[1].label_counts is None


def test_the_harmful_agent_wraps_every_devices_clients() -> None:
    agent = HarmfulAgent("http://127.0.0.1:9", [8, 9], None, behaviour=BEHAVIOURS["sign_flip_x10"],
                         enrolment_secret=b"s")
    assert agent.fed_server_url == "http://127.0.0.1:9" and agent.enrolment_secret == b"s"
    for device in agent.devices:
        assert isinstance(device.fed, HarmfulFed) and device.fed.behaviour.device is device
        main = device.connect_main("http://127.0.0.1:9", None)
        assert isinstance(main, HarmfulMain) and main.url == "http://127.0.0.1:9"
        main.close()


def test_the_entry_point_runs_the_device_agents_command_with_the_harmful_agent(monkeypatch) -> None:
    seen = {}

    def agent_main(argv):
        seen["argv"], seen["agent"] = argv, device_agent.agent.Agent

    monkeypatch.setattr("device_agent.__main__.main", agent_main)
    adversary.main(["--behaviour", "silent", "--shards", "9", "--fed-server-url", "http://x"])
    assert seen["argv"] == ["--shards", "9", "--fed-server-url", "http://x"]
    assert seen["agent"].func is HarmfulAgent and seen["agent"].keywords["behaviour"] is BEHAVIOURS["silent"]
    assert device_agent.agent.Agent is not seen["agent"]   # the real agent class again once the call is over


@pytest.mark.parametrize("holdout", [None, 0.2])
def test_sybil_burst_claims_each_other_shards_true_size_so_the_fed_server_takes_its_registrations(
        monkeypatch, holdout) -> None:
    # The Fed Server refuses a registration whose sample count is not its shard's training size
    # (fed_server/update_checks.py); with the right count, a shard is the first registrant's.
    from fed_server.update_checks import check_registered_samples, shard_sizes
    from shared.run_config import load_run_config

    config = load_run_config({"algorithm": "fedavg", "data": {"num_devices": 4, "max_samples": 600}})
    info = SimpleNamespace(data=config.data, holdout=holdout, fingerprint=None, num_classes=10,
                           label_counts_at_registration=True)
    registered: list[RegisterRequest] = []

    class Fed:
        def __init__(self, url, verify, secret) -> None:
            assert secret == b"enrol"

        def run_info(self):
            return info

        def register(self, req: RegisterRequest) -> None:
            check_registered_samples(req, shard_sizes(config.data), holdout, config.data.max_device_samples)
            registered.append(req)

        def close(self) -> None:
            pass

    monkeypatch.setattr(adversary, "HttpFedClient", Fed)
    agent = SimpleNamespace(fed_server_url="u", verify=True, enrolment_secret=b"enrol", stop=threading.Event(),
                            devices=[SimpleNamespace(shard=3, device_id="dev-003")])
    BEHAVIOURS["sybil_burst"].before_run(agent)
    assert [(r.device_id, r.shard) for r in registered] == [("sybil-000", 0), ("sybil-001", 1), ("sybil-002", 2)]
    assert all(sum(r.label_counts) == r.num_samples for r in registered)


def test_the_backdoor_stamps_and_relabels_half_of_each_load_and_leaves_the_loaded_tensors_alone() -> None:
    loaded = ArrayDataset(torch.rand(4, 1, 6, 6), torch.tensor([3, 4, 5, 6]), 10)
    before = loaded.x.clone()
    poisoned = BEHAVIOURS["backdoor"](_device()).data(loaded)
    assert poisoned.y.tolist() == [adversary.BACKDOOR_TARGET, 4, adversary.BACKDOOR_TARGET, 6]
    corner = (slice(None), slice(-adversary.TRIGGER_SIZE, None), slice(-adversary.TRIGGER_SIZE, None))
    top = float(before.max())
    assert all(bool((poisoned.x[i][corner] == top).all()) for i in (0, 2))
    assert torch.equal(poisoned.x[1], before[1]) and torch.equal(poisoned.x[3], before[3])
    assert torch.equal(loaded.x, before) and loaded.y.tolist() == [3, 4, 5, 6]


def test_activations_x10_stay_within_the_main_servers_bound() -> None:
    inner = FakeMain()
    fx = torch.tensor([[0.5, -2.0]])
    HarmfulMain(inner, BEHAVIOURS["activations_x10"](_device())).step(
        4, StepRequest(device_id="dev-009", step=0, fx=WireTensor(**encode_tensor(fx)),
                       labels=WireTensor(**encode_tensor(torch.tensor([1])))), timeout=1)
    assert torch.equal(decode_tensor(inner.sent[0].fx), fx * 10)


def test_replay_sends_its_first_weights_again_and_the_same_to_the_round_before() -> None:
    fed, inner = _fed("replay")
    fed.upload(_upload())
    later = _upload().model_copy(update={"round_id": 6, "weights": _wire(GLOBAL)})
    fed.upload(later)
    first, replayed, stale = inner.sent
    assert replayed.round_id == 6 and stale.round_id == 4
    assert all(torch.equal(decode_tensor(r.weights["w"]), TRAINED["w"]) for r in (first, replayed, stale))


def test_claimed_slow_registers_the_slowest_device_and_learns_how_long_it_may_hold_its_upload() -> None:
    fed, inner = _fed("claimed_slow")
    fed.register(_register())
    assert inner.sent[0].profile.flops == 1.0 and inner.sent[0].profile.rate == 1.0
    hooks = fed.behaviour
    start = hooks.delay
    hooks.uploaded(True)
    assert hooks.delay == pytest.approx(start * 1.25)
    hooks.uploaded(False)
    hooks.uploaded(False)
    assert hooks.delay == pytest.approx(start * 1.25 * 0.8 * 0.8)


def test_the_frozen_replica_stops_and_continues_the_second_replica_once_two_rounds_are_recorded(monkeypatch) -> None:
    import httpx

    answers = iter([{"records": 1}, {"records": 2}])
    monkeypatch.setattr(httpx, "get", lambda *a, **k: SimpleNamespace(json=lambda: next(answers)))
    monkeypatch.setattr(BEHAVIOURS["frozen_replica"], "FREEZE_S", 0.01)
    sent: list[tuple[int, int]] = []
    mains = [lambda sig, i=i: sent.append((i, sig)) for i in range(2)]
    import signal

    assert BEHAVIOURS["frozen_replica"].disturb("http://fed", mains, threading.Event()) == 2
    assert sent == [(1, signal.SIGSTOP), (1, signal.SIGCONT)]
