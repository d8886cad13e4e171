"""Bad input against the real Fed Server and Main Server processes.

Every malformed, oversized, out-of-order or inconsistent request must get a clear 4xx (JSON
``{"detail": ...}``) and must change nothing: the servers' ``/v1/status`` is checked after each
batch of rejected requests, and the Main Server then trains a valid step, which proves the
rejected steps left the group's barrier untouched. The refusals that change something are a
member's next step whose tensors do not decode or do not fit the group's batch, and one whose
values are harmful (NaN activations here): each drops its sender from the group, and the waiting
member's step trains without it at once.
"""
from __future__ import annotations

import math
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from fed_server.settings import FedServerSettings
from fed_server.update_checks import shard_sizes
from integration_support import make_plan, server_pair, small_config
from shared.models import build_model
from shared.models.zoo import ZOO_BUILDERS
from shared.schemas import (
    DeviceProfileMsg, DeviceTimings, JoinRequest, Participant, RegisterRequest, RoundPlan, ServerPortionUpload,
    StepRequest, UpdateRequest, WireTensor,
)
from shared.config import TrainConfig
from shared.wire import encode_state, encode_tensor, packb, unpackb
from testbed.processes import free_port

HEADERS = {"content-type": "application/msgpack", "accept": "application/msgpack"}
NUM_CLASSES = 10
BATCH = 8
FX_SHAPE = [BATCH, 32, 14, 14]  # activations of the cnn after block 1 on 1x28x28 inputs


# --- the services -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def services():
    """A Fed Server waiting for 2 devices (so it stays quiet) and a Main Server with a 1 MiB step limit
    whose group uploads go to a closed port."""
    # The tests register dev-0 again and again: no re-registration limit here (its own tests set one).
    config = small_config(algorithm="s2fl", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200,
                                                         "deadlines.reregistration_s": 0.0})
    assert config.data == SPEC
    with server_pair(config, "bad-input", fed_args=["--run-id", "badinput"], main_args=["--max-step-mb", "1"],
                     main_reports_to=f"http://127.0.0.1:{free_port()}") as pair:
        yield {"fed": pair.fed_url, "main": pair.main_url, "run_id": "badinput"}


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=30.0, headers=HEADERS) as c:
        yield c


# --- helpers --------------------------------------------------------------------------------------

def post(client: httpx.Client, url: str, body) -> httpx.Response:
    """POST a message (a schema object or a plain dict, packed) or raw bytes."""
    if hasattr(body, "model_dump"):
        body = body.model_dump()
    content = body if isinstance(body, (bytes, bytearray)) else packb(body)
    return client.post(url, content=content)


def assert_rejected(resp: httpx.Response, status: int, *words: str) -> str:
    """``resp`` is the error ``status`` with a JSON detail that mentions every one of ``words``."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and detail.strip(), resp.text
    for word in words:
        assert word.lower() in detail.lower(), (word, detail)
    return detail


def fed_status(client: httpx.Client, services) -> dict:
    resp = client.get(f"{services['fed']}/v1/status")
    assert resp.status_code == 200, resp.text
    return resp.json()


def fed_state(client: httpx.Client, services) -> tuple:
    s = fed_status(client, services)
    return s["registered"], s["open_round"], s["rounds_done"], s["state"], s["history"], s["driver_error"]


def main_status(client: httpx.Client, services) -> dict | None:
    resp = client.get(f"{services['main']}/v1/status")
    assert resp.status_code == 200, resp.text
    return resp.json()["round"]


def profile() -> DeviceProfileMsg:
    return DeviceProfileMsg(kind="high", flops=1e10, rate=1e7)


#: The services' data spec, whose shard sizes a registration must claim (the Fed Server checks them).
SPEC = small_config(algorithm="s2fl", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200}).data


def shard_samples(shard: int) -> int:
    sizes = shard_sizes(SPEC)
    assert sizes is not None
    return sizes[shard]


def register_request(device_id: str = "dev-0", shard: int = 0) -> RegisterRequest:
    return RegisterRequest(device_id=device_id, shard=shard, num_samples=shard_samples(shard), profile=profile())


def wire(t: torch.Tensor) -> WireTensor:
    return WireTensor(**encode_tensor(t))


# --- Fed Server -----------------------------------------------------------------------------------

def test_fed_register_rejects_bad_bodies(services, client):
    url = f"{services['fed']}/v1/devices/register"
    before = fed_state(client, services)
    assert before[0] == 0 and before[1] is None and before[3] == "waiting_for_devices"
    good = register_request().model_dump()

    assert_rejected(post(client, url, b"\xc1\x00\x01"), 400, "msgpack")
    assert_rejected(post(client, url, b"\x92\x01"), 400, "msgpack")          # truncated array
    assert_rejected(post(client, url, packb(good) + b"\x00"), 400, "msgpack")  # trailing bytes
    assert_rejected(post(client, url, b"\x81\x01\x02"), 400, "msgpack")      # int map key
    assert_rejected(post(client, url, b""), 400, "empty")
    assert_rejected(post(client, url, packb([1, 2, 3])), 422, "RegisterRequest")
    assert_rejected(post(client, url, {k: v for k, v in good.items() if k != "shard"}), 422, "shard")
    assert_rejected(post(client, url, {**good, "admin": True}), 422, "admin")
    assert_rejected(post(client, url, {**good, "device_id": "../etc/passwd"}), 422, "device_id")
    assert_rejected(post(client, url, {**good, "device_id": ""}), 422, "device_id")
    assert_rejected(post(client, url, {**good, "shard": -1}), 422, "shard")
    assert_rejected(post(client, url, {**good, "shard": "zero"}), 422, "shard")
    assert_rejected(post(client, url, {**good, "num_samples": -5}), 422, "num_samples")
    assert_rejected(post(client, url, {**good, "profile": {**good["profile"], "flops": math.inf}}), 422, "flops")
    assert_rejected(post(client, url, {**good, "profile": {**good["profile"], "rate": 0.0}}), 422, "rate")
    assert_rejected(post(client, url, {**good, "shard": 2}), 422, "shard 2")   # num_devices is 2
    assert_rejected(post(client, url, {**good, "shard": 2**62}), 422, "shard")
    padded = {**good, "profile": {**good["profile"], "kind": "x" * (FedServerSettings().max_register_bytes + 1)}}
    assert_rejected(post(client, url, padded), 413, "limit")

    def chunks():  # no content-length: the limit must hold while streaming too
        for _ in range(FedServerSettings().max_register_bytes // 1024 + 16):
            yield b"\x00" * 1024

    assert_rejected(client.post(url, content=chunks()), 413, "limit")
    assert fed_state(client, services) == before


def test_fed_unknown_device_task(services, client):
    before = fed_state(client, services)
    assert_rejected(client.get(f"{services['fed']}/v1/devices/unknown-dev/task"), 404, "unknown-dev")
    assert fed_state(client, services) == before


def test_fed_register_then_shard_conflict(services, client):
    url = f"{services['fed']}/v1/devices/register"
    resp = post(client, url, register_request("dev-0", 0))
    assert resp.status_code == 200, resp.text
    answer = unpackb(resp.content)
    assert answer["device_id"] == "dev-0" and answer["shard"] == 0 and answer["run_id"] == services["run_id"]
    before = fed_state(client, services)
    assert before[0] == 1 and before[1] is None

    assert_rejected(post(client, url, register_request("dev-1", 0)), 409, "shard 0", "dev-0")
    assert fed_state(client, services) == before
    # The registered device polls and is told to wait: no round runs with 1 of 2 devices.
    resp = client.get(f"{services['fed']}/v1/devices/dev-0/task")
    assert resp.status_code == 200 and unpackb(resp.content)["status"] == "wait"
    # Weights no task names (or no longer does): 404, whatever the id looks like.
    for weights_id in ("0" * 32, "not-an-id"):
        assert_rejected(client.get(f"{services['fed']}/v1/devices/dev-0/weights/{weights_id}"), 404, "not served")
    for wait_s in ("-1", "31", "nan", "soon"):   # a long-poll of at most 30 s
        assert_rejected(client.get(f"{services['fed']}/v1/devices/dev-0/task", params={"wait_s": wait_s}), 422, "wait_s")
    # A long-poll with nothing to do is held for its wait, then told to wait.
    started = time.monotonic()
    resp = client.get(f"{services['fed']}/v1/devices/dev-0/task", params={"wait_s": "0.3"})
    assert resp.status_code == 200 and unpackb(resp.content)["status"] == "wait"
    assert time.monotonic() - started >= 0.3
    assert fed_state(client, services) == before


def _update(round_id: int = 1, device_id: str = "dev-0", weights=None) -> dict:
    model = build_model("cnn")
    state = weights if weights is not None else model.portion(0, 1).state_dict()
    return UpdateRequest(
        device_id=device_id, round_id=round_id, num_samples=shard_samples(0), steps=3, train_loss=1.5,
        weights=encode_state(state),
        timings=DeviceTimings(compute_s=1.0, transfer_s=0.1, wait_s=0.2, server_s=0.3, total_s=1.6),
        bytes_up=10, bytes_down=10,
    ).model_dump()


def test_fed_updates_and_portions_rejected(services, client):
    fed = services["fed"]
    post(client, f"{fed}/v1/devices/register", register_request("dev-0", 0)).raise_for_status()  # idempotent
    before = fed_state(client, services)
    assert before[0] == 1 and before[1] is None and before[2] == 0

    good = _update()
    assert_rejected(post(client, f"{fed}/v1/rounds/1/updates", good), 409, "not open")
    assert_rejected(post(client, f"{fed}/v1/rounds/0/updates", _update(round_id=0)), 409, "not open")
    assert_rejected(post(client, f"{fed}/v1/rounds/2/updates", good), 422, "round_id")   # path 2, body 1
    assert_rejected(post(client, f"{fed}/v1/rounds/1/updates", _update(device_id="ghost")), 404, "ghost")
    assert_rejected(post(client, f"{fed}/v1/rounds/1/updates", {**good, "train_loss": math.nan}), 422, "train_loss")
    assert_rejected(post(client, f"{fed}/v1/rounds/1/updates", {**good, "num_samples": 0}), 422, "num_samples")
    nan_state = build_model("cnn").portion(0, 1).state_dict()
    nan_state = {k: v.clone() for k, v in nan_state.items()}
    next(iter(nan_state.values())).view(-1)[0] = math.nan
    resp = post(client, f"{fed}/v1/rounds/1/updates", _update(weights=nan_state))
    assert 400 <= resp.status_code < 500 and resp.json()["detail"], resp.text  # 409: no round is open
    bad_bytes = {**good, "weights": {k: {**v, "data": v["data"][:-4]} for k, v in good["weights"].items()}}
    assert_rejected(post(client, f"{fed}/v1/rounds/1/updates", bad_bytes), 422, "bytes")
    # FastAPI's own path check, answered with a string detail like every other refusal (docs/api.md).
    assert_rejected(post(client, f"{fed}/v1/rounds/abc/updates", good), 422, "round_id")
    assert fed_state(client, services) == before

    portion = ServerPortionUpload(
        run_id="someone-else", round_id=1, group_id=0, members=["dev-0"], dropped=[], start_block=1,
        weights=encode_state(build_model("cnn").portion(1, 4).state_dict()), label_distance=0.1, steps=1,
        train_time_s=0.5,
    ).model_dump()
    assert_rejected(post(client, f"{fed}/v1/rounds/1/server-portions", portion), 409, "someone-else")
    right_run = {**portion, "run_id": services["run_id"]}
    assert_rejected(post(client, f"{fed}/v1/rounds/1/server-portions", right_run), 409, "not open")
    assert_rejected(post(client, f"{fed}/v1/rounds/1/server-portions", {**right_run, "group_id": -1}), 422, "group_id")
    assert fed_state(client, services) == before


# --- Main Server ----------------------------------------------------------------------------------

def test_main_rejects_bad_plans(services, client):
    url = f"{services['main']}/v1/rounds"
    before = main_status(client, services)
    good = make_plan()
    weights = good["server_weights"]
    key = next(iter(weights))
    wrong_shape = {**weights, key: encode_tensor(torch.zeros(3, 3))}
    assert_rejected(post(client, url, make_plan(server_weights=wrong_shape)), 422, "server_weights", key)
    missing = {k: v for k, v in weights.items() if k != key}
    assert_rejected(post(client, url, make_plan(server_weights=missing)), 422, "server_weights", "missing")
    as_f64 = {**weights, key: encode_tensor(torch.zeros(tuple(weights[key]["shape"]), dtype=torch.float64))}
    assert_rejected(post(client, url, make_plan(server_weights=as_f64)), 422, "float64")
    nan_w = torch.zeros(tuple(weights[key]["shape"]))
    nan_w.view(-1)[3] = math.nan
    assert_rejected(post(client, url, make_plan(server_weights={**weights, key: encode_tensor(nan_w)})), 422, "NaN")
    deep = [{"device_id": "dev-a", "split_point": 4, "num_samples": 5},
            {"device_id": "dev-b", "split_point": 1, "num_samples": 5}]
    assert_rejected(post(client, url, make_plan(participants=deep)), 422, "split point 4")
    dupes = [{"device_id": "dev-a", "split_point": 1, "num_samples": 5}] * 2
    assert_rejected(post(client, url, make_plan(participants=dupes)), 422, "distinct")
    assert_rejected(post(client, url, make_plan(participants=[])), 422, "participants")
    assert_rejected(post(client, url, make_plan(grouping="psychic")), 422, "grouping")
    assert_rejected(post(client, url, make_plan(join_deadline_s=0)), 422, "join_deadline_s")
    assert_rejected(post(client, url, make_plan(model="no-such-model")), 422, "no-such-model")
    assert_rejected(post(client, url, make_plan(input_shape=[1, 28])), 422, "input_shape")
    assert_rejected(post(client, url, make_plan(num_classes=0)), 422, "num_classes")
    assert_rejected(post(client, url, make_plan(num_classes=7)), 422, "server_weights")  # head has 10 outputs
    # Weights that match a 1x2x2 input, which the cnn's pooling cannot take: refused, not a 500.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Initializing zero-element tensors is a no-op"
        # The zoo's builder itself: build_model refuses this model (its blocks do not chain).
        tiny = encode_state(ZOO_BUILDERS["cnn"](NUM_CLASSES, (1, 2, 2)).portion(1, 4).state_dict())
    assert_rejected(post(client, url, make_plan(input_shape=[1, 2, 2], server_weights=tiny)), 422, "input_shape")
    assert main_status(client, services) == before


def join(client: httpx.Client, services, device_id: str, round_id: int = 1, **changes) -> httpx.Response:
    body = JoinRequest(device_id=device_id, label_counts=[5] * NUM_CLASSES, num_steps=2).model_dump()
    body.update(changes)
    return post(client, f"{services['main']}/v1/rounds/{round_id}/join", body)


@pytest.fixture(scope="module")
def main_round(services, client):
    """Round 1 open at the Main Server and dev-a, dev-b joined (one group of two)."""
    resp = post(client, f"{services['main']}/v1/rounds", make_plan())
    assert resp.status_code == 200, resp.text
    assert unpackb(resp.content)["ok"] is True
    status = main_status(client, services)
    assert status["round_id"] == 1 and status["joined"] == 0 and status["groups"] == []

    assert_rejected(join(client, services, "dev-zzz"), 404, "dev-zzz")
    assert_rejected(join(client, services, "dev-a", label_counts=[1, 2, 3]), 422, "label_counts")
    assert_rejected(join(client, services, "dev-a", label_counts=[0] * NUM_CLASSES), 422, "label_counts")
    assert_rejected(join(client, services, "dev-a", label_counts=[-1] + [5] * 9), 422, "label_counts")
    assert_rejected(join(client, services, "dev-a", num_steps=0), 422, "num_steps")
    assert_rejected(join(client, services, "dev-a", round_id=99), 409, "99")
    assert_rejected(post(client, f"{services['main']}/v1/rounds/1/join", b"\xc1"), 400, "msgpack")
    assert main_status(client, services) == status   # nobody joined

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda d: join(client, services, d), ["dev-a", "dev-b"]))
    for resp in answers:
        assert resp.status_code == 200, resp.text
    groups = [unpackb(r.content) for r in answers]
    assert groups[0]["group_id"] == groups[1]["group_id"] == 0
    assert sorted(groups[0]["members"]) == ["dev-a", "dev-b"]
    status = main_status(client, services)
    assert status["joined"] == 2 and len(status["groups"]) == 1
    return status


def step_body(device_id: str = "dev-a", step: int = 0, fx: torch.Tensor | None = None,
              labels: torch.Tensor | None = None) -> dict:
    fx = torch.randn(*FX_SHAPE) if fx is None else fx
    labels = torch.arange(fx.shape[0] if fx.dim() else 1, dtype=torch.int64) % NUM_CLASSES if labels is None else labels
    return StepRequest(device_id=device_id, step=step, fx=wire(fx), labels=wire(labels)).model_dump()


def test_main_plan_rejected_while_round_open(services, client, main_round):
    before = main_status(client, services)
    url = f"{services['main']}/v1/rounds"
    bad = make_plan(round_id=2, participants=[{"device_id": "dev-a", "split_point": 9, "num_samples": 5}])
    assert_rejected(post(client, url, bad), 422, "split point 9")
    assert_rejected(post(client, url, make_plan(round_id=0)), 409, "older")
    assert main_status(client, services) == before
    # The round is still usable: a joined device asking again gets its group back.
    resp = join(client, services, "dev-a")
    assert resp.status_code == 200 and unpackb(resp.content)["group_id"] == 0


def test_main_rejects_bad_steps_then_trains(services, client, main_round):
    main = services["main"]
    url = f"{main}/v1/rounds/1/step"
    before = main_status(client, services)
    assert before["groups"][0]["step"] == 0 and before["groups"][0]["dropped"] == []

    good = step_body()
    assert_rejected(post(client, url, b"\xc1garbage"), 400, "msgpack")
    assert_rejected(post(client, url, b""), 400, "empty")
    assert_rejected(post(client, url, {k: v for k, v in good.items() if k != "labels"}), 422, "labels")
    # Tensors the body's schema refuses: not a step at all, so nobody's.
    assert_rejected(post(client, url, {**good, "fx": {**good["fx"], "data": good["fx"]["data"][:-1]}}), 422, "fx")
    assert_rejected(post(client, url, {**good, "fx": {**good["fx"], "dtype": "complex64"}}), 422, "complex64")
    assert_rejected(post(client, url, {**good, "fx": {**good["fx"], "shape": [1] * 9}}), 422, "shape")
    # A step that does not fit, sent out of order: refused for its order, its content never read.
    misfit, _ = misfit_steps(good)[0]
    assert_rejected(post(client, url, {**misfit, "step": 3}), 409, "step 3", "step 0")
    assert_rejected(post(client, url, step_body(step=3)), 409, "step 3", "step 0")
    assert_rejected(post(client, url, {**good, "step": -1}), 422, "step")
    assert_rejected(post(client, url, step_body(device_id="dev-zzz")), 404, "dev-zzz")
    assert_rejected(post(client, url, {**good, "device_id": "dev a"}), 422, "device_id")
    assert_rejected(post(client, f"{main}/v1/rounds/99/step", good), 409, "99")
    assert_rejected(post(client, f"{main}/v1/rounds/0/step", good), 409, "stale")
    huge = step_body(fx=torch.randn(48, 32, 14, 14), labels=torch.zeros(48, dtype=torch.int64))
    assert len(packb(huge)) > 1 << 20
    assert_rejected(post(client, url, huge), 413, "limit")
    huge_bytes = packb(huge)

    def chunks():  # chunked, no content-length
        for i in range(0, len(huge_bytes), 64 << 10):
            yield huge_bytes[i:i + (64 << 10)]

    assert_rejected(client.post(url, content=chunks()), 413, "limit")

    # Nothing changed: still step 0, nobody dropped, done or pending.
    after = main_status(client, services)
    assert after == before
    group = after["groups"][0]
    assert group["step"] == 0 and group["dropped"] == [] and group["done"] == [] and not group["finished"]

    # dev-a's valid step waits at the barrier; a duplicate meanwhile is refused; dev-b's step with
    # NaN activations is refused and drops dev-b, which releases dev-a's step, trained without it.
    fx_a, fx_b = torch.randn(*FX_SHAPE), torch.randn(*FX_SHAPE)
    nan_fx = torch.randn(*FX_SHAPE)
    nan_fx[3, 2, 1, 0] = math.nan
    labels = torch.arange(BATCH, dtype=torch.int64) % NUM_CLASSES
    results: dict[str, httpx.Response] = {}

    def send(device_id: str, fx: torch.Tensor) -> None:
        with httpx.Client(timeout=30.0, headers=HEADERS) as own:
            results[device_id] = post(own, url, step_body(device_id, 0, fx, labels))

    thread_a = threading.Thread(target=send, args=("dev-a", fx_a))
    thread_a.start()
    time.sleep(0.3)
    assert "dev-a" not in results, "dev-a's step must wait for dev-b at the barrier"
    assert_rejected(post(client, url, step_body("dev-a", 0, fx_a, labels)), 409, "already received")
    assert_rejected(post(client, url, step_body("dev-b", 0, nan_fx, labels)), 422, "fx", "nan", "dropped")
    thread_a.join(30)
    resp = results["dev-a"]
    assert resp.status_code == 200, resp.text
    answer = unpackb(resp.content)
    assert answer["dfx"]["shape"] == FX_SHAPE and answer["dfx"]["dtype"] == "float32"
    assert math.isfinite(answer["loss"]) and answer["wait_s"] >= 0
    assert_rejected(post(client, url, step_body("dev-b", 0, fx_b, labels)), 409, "dropped", "nan")

    status = main_status(client, services)
    group = status["groups"][0]
    assert group["step"] == 1 and group["dropped"] == ["dev-b"] and group["done"] == [] and not group["finished"]
    # Step 0 is now behind the group.
    assert_rejected(post(client, url, step_body("dev-a", 0)), 409, "out of order")
    assert main_status(client, services) == status


def misfit_steps(good: dict) -> list[tuple[dict, tuple[str, ...]]]:
    """dev-a's step 0 with tensors that pass the body's schema but do not decode or do not fit the
    group's batch, each with the words its refusal must name."""
    steps = [
        (step_body(fx=torch.randn(BATCH, 5)), ("fx", "shape")),
        (step_body(fx=torch.randn(BATCH, 32, 7, 7)), ("fx", "shape")),
        (step_body(fx=torch.randn(0, 32, 14, 14), labels=torch.zeros(0, dtype=torch.int64)), ("fx",)),
        (step_body(fx=torch.tensor(1.0)), ("fx",)),
        (step_body(fx=torch.ones(*FX_SHAPE, dtype=torch.int64)), ("fx", "int64")),
        (step_body(labels=torch.zeros(BATCH - 1, dtype=torch.int64)), ("labels", "shape")),
        (step_body(labels=torch.zeros(BATCH, dtype=torch.int32)), ("labels", "int64")),
        (step_body(labels=torch.zeros(BATCH, dtype=torch.float32)), ("labels",)),
        (step_body(fx=torch.randn(BATCH + 1, 32, 14, 14), labels=torch.zeros(BATCH + 1, dtype=torch.int64)),
         ("fx", f"B <= {BATCH}")),
    ]
    # Zero elements and zero bytes, but a dimension of 2**63 or more: refused by the decoder, not a 500.
    for dims in ([0, 1 << 63], [1 << 63, 0, 14, 14], [0, (1 << 64) - 1]):
        steps.append(({**good, "fx": {"dtype": "float32", "shape": dims, "data": b""}}, ("fx", "shape")))
        steps.append(({**good, "labels": {"dtype": "int64", "shape": dims, "data": b""}}, ("labels", "shape")))
    return steps


def test_main_drops_the_sender_of_a_step_that_does_not_fit(services, client, main_round):
    """Each such step, in a round of its own (the plan of round 2, 3, ... replaces the open one),
    is refused (422) and drops its sender, which could never send a step that fits and would hold
    the group's barrier until the step deadline; the other member stays, at step 0."""
    main = services["main"]
    for round_id, (bad, words) in enumerate(misfit_steps(step_body()), start=2):
        resp = post(client, f"{main}/v1/rounds", make_plan(round_id=round_id))
        assert resp.status_code == 200, resp.text
        with ThreadPoolExecutor(2) as pool:
            joins = list(pool.map(lambda d: join(client, services, d, round_id=round_id), ["dev-a", "dev-b"]))
        assert all(r.status_code == 200 for r in joins), [r.text for r in joins]
        url = f"{main}/v1/rounds/{round_id}/step"
        assert_rejected(post(client, url, bad), 422, *words, "dropped")
        group = main_status(client, services)["groups"][0]
        assert group["dropped"] == ["dev-a"] and group["step"] == 0 and group["done"] == [], (words, group)
        assert_rejected(post(client, url, step_body()), 409, "dropped")
