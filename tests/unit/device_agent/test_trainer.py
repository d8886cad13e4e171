"""Unit tests for device_agent.trainer and device_agent.timing.

The key check: split learning of one device with an in-process server (blocks[k:] trained with
the same plain SGD) produces exactly the weights of centralized SGD on the same batches.
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from device_agent.compute import ComputeThreads
from device_agent.timing import RoundClock
from device_agent.task_expired import TaskExpired
from device_agent.trainer import TrainContext, TrainSettings, batches, steps_per_round, train_round
from shared.http_client import Cancellation
from main_server.group_trainer import GroupTrainer, MemberBatch
from shared.algorithms.base import DeviceLogic
from shared.data import ArrayDataset
from shared.models import build_model
from shared.profiles import parse_kind

SHAPE = (1, 8, 8)


def _index_dataset(n: int) -> ArrayDataset:
    """x[i] holds i, so a batch tells which samples it contains."""
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1)
    return ArrayDataset(x=x, y=torch.arange(n) % 3, num_classes=3)


def _separable(n: int = 48, seed: int = 0) -> ArrayDataset:
    """Two classes: bright left half vs bright right half, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = 0.3 * torch.randn(n, *SHAPE, generator=gen)
    x[y == 0, :, :, :4] += 1.0
    x[y == 1, :, :, 4:] += 1.0
    return ArrayDataset(x=x, y=y, num_classes=2)


@pytest.fixture(scope="module")
def model():
    return build_model("cnn", num_classes=2, input_shape=SHAPE, seed=0)


def _weights(model, end: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.portion(0, end).state_dict().items()}


# ------------------------------------------------------------------------------------ batches
def _indices(batch) -> list[int]:
    return batch[0].view(-1).long().tolist()


def test_batches_deterministic_by_seed():
    data = _index_dataset(23)
    a = [_indices(b) for b in batches(data, 5, 2, seed=7)]
    b = [_indices(b) for b in batches(data, 5, 2, seed=7)]
    c = [_indices(b) for b in batches(data, 5, 2, seed=8)]
    assert a == b
    assert a != c


def test_batches_cover_every_sample_once_per_epoch():
    n, bs, epochs = 23, 5, 3
    data = _index_dataset(n)
    got = list(batches(data, bs, epochs, seed=1))
    per_epoch = -(-n // bs)
    assert len(got) == epochs * per_epoch == steps_per_round(n, bs, epochs)
    sizes = [len(_indices(b)) for b in got]
    assert sizes == ([5, 5, 5, 5, 3] * epochs)
    orders = []
    for e in range(epochs):
        idx = [i for b in got[e * per_epoch:(e + 1) * per_epoch] for i in _indices(b)]
        assert sorted(idx) == list(range(n))
        orders.append(idx)
    assert orders[0] != orders[1]  # reshuffled every epoch
    for x, y in got:
        assert torch.equal(y, x.view(-1).long() % 3)  # labels stay with their samples


def test_batches_exact_multiple_and_big_batch():
    data = _index_dataset(10)
    assert [len(_indices(b)) for b in batches(data, 5, 1, seed=0)] == [5, 5]
    assert [len(_indices(b)) for b in batches(data, 64, 2, seed=0)] == [10, 10]


def test_batches_do_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    list(batches(_index_dataset(10), 3, 2, seed=0))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "n,bs,epochs,expected", [(10, 3, 2, 8), (9, 3, 1, 3), (1, 32, 1, 1), (0, 4, 3, 0), (64, 32, 5, 10), (65, 32, 1, 3)]
)
def test_steps_per_round(n, bs, epochs, expected):
    assert steps_per_round(n, bs, epochs) == expected
    if n:
        assert len(list(batches(_index_dataset(n), bs, epochs, seed=0))) == expected


def test_a_portion_that_normalises_over_the_batch_never_trains_on_a_batch_of_one():
    # 260 = 7 x 37 + 1: with BatchNorm in the trained portion each epoch's lone last sample sits
    # out (a different one each epoch, the order being reshuffled), and the step count says so.
    n, bs, epochs = 260, 37, 3
    got = list(batches(_index_dataset(n), bs, epochs, seed=4, no_single=True))
    assert [len(_indices(b)) for b in got] == [37] * 7 * epochs
    assert len(got) == steps_per_round(n, bs, epochs, no_single=True) == 21
    left_out = [set(range(n)) - {i for b in got[7 * e:7 * (e + 1)] for i in _indices(b)} for e in range(epochs)]
    assert all(len(s) == 1 for s in left_out) and len(set.union(*left_out)) > 1, left_out
    # The same batches as without the rule but for that sample; other sizes are untouched.
    plain = list(batches(_index_dataset(n), bs, epochs, seed=4))
    assert [_indices(b) for b in plain if len(_indices(b)) > 1] == [_indices(b) for b in got]
    for size, batch_size in ((259, 37), (39, 37), (1, 37), (37, 37), (5, 1)):
        assert steps_per_round(size, batch_size, 1, no_single=True) == steps_per_round(size, batch_size, 1)
        assert len(list(batches(_index_dataset(size), batch_size, 1, seed=0, no_single=True))) \
            == steps_per_round(size, batch_size, 1)


def test_train_round_keeps_a_batchnorm_model_whose_last_batch_would_hold_one_sample():
    # FedAvg trains resnet8 (BatchNorm in every stage) on the device: 21 = 2 x 10 + 1 samples
    # used to end in a step PyTorch refuses ("Expected more than 1 value per channel").
    resnet = build_model("resnet8", num_classes=2, input_shape=SHAPE, seed=0)
    n_blocks = len(resnet.blocks)
    weights = _weights(resnet, n_blocks)
    result = train_round(resnet, n_blocks, weights, _separable(21), TrainSettings(0.05, 0.0, 0.0, 10, 1, 0),
                         TrainContext(RoundClock(None)))
    assert result.steps == steps_per_round(21, 10, 1, no_single=True) == 2
    assert not any(torch.equal(v, weights[k]) for k, v in resnet.portion(0, n_blocks).state_dict().items()
                   if k.endswith("running_mean"))


# ------------------------------------------------------------------------------------ local (depth zero)
def _eval_loss(model, weights, data) -> float:
    m = copy.deepcopy(model)
    m.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return float(F.cross_entropy(m(data.x), data.y))


def test_train_round_without_server_lowers_loss(model):
    data = _separable()
    n_blocks = len(model.blocks)
    m = copy.deepcopy(model)
    weights = _weights(m, n_blocks)
    initial = _eval_loss(model, weights, data)
    results = []
    for rnd in range(4):
        res = train_round(m, n_blocks, weights, data, TrainSettings(0.05, 0.0, 0.0, 16, 1, rnd),
                          TrainContext(RoundClock(None)))
        assert res.steps == steps_per_round(len(data), 16, 1) == 3
        uploaded = m.portion(0, n_blocks).state_dict()  # what the device uploads
        assert list(uploaded) == list(weights)
        weights = {k: v.clone() for k, v in uploaded.items()}  # the next round's task weights
        results.append(res)
    final = _eval_loss(model, weights, data)
    assert final < 0.5 * initial
    assert results[-1].train_loss < results[0].train_loss


class _SlowLogic(DeviceLogic):
    """Cross-entropy, but each step takes at least 50 ms (a slow device)."""

    def loss(self, portion, x, y):
        time.sleep(0.05)
        return super().loss(portion, x, y)


def test_train_round_past_its_deadline_gives_up_before_any_step(model):
    m = copy.deepcopy(model)
    weights = _weights(m, len(m.blocks))
    with pytest.raises(TaskExpired, match="after 0 steps"):
        train_round(m, len(m.blocks), weights, _separable(), TrainSettings(0.05, 0.0, 0.0, 8, 1, 0),
                    TrainContext(RoundClock(None), deadline=time.monotonic() - 1.0))


def test_train_round_whose_attempt_the_fed_server_closed_gives_up_at_its_next_step(model):
    m = copy.deepcopy(model)
    weights = _weights(m, len(m.blocks))
    taken_out = Cancellation()
    taken_out.set()
    with pytest.raises(TaskExpired, match="the Fed Server closed the task's attempt"):
        train_round(m, len(m.blocks), weights, _separable(), TrainSettings(0.05, 0.0, 0.0, 8, 1, 0),
                    TrainContext(RoundClock(None, taken_out=taken_out), deadline=time.monotonic() + 60.0))


def test_train_round_stops_when_its_deadline_passes_mid_round(model):
    m = copy.deepcopy(model)
    weights = _weights(m, len(m.blocks))
    t0 = time.monotonic()
    with pytest.raises(TaskExpired) as info:
        train_round(m, len(m.blocks), weights, _separable(), TrainSettings(0.05, 0.0, 0.0, 4, 5, 0),
                    TrainContext(RoundClock(None), logic=_SlowLogic({}), deadline=t0 + 0.2))
    done = int(str(info.value).split("after ")[1].split()[0])
    assert 1 <= done < steps_per_round(48, 4, 5)  # 60 steps of >= 50 ms would take >= 3 s
    assert time.monotonic() - t0 < 2.0


def test_a_whole_model_round_counts_its_emulated_stretch_against_the_deadline(model):
    """Without a Main Server the local training is one compute section, and an emulated kind's
    stretch is slept after it: the deadline is checked against the time the device will have
    taken, so a Low device (10x the server's speed) stops after about a tenth of the steps its
    bare compute would have fitted before the deadline, not after all of them."""
    m = copy.deepcopy(model)
    weights = _weights(m, len(m.blocks))
    low = parse_kind("low")
    assert low.compute_stretch == 10.0
    with pytest.raises(TaskExpired) as info:
        train_round(m, len(m.blocks), weights, _separable(), TrainSettings(0.05, 0.0, 0.0, 4, 5, 0),
                    TrainContext(RoundClock(low), logic=_SlowLogic({}), deadline=time.monotonic() + 0.6))
    done = int(str(info.value).split("after ")[1].split()[0])
    assert 1 <= done <= 3   # 0.6 s fits 11 steps of 50 ms unstretched, 1 stretched


def test_train_round_trains_the_model_in_place_and_leaves_the_task_weights_alone(model):
    """The device uploads its portion's state_dict after training (and any follow-up): the
    trained weights must be there, and the task's weights must be unchanged."""
    data = _separable(16)
    m = copy.deepcopy(model)
    weights = _weights(m, 4)
    sent = {k: v.clone() for k, v in weights.items()}
    train_round(m, 4, weights, data, TrainSettings(0.05, 0.0, 0.0, 8, 1, 0), TrainContext(RoundClock(None)))
    uploaded = m.portion(0, 4).state_dict()
    assert list(uploaded) == list(sent)
    assert all(torch.equal(weights[k], sent[k]) for k in sent)
    assert any(not torch.equal(uploaded[k], sent[k]) for k in sent)


# ------------------------------------------------------------------------------------ split == centralized
def _centralized(model, data, lr, bs, epochs, seed) -> tuple[dict[str, torch.Tensor], list[float]]:
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for x, y in batches(data, bs, epochs, seed):
        loss = F.cross_entropy(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return ref.state_dict(), losses


def _fake_server(model, k: int, lr: float):
    """An in-process Main Server for one device: blocks[k:] of a copy, plain SGD, returns dfx."""
    server = copy.deepcopy(model)
    portion = server.portion(k, len(server.blocks))
    opt = torch.optim.SGD(portion.parameters(), lr=lr)
    seen: list[int] = []

    def send_step(step: int, fx: torch.Tensor, labels: torch.Tensor):
        seen.append(step)
        inp = fx.detach().clone().requires_grad_(True)
        loss = F.cross_entropy(portion(inp), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return inp.grad.detach(), float(loss.detach())

    return server, send_step, seen


@pytest.mark.parametrize("k", [1, 2, 3])
def test_split_learning_equals_centralized_training(model, k):
    data = _separable(40, seed=3)
    lr, bs, epochs, seed = 0.05, 16, 2, 5
    ref_state, ref_losses = _centralized(model, data, lr, bs, epochs, seed)

    client = copy.deepcopy(model)
    server, send_step, seen = _fake_server(model, k, lr)
    res = train_round(client, k, _weights(client, k), data, TrainSettings(lr, 0.0, 0.0, bs, epochs, seed),
                      TrainContext(RoundClock(None), send_step=send_step))

    assert seen == list(range(steps_per_round(len(data), bs, epochs)))
    assert res.steps == len(seen)
    uploaded = client.portion(0, k).state_dict()  # what the device uploads
    assert list(uploaded) == client.portion_keys(0, k)
    for key, v in uploaded.items():
        torch.testing.assert_close(v, ref_state[key], atol=1e-6, rtol=1e-5, msg=f"client {key}")
    for key, v in server.portion(k, len(server.blocks)).state_dict().items():
        torch.testing.assert_close(v, ref_state[key], atol=1e-6, rtol=1e-5, msg=f"server {key}")
    assert res.train_loss == pytest.approx(sum(ref_losses) / len(ref_losses), rel=1e-5)
    # and training actually moved the client weights
    init = _weights(model, k)
    assert any(not torch.equal(uploaded[key], init[key]) for key in init)


def test_split_learning_through_group_trainer_equals_centralized(model):
    """Same check with the real server-side step (a one-member group)."""
    data = _separable(32, seed=4)
    lr, bs, epochs, seed, k = 0.05, 8, 1, 9, 2
    ref_state, _ = _centralized(model, data, lr, bs, epochs, seed)
    server = copy.deepcopy(model)
    trainer = GroupTrainer(server, k, {kk: v.clone() for kk, v in server.portion(k, 4).state_dict().items()}, lr=lr)

    def send_step(step, fx, labels):
        r = trainer.step([MemberBatch("dev", k, fx, labels)])["dev"]
        return r.dfx, r.loss

    client = copy.deepcopy(model)
    train_round(client, k, _weights(client, k), data, TrainSettings(lr, 0.0, 0.0, bs, epochs, seed),
                TrainContext(RoundClock(None), send_step=send_step))
    merged = {**client.portion(0, k).state_dict(), **trainer.state()}
    assert list(merged) == list(ref_state)
    for key, v in merged.items():
        torch.testing.assert_close(v, ref_state[key], atol=1e-6, rtol=1e-5, msg=key)


class _RecordingCompute:
    """The agent's compute threads (``ComputeThreads``), recording the thread of each section."""

    def __init__(self, threads: int) -> None:
        self.inner = ComputeThreads(threads)
        self.threads: list[str] = []
        self.works: list[float] = []

    def run(self, section, work=0.0):
        self.works.append(work)

        def recorded():
            self.threads.append(threading.current_thread().name)
            return section()
        return self.inner.run(recorded, work)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("split", [False, True])
def test_a_whole_model_round_runs_on_a_compute_thread_and_split_training_on_the_devices_thread(model, split):
    """Without a Main Server the whole local training is one section on a compute thread; split
    training never uses the compute threads (its steps wait for the Main Server in between, and
    the sliding split is decided on their timings); both give bit for bit the weights computed
    on the device's own thread."""
    data = _separable(32, seed=4)
    lr, bs, seed, k = 0.05, 8, 9, 2

    def run(compute):
        client = copy.deepcopy(model)
        if split:
            server = copy.deepcopy(model)
            trainer = GroupTrainer(server, k, {kk: v.clone() for kk, v in server.portion(k, 4).state_dict().items()}, lr=lr)

            def send_step(step, fx, labels):
                r = trainer.step([MemberBatch("dev", k, fx, labels)])["dev"]
                return r.dfx, r.loss
        else:
            send_step = None
        blocks = k if split else len(client.blocks)
        result = train_round(client, blocks, _weights(client, blocks), data, TrainSettings(lr, 0.9, 0.0, bs, 1, seed),
                             TrainContext(RoundClock(None), send_step=send_step, compute=compute))
        return client.portion(0, blocks).state_dict(), result

    compute = _RecordingCompute(1)
    on_threads, result = run(compute)
    compute.close()
    inline, inline_result = run(None)
    assert result.steps == 4
    assert compute.threads == ([] if split else ["compute-0"]), compute.threads
    assert result.train_loss == inline_result.train_loss
    for key, value in on_threads.items():
        assert torch.equal(value, inline[key]), key


@pytest.mark.parametrize("kind, stretch", [(None, 1.0), ("high", 2.5), ("low", 10.0)])
def test_a_whole_model_round_queues_as_its_samples_times_its_emulated_stretch(model, kind, stretch):
    """The compute threads take the largest round first: its size is the samples it trains on
    (times epochs) times an emulated kind's stretch, which the device sleeps afterwards, so a Low
    device's round, the longest, starts before a High one's of the same shard."""
    data = _separable(32, seed=4)
    compute = _RecordingCompute(1)
    client = copy.deepcopy(model)
    blocks = len(client.blocks)
    clock = RoundClock(parse_kind(kind) if kind else None, time_scale=1e6)
    train_round(client, blocks, _weights(client, blocks), data, TrainSettings(0.05, 0.0, 0.0, 8, 2, 0),
                TrainContext(clock, compute=compute))
    compute.close()
    assert compute.works == [pytest.approx(len(data) * 2 * stretch)]


def test_a_section_that_fails_on_a_compute_thread_raises_in_the_device_thread(model):
    """A deadline passed during a whole-model round (``TaskExpired``) reaches the device's thread,
    and the compute thread is free again for the next section."""
    compute = ComputeThreads(1)
    data = _separable(32, seed=4)
    client = copy.deepcopy(model)
    blocks = len(client.blocks)
    with pytest.raises(TaskExpired):
        train_round(client, blocks, _weights(client, blocks), data, TrainSettings(0.05, 0.0, 0.0, 8, 1, 0),
                    TrainContext(RoundClock(None), deadline=time.monotonic() - 1, compute=compute))
    result = train_round(client, blocks, _weights(client, blocks), data, TrainSettings(0.05, 0.0, 0.0, 8, 1, 0),
                         TrainContext(RoundClock(None), compute=compute))
    assert result.steps == 4
    compute.close()


def test_half_precision_sends_float16(model):
    data = _separable(16, seed=2)
    _, send_step, _ = _fake_server(model, 2, 0.05)
    dtypes = []

    def wrapped(step, fx, labels):
        dtypes.append(fx.dtype)
        dfx, loss = send_step(step, fx.float(), labels)
        return dfx.half(), loss

    client = copy.deepcopy(model)
    train_round(client, 2, _weights(client, 2), data, TrainSettings(0.05, 0.0, 0.0, 8, 1, 0, half_precision=True),
                TrainContext(RoundClock(None), send_step=wrapped))
    assert dtypes == [torch.float16, torch.float16]
    uploaded = client.portion(0, 2).state_dict()
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in uploaded.values())


@pytest.mark.parametrize("half", [False, True])
def test_split_round_on_an_explicit_cpu_device_is_bit_identical_to_the_default(model, half):
    """``--torch-device cpu`` changes nothing: the agent's model materialised the way a device
    does it (meta layout, ``to_empty(device=torch.device("cpu"))``) and a Main Server group on
    ``device=torch.device("cpu")`` give exactly today's weights and losses; what goes on the
    wire is on the CPU, in float16 when asked."""
    data = _separable(24, seed=5)
    k, lr, bs, seed = 2, 0.05, 8, 3

    def run(device: torch.device | None):
        server = copy.deepcopy(model)
        trainer = GroupTrainer(server, k, {kk: v.clone() for kk, v in server.portion(k, 4).state_dict().items()},
                               lr=lr, momentum=0.9, device=device)
        sent = []

        def send_step(step, fx, labels):
            sent.append((fx.device, fx.dtype, labels.device))
            r = trainer.step([MemberBatch("dev", k, fx, labels)])["dev"]
            return r.dfx, r.loss

        if device is None:
            client = copy.deepcopy(model)
        else:
            with torch.device("meta"):
                client = build_model("cnn", num_classes=2, input_shape=SHAPE, seed=0)
            client.portion(0, k).to_empty(device=device)
        settings = TrainSettings(lr, 0.9, 1e-4, bs, 2, seed, half_precision=half)
        result = train_round(client, k, _weights(model, k), data, settings,
                             TrainContext(RoundClock(None), send_step=send_step))
        return {**client.portion(0, k).state_dict(), **trainer.state()}, result, sent

    default_state, default_result, _ = run(None)
    cpu_state, cpu_result, sent = run(torch.device("cpu"))
    assert list(cpu_state) == list(default_state)
    for key, value in cpu_state.items():
        assert value.device.type == "cpu" and torch.equal(value, default_state[key]), key
    assert (cpu_result.steps, cpu_result.train_loss) == (default_result.steps, default_result.train_loss)
    wire_dtype = torch.float16 if half else torch.float32
    assert sent == [(torch.device("cpu"), wire_dtype, torch.device("cpu"))] * cpu_result.steps


# ------------------------------------------------------------------------------------ RoundClock
class _FakeTime:
    """Stands in for ``time`` in device_agent.timing: sleeping advances a virtual clock, so the
    clock's arithmetic is checked exactly, whatever the load on the machine."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 5.0   # the calling thread's CPU time (time.thread_time)
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.cpu

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch) -> _FakeTime:
    fake = _FakeTime()
    monkeypatch.setattr("device_agent.timing.time", fake)
    return fake


def _timed_section(clock: RoundClock, fake: _FakeTime, seconds: float) -> None:
    """A compute section that takes ``seconds`` of (virtual) measured time."""
    with clock.compute():
        fake.now += seconds


@pytest.mark.parametrize("kind", ["low", "mid-high", "high-low"])
def test_round_clock_stretches_compute(kind, fake_time):
    emulated = parse_kind(kind)
    stretch = emulated.compute_stretch
    assert stretch > 1.0
    clock = RoundClock(emulated)
    _timed_section(clock, fake_time, 0.02)
    assert clock.compute_s == pytest.approx(0.02 * stretch)
    assert fake_time.slept == [pytest.approx(0.02 * (stretch - 1))]  # the stretch is really slept
    assert clock.total() == pytest.approx(clock.compute_s)


def test_round_clock_low_is_four_times_high(fake_time):
    low, high = RoundClock(parse_kind("low")), RoundClock(parse_kind("high"))
    _timed_section(low, fake_time, 0.02)
    _timed_section(high, fake_time, 0.02)
    assert low.compute_s / high.compute_s == pytest.approx(4.0)


def test_round_clock_real_device_does_not_stretch(fake_time):
    clock = RoundClock(None)
    _timed_section(clock, fake_time, 0.03)
    _timed_section(clock, fake_time, 0.03)
    assert clock.compute_s == pytest.approx(0.06) and fake_time.slept == []


def test_round_clock_cpu_time_stretches_the_work_not_the_wait(fake_time):
    """With ``cpu_time`` the stretch multiplies the section's CPU time: 0.01 s of work that took
    0.03 s of wall time (waiting for a core behind other devices) sleeps 9 x 0.01 s on a Low
    device, and the wall time is counted once."""
    low = parse_kind("low")
    clock = RoundClock(low, cpu_time=True)
    with clock.compute():
        fake_time.now += 0.03
        fake_time.cpu += 0.01
    assert fake_time.slept == [pytest.approx(0.01 * (low.compute_stretch - 1))]
    assert clock.compute_s == pytest.approx(0.03 + 0.01 * (low.compute_stretch - 1))
    wall = RoundClock(low)   # the default: wall time, as on a GPU or with several torch threads
    with wall.compute():
        fake_time.now += 0.03
        fake_time.cpu += 0.01
    assert fake_time.slept[-1] == pytest.approx(0.03 * (low.compute_stretch - 1))


def test_round_clock_cpu_time_measures_this_thread_for_real():
    """Unfaked: a section that only sleeps does no work, so a CPU-time clock adds (almost) no
    stretch, while a busy section is stretched by its CPU time."""
    low = parse_kind("low")
    clock = RoundClock(low, cpu_time=True)
    t0 = time.monotonic()
    with clock.compute():
        time.sleep(0.05)
    assert time.monotonic() - t0 < 0.05 * low.compute_stretch / 2
    clock = RoundClock(low, cpu_time=True)
    with clock.compute():
        cpu0 = time.thread_time()
        while time.thread_time() - cpu0 < 0.01:
            pass
    assert clock.compute_s >= 0.01 * low.compute_stretch * 0.98


def test_round_clock_stretch_sleeps_for_real():
    """One real (unfaked) section: the emulated stretch is an actual sleep, not just arithmetic."""
    clock = RoundClock(parse_kind("low"))
    t0 = time.monotonic()
    with clock.compute():
        time.sleep(0.01)
    assert time.monotonic() - t0 >= 0.01 * parse_kind("low").compute_stretch * 0.98


def test_round_clock_transfer_adds_emulated_delay():
    clock = RoundClock(parse_kind("mid-low"), time_scale=100.0)
    t0 = time.monotonic()
    clock.transfer(500_000, measured_s=0.01)  # 500 kB at 1 MB/s compressed 100x: 5 ms
    wall = time.monotonic() - t0
    assert clock.transfer_s == pytest.approx(0.01 + 500_000 / (1e6 * 100))
    assert wall >= 0.0049
    clock.transfer(0, measured_s=-1.0)  # negative measurement is clamped
    assert clock.transfer_s == pytest.approx(0.015)
    clock.transfer(200_000)
    assert clock.transfer_s == pytest.approx(0.015 + 200_000 / (1e6 * 100))


def test_round_clock_transfer_without_kind_is_measured_only():
    clock = RoundClock(None, time_scale=0.001)
    clock.transfer(10**9, measured_s=0.25)
    assert clock.transfer_s == 0.25


def test_round_clock_server_time_and_total():
    clock = RoundClock(None)
    clock.server_time(0.5, 0.25)
    clock.server_time(-1.0, -1.0)
    assert clock.wait_s == 0.5 and clock.server_s == 0.25
    assert clock.total() >= 0.0
