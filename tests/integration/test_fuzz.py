"""Fuzz the HTTP API of the real Fed Server and Main Server from their own OpenAPI descriptions.

Schemathesis reads each server's ``/openapi.json`` (the msgpack request bodies are declared there
with the pydantic schemas, see ``http_api.server.msgpack_body_schema``), generates a bounded
number of requests per operation, packs bodies with ``shared.wire.packb`` and sends them to live
server processes. Per operation: ``EXAMPLES`` schema-valid cases, ``EXAMPLES`` schema-violating
ones (where there is anything to violate), and for POSTs ``EXAMPLES`` with any body (raw bytes,
top-level lists and scalars, maps with integer keys). For every request:

* no 5xx (schemathesis's ``not_a_server_error`` check);
* no state change unless the request was a POST that the server accepted (2xx): ``/v1/status``
  is read before and after each request. GETs and rejected requests must change nothing.

Afterwards both processes must still be running and healthy, and the Fed Server's round driver
must not have failed.

The Main Server is fuzzed with no round open: a random plan cannot carry weights that match the
model, so every plan, join and step is rejected and its status must stay ``None``. The Fed Server
waits for 2 devices. Its register operation is fuzzed last because a generated *valid* register
for a free shard is rightly accepted; once both shards are taken the round driver starts on its own,
so from then on a rejected register is only checked not to change the number of registered devices.

Harmful values in otherwise valid bodies (``test_harmful_values_*``): the shapes schema-driven
generation is unlikely to hit, each of which once got through to a crash or a 500: tensors with
zero elements but a dimension of 2**63 or more, timings of 1e308 (finite, but their sum is not),
sample counts of 10**12 and beyond, label counts past int64, NaN and infinities. The Fed Server
gets them with no round open (the run-level effects are ``test_robustness.py``'s); the Main
Server gets them with a round open and both devices joined, so they reach the tensor decoder and
the step checks, and its "server-side training failed" answer (a 500) cannot be reached by a body.
A step refused by those checks drops its sender (and nothing else changes); the round is then
opened again, so every example meets the checks with both devices in the group.

``SFL_FUZZ_EXAMPLES`` overrides ``EXAMPLES`` (default 25);
generation is derandomized, so a run is reproducible (set ``SFL_FUZZ_RANDOM=1`` to explore).
"""
from __future__ import annotations

import collections
import math
import os
import threading
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("hypothesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.transport.serialization import Binary  # noqa: E402

from integration_support import server_pair, small_config  # noqa: E402
from shared.models import build_model  # noqa: E402
from shared.schemas import MAX_LABEL_COUNT, MAX_REGISTRATION_BATCH  # noqa: E402
from shared.wire import MAX_ELEMENTS, encode_state, packb, unpackb  # noqa: E402
from test_bad_input import HEADERS, NUM_CLASSES, make_plan, step_body  # noqa: E402
from test_bad_input import _update as update_body  # noqa: E402
from testbed.processes import free_port  # noqa: E402

MSGPACK = "application/msgpack"
EXAMPLES = int(os.environ.get("SFL_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("SFL_FUZZ_RANDOM", "") not in ("", "0")
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


# --- msgpack bodies -------------------------------------------------------------------------------

class Raw(bytes):
    """A body sent as it is, not packed (bytes that need not be msgpack at all)."""


def _wire_value(value):
    """A generated body as plain msgpack-able data: ``format: binary`` strings become bytes, and
    integers beyond msgpack's 64 bits become floats (they cannot be sent as msgpack integers)."""
    if isinstance(value, Binary):
        return value.data
    if isinstance(value, dict):
        return {k: _wire_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wire_value(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
        return float(value)
    return value


@schemathesis.serializer(MSGPACK)
def _msgpack(ctx, value) -> bytes:
    return bytes(value) if isinstance(value, Raw) else packb(_wire_value(value))


# Bodies the schema-driven generation rarely produces: raw bytes, any msgpack value at the top level
# (lists, scalars, maps with integer keys, nested bytes).
_SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
            | st.text(max_size=16) | st.binary(max_size=16))
ANY_BODY = st.one_of(
    st.binary(max_size=128).map(Raw),
    st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                 | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4),
                 max_leaves=12).map(lambda value: Raw(packb(value))),   # packed here: not JSON (int keys, bytes)
)


# Harmful values: well-formed (right types, often schema-valid), chosen to break arithmetic and
# array conversions downstream.
HUGE_INTS = st.sampled_from([1 << 63, (1 << 64) - 1, 10**12, (1 << 63) - 1]) | st.integers(1 << 40, (1 << 64) - 1)
HARMFUL_FLOATS = st.sampled_from([1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324, -0.0, 3.4e38])
HARMFUL_NUMBERS = HUGE_INTS | HARMFUL_FLOATS | st.sampled_from([-1, -(1 << 63), 0])


@st.composite
def zero_element_huge_dims(draw, dtype: str = "float32") -> dict:
    """A tensor with no elements (so no bytes) but one dimension beyond the decoder's limit."""
    rank = draw(st.integers(2, 4))
    dims = draw(st.lists(st.integers(0, 16), min_size=rank, max_size=rank))
    zero, huge = draw(st.permutations(range(rank)))[:2]
    dims[zero] = 0
    dims[huge] = draw(st.integers(MAX_ELEMENTS + 1, (1 << 64) - 1))
    return {"dtype": dtype, "shape": dims, "data": b""}


def leaf_paths(body, prefix: tuple = ()) -> list[tuple]:
    """Paths to the scalar leaves of a body and to its tensors (a tensor counts as one leaf)."""
    if isinstance(body, dict) and set(body) == {"dtype", "shape", "data"}:
        return [prefix]
    if isinstance(body, dict):
        return [p for k, v in body.items() for p in leaf_paths(v, prefix + (k,))]
    if isinstance(body, list) and body:
        return [p for i, v in enumerate(body) for p in leaf_paths(v, prefix + (i,))]
    return [prefix]


def replaced(body, path: tuple, value):
    """A copy of ``body`` with the leaf at ``path`` replaced."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(body, list):
        return [replaced(v, rest, value) if i == head else v for i, v in enumerate(body)]
    return {k: replaced(v, rest, value) if k == head else v for k, v in body.items()}


@st.composite
def harmful_variant(draw, body: dict) -> dict:
    """``body`` with one to three leaves replaced by harmful values (tensors by harmful tensors)."""
    paths = leaf_paths(body)
    for path in draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True)):
        old = body
        for part in path:
            old = old[part]
        tensor = isinstance(old, dict)
        value = draw(zero_element_huge_dims(old["dtype"] if old["dtype"] in ("float32", "int64") else "float32")
                     if tensor else HARMFUL_NUMBERS)
        body = replaced(body, path, value)
    return body


def _settings(examples: int = EXAMPLES):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=not RANDOM,
                    suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))


# --- the services ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def services():
    """A Fed Server waiting for 2 devices and a Main Server that reports to it."""
    config = small_config(algorithm="s2fl", rounds=1, **{
        "data.num_devices": 2, "data.max_samples": 200,
        # Only a successful register may start the run, never the registration deadline.
        "deadlines.registration_s": 3600})
    with server_pair(config, "fuzz", fed_args=["--run-id", "fuzz"]) as pair:
        yield {"fed": pair.fed_url, "main": pair.main_url, "fed_service": pair.fed, "main_service": pair.main}


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=30.0) as c:
        yield c


def fed_state(client: httpx.Client, services) -> dict:
    resp = client.get(f"{services['fed']}/v1/status")
    assert resp.status_code == 200, resp.text
    return resp.json()


def main_state(client: httpx.Client, services):
    resp = client.get(f"{services['main']}/v1/status")
    assert resp.status_code == 200, resp.text
    return resp.json()


def load_schema(base_url: str):
    """The server's own OpenAPI description, checked against the OpenAPI meta-schema."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    schema.validate()
    return schema


def operations(schema) -> list:
    ops = [result.ok() for result in schema.get_all_operations()]
    return sorted(ops, key=lambda op: (op.path, op.method))


def assert_alive(services, client: httpx.Client) -> None:
    for name in ("fed", "main"):
        service = services[f"{name}_service"]
        assert service.alive(), f"{service.name} exited ({service.process.returncode}):\n{service.log_tail(60)}"
        resp = client.get(f"{services[name]}/healthz")
        assert resp.status_code == 200, (name, resp.text)


def fuzz(operation, base_url: str, service, state, seen: collections.Counter, unchanged=None) -> None:
    """Send ``EXAMPLES`` generated requests per generation mode to ``operation``.

    ``state()`` is read around each request; ``unchanged(before, after)`` says whether a rejected
    request (or a GET) left it as it was (default: equal).
    """
    unchanged = unchanged or (lambda before, after: before == after)
    session = requests.Session()

    def one(case) -> None:
        _shorten_status_hold(case)
        before = state()
        response = case.call(base_url=base_url, session=session, timeout=30)
        seen[(operation.label, response.status_code)] += 1
        # The body and the server's traceback first (schemathesis's report shows only a curl line),
        # read before the fixture deletes the log.
        assert response.status_code < 500, (
            f"{operation.label} answered {response.status_code} to the body {case.body!r}"[:3000]
            + f"\n{service.name} log:\n{service.log_tail(60)}")
        case.validate_response(response, checks=[not_a_server_error])
        accepted = operation.method.upper() == "POST" and 200 <= response.status_code < 300
        if not accepted:
            after = state()
            assert unchanged(before, after), (
                f"{operation.label} answered {response.status_code} but changed the state:\n"
                f"before: {before}\nafter:  {after}\nrequest body: {case.body!r}"[:4000])

    strategies = [operation.as_strategy(generation_mode=mode) for mode in MODES]
    if operation.method.upper() == "POST":   # valid path and headers, any body
        strategies.append(st.tuples(strategies[0], ANY_BODY).map(_with_body))
    try:
        for mode, strategy in zip((*MODES, "any-body"), strategies):
            run = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not RANDOM,
                           suppress_health_check=list(HealthCheck),
                           phases=(Phase.explicit, Phase.generate, Phase.shrink))(given(case=strategy)(one))
            try:
                run()
            except Unsatisfiable:
                if mode is GenerationMode.POSITIVE:
                    raise   # negative: nothing to make invalid (no parameters, no body)
    finally:
        session.close()


def _shorten_status_hold(case) -> None:
    """A valid ``wait_s`` of ``GET /v1/status`` holds the answer until a record is written, and one
    of an agent's task request until one of its devices has a task, up to 30 s, which never comes
    here (the Fed Server waits for devices): 10 ms instead, so that the examples do not each wait
    out their hold. Invalid values are sent as generated."""
    held = {"/v1/status": case.query, "/v1/agents/{agent_id}/tasks": case.body}.get(case.operation.path)
    if not isinstance(held, dict) or "wait_s" not in held:
        return
    try:
        wait_s = float(held["wait_s"])
    except (TypeError, ValueError):
        return
    if 0.01 < wait_s <= 30.0:
        held["wait_s"] = 0.01


def _with_body(pair):
    case, body = pair
    case.body = body
    return case


def summary(seen: collections.Counter) -> str:
    per_op: dict[str, dict[int, int]] = collections.defaultdict(dict)
    for (label, status), count in sorted(seen.items()):
        per_op[label][status] = count
    return "\n".join(f"  {label}: {codes}" for label, codes in per_op.items())


# --- the tests ------------------------------------------------------------------------------------

def test_fuzz_main_server(services, client):
    schema = load_schema(services["main"])
    ops = operations(schema)
    posts = {op.path for op in ops if op.method.upper() == "POST"}
    assert posts == {"/v1/rounds", "/v1/rounds/{round_id}/join", "/v1/rounds/{round_id}/step",
                     "/v1/rounds/{round_id}/step/forward", "/v1/rounds/{round_id}/step/backward",
                     "/v1/rounds/{round_id}/departures"}, posts
    for op in ops:
        if op.method.upper() == "POST":
            assert MSGPACK in schema.get_request_payload_content_types(op), op.label
    before = main_state(client, services)
    assert before == {"round": None}
    seen: collections.Counter = collections.Counter()
    for op in ops:
        fuzz(op, services["main"], services["main_service"], lambda: main_state(client, services), seen)
    print(f"\nMain Server, {EXAMPLES} examples per operation and mode (status: count):\n{summary(seen)}")
    assert not any(status >= 500 for _, status in seen)
    # No generated plan can match the model's weights, so no round was opened.
    assert not any(200 <= status < 300 for (label, status) in seen if label.startswith("POST")), summary(seen)
    assert main_state(client, services) == before
    # The bodies reached the schema validation (not only the msgpack / empty-body checks).
    for path in posts:
        assert seen[(f"POST {path}", 422)] > 0, summary(seen)
    assert_alive(services, client)


def test_harmful_values_fed_server(services, client):
    # Runs while the Fed Server still waits for devices: every harmful body must be refused and
    # nothing may change (an accepted register would start the run: register bodies are left to
    # test_fuzz_fed_server, and registration bounds to docs/security.md).
    fed = services["fed"]
    before = fed_state(client, services)
    assert before["registered"] == 0, before
    valid = {
        "/v1/rounds/1/updates": update_body(),
        "/v1/rounds/1/reports": {"device_id": "dev-0", "round_id": 1, "extras": {"d": 0.5, "local_total": 3}},
        "/v1/evaluation": {"device_id": "dev-0", "round_id": 1, "num_samples": 10, "correct": 5, "loss_sum": 3.0},
        "/v1/rounds/1/server-portions": {
            "run_id": "fuzz", "round_id": 1, "group_id": 0, "members": ["dev-0"], "dropped": [], "absent": [],
            "start_block": 1, "weights": encode_state(build_model("cnn").portion(1, 4).state_dict()),
            "label_distance": 0.1, "steps": 1, "train_time_s": 0.5},
    }
    seen: collections.Counter = collections.Counter()
    with httpx.Client(timeout=30.0, headers=HEADERS) as own:
        def fuzz_path(path: str, body: dict) -> None:
            @_settings()
            @given(bad=harmful_variant(body))
            def send(bad):
                resp = own.post(f"{fed}{path}", content=packb(bad))
                seen[(path, resp.status_code)] += 1
                assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text[:500], str(bad)[:1500],
                                                       services["fed_service"].log_tail(40))
                assert resp.json()["detail"], resp.text
                assert fed_state(client, services) == before, (path, str(bad)[:1500])

            send()

        for path, body in valid.items():
            fuzz_path(path, body)
    print(f"\nFed Server, harmful values (path, status): {dict(seen)}")
    assert fed_state(client, services) == before
    assert_alive(services, client)


def test_fuzz_fed_server(services, client):
    schema = load_schema(services["fed"])
    ops = operations(schema)
    posts = {op.path for op in ops if op.method.upper() == "POST"}
    assert posts == {"/v1/devices/register", "/v1/devices/registrations", "/v1/agents/{agent_id}/tasks",
                     "/v1/rounds/{round_id}/updates", "/v1/rounds/{round_id}/reports",
                     "/v1/rounds/{round_id}/server-portions", "/v1/evaluation",
                     "/v1/rounds/{round_id}/withdrawals", "/v1/rounds/{round_id}/secagg/keys",
                     "/v1/rounds/{round_id}/secagg/shares", "/v1/rounds/{round_id}/secagg/unmask",
                     "/v1/rounds/{round_id}/secagg/batch", "/v1/rounds/{round_id}/secagg/{stage}/batch"}, posts
    before = fed_state(client, services)
    assert before["registered"] == 0 and before["state"] == "waiting_for_devices", before
    state = lambda: fed_state(client, services)  # noqa: E731
    seen: collections.Counter = collections.Counter()

    # Everything but registrations and agents' requests: the Fed Server waits for devices, so
    # nothing may change at all.
    registrations = {"/v1/devices/register", "/v1/devices/registrations"}
    agents = {"/v1/agents/{agent_id}/tasks", "/v1/rounds/{round_id}/secagg/batch",
              "/v1/rounds/{round_id}/secagg/{stage}/batch"}
    register = [op for op in ops if op.path in registrations]
    for op in ops:
        if op.path not in registrations and op.path not in agents:
            fuzz(op, services["fed"], services["fed_service"], state, seen)
    assert not any(200 <= status < 300 for (label, status) in seen if label.startswith("POST")), summary(seen)
    assert fed_state(client, services) == before
    # An agent's request may be answered (a session opened, its devices unknown, each device's
    # secure aggregation message or question refused in the answer), and still changes nothing the
    # run shows.
    for op in ops:
        if op.path in agents:
            fuzz(op, services["fed"], services["fed_service"], state, seen)
    assert fed_state(client, services) == before

    def register_unchanged(before: dict, after: dict) -> bool:
        if before["state"] == "waiting_for_devices":
            return after == before   # the driver is idle until a register succeeds
        return after["registered"] == before["registered"]   # the rounds run on their own

    for op in register:
        fuzz(op, services["fed"], services["fed_service"], state, seen, register_unchanged)
    print(f"\nFed Server, {EXAMPLES} examples per operation and mode (status: count):\n{summary(seen)}")
    assert not any(status >= 500 for _, status in seen)
    for path in posts:
        assert seen[(f"POST {path}", 422)] > 0, summary(seen)
    after = fed_state(client, services)
    accepted = sum(count * (MAX_REGISTRATION_BATCH if label.endswith("registrations") else 1)
                   for (label, status), count in seen.items()
                   if label in ("POST /v1/devices/register", "POST /v1/devices/registrations") and 200 <= status < 300)
    assert after["registered"] <= min(accepted, after["expected_devices"])
    if after["registered"] == after["expected_devices"]:
        # Fuzzed devices (odd profiles: tiny flops, zero samples) filled the run: its first round must open.
        deadline = time.monotonic() + 20
        while after["open_round"] is None and after["driver_error"] is None and time.monotonic() < deadline:
            time.sleep(0.1)
            after = fed_state(client, services)
        assert after["open_round"] is not None or after["driver_error"] is not None, after
    assert after["driver_error"] is None, after["driver_error"]
    assert_alive(services, client)


# --- harmful values against a Main Server round -------------------------------------------------

@pytest.fixture(scope="module")
def main_round():
    """A Main Server with round 1 open (the plan of test_bad_input) and dev-a, dev-b joined in one
    group; its group uploads go to a closed port (no Fed Server round to receive them)."""
    config = small_config(algorithm="s2fl", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200})
    with server_pair(config, "fuzz-harm", main_reports_to=f"http://127.0.0.1:{free_port()}") as pair, \
            httpx.Client(timeout=30.0, headers=HEADERS) as own:
        resp = own.post(f"{pair.main_url}/v1/rounds", content=packb(make_plan()))
        assert resp.status_code == 200, resp.text
        yield pair, own


def test_harmful_values_main_server(main_round):
    pair, own = main_round
    main = pair.main_url

    def status():
        resp = own.get(f"{main}/v1/status")
        assert resp.status_code == 200, resp.text
        return resp.json()["round"]

    def refused(path: str, bad: dict) -> None:
        before = status()
        resp = own.post(f"{main}{path}", content=packb(bad))
        assert 400 <= resp.status_code < 500, (path, resp.status_code, resp.text[:500], str(bad)[:1500],
                                               pair.main.log_tail(40))
        assert resp.json()["detail"], resp.text
        assert status() == before, (path, str(bad)[:1500])

    # Joins whose label counts overflow int64 (they used to break grouping for the whole round).
    join = {"device_id": "dev-a", "label_counts": [5] * NUM_CLASSES, "num_steps": 2}
    counts = st.lists(st.integers(0, 100), min_size=NUM_CLASSES, max_size=NUM_CLASSES)

    @_settings()
    @given(device=st.sampled_from(["dev-a", "dev-b"]), counts=counts, where=st.integers(0, NUM_CLASSES - 1),
           huge=st.integers(MAX_LABEL_COUNT + 1, (1 << 64) - 1))
    def harmful_join(device, counts, where, huge):
        counts[where] = huge
        refused("/v1/rounds/1/join", {**join, "device_id": device, "label_counts": counts})

    harmful_join()
    assert status()["joined"] == 0

    round_id = 1

    def join_both() -> None:
        answers: dict[str, httpx.Response] = {}

        def join_one(device: str) -> None:
            with httpx.Client(timeout=30.0, headers=HEADERS) as c:
                answers[device] = c.post(f"{main}/v1/rounds/{round_id}/join", content=packb({**join, "device_id": device}))

        threads = [threading.Thread(target=join_one, args=(d,)) for d in ("dev-a", "dev-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(answers[d].status_code == 200 for d in ("dev-a", "dev-b")), {d: r.text for d, r in answers.items()}
        assert unpackb(answers["dev-a"].content)["members"] == ["dev-a", "dev-b"]

    join_both()

    # Steps: harmful leaves anywhere, zero-element tensors of huge dimensions. Every one is refused
    # before it reaches the barrier or the training. One that passes the body's schema meets the
    # step checks, which drop its sender: then that is the only change, and the round is opened
    # again. (Well-formed steps with NaN/inf activations or labels out of range:
    # tests/integration/test_misbehaving_members.py, tests/unit/main_server/test_group_round.py.)
    good = step_body()

    def refused_step(bad: dict) -> None:
        nonlocal round_id
        before = status()
        resp = own.post(f"{main}/v1/rounds/{round_id}/step", content=packb(bad))
        assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500], str(bad)[:1500], pair.main.log_tail(40))
        assert resp.json()["detail"], resp.text
        after = status()
        if after == before:
            return
        sender = bad["device_id"]
        assert resp.status_code == 422 and "dropped" in resp.json()["detail"], (resp.text, str(bad)[:1500])
        (group,) = before["groups"]
        assert after == {**before, "groups": [{**group, "dropped": [sender]}]}, (after, str(bad)[:1500])
        round_id += 1
        resp = own.post(f"{main}/v1/rounds", content=packb(make_plan(round_id=round_id)))
        assert resp.status_code == 200, resp.text
        join_both()

    @st.composite
    def harmful_step(draw):
        kind = draw(st.sampled_from(["leaf", "fx-dims", "labels-dims"]))
        body = {**good, "device_id": draw(st.sampled_from(["dev-a", "dev-b"]))}
        if kind == "leaf":
            return draw(harmful_variant(body))
        if kind == "fx-dims":
            return {**body, "fx": draw(zero_element_huge_dims("float32"))}
        return {**body, "labels": draw(zero_element_huge_dims("int64"))}

    @_settings(2 * EXAMPLES)
    @given(bad=harmful_step())
    def send_step(bad):
        refused_step(bad)

    send_step()
    after = status()
    group = after["groups"][0]
    assert group["step"] == 0 and group["dropped"] == [] and group["done"] == [], after
    print(f"\nharmful steps: {round_id - 1} met the step checks and dropped their sender")
    assert pair.main.alive()
