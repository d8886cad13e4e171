"""One device cannot stop, stall or corrupt a run: harmful uploads through the real servers.

A real Fed Server and Main Server (S2FL, cnn) and two real devices training in threads. In each
round ``dev-001`` sends one harmful version of its honest upload instead of it, each well-formed
and passing the schema:

* timings of ``1e308`` s each (finite, but their sum is not: this used to kill the round driver
  while recording the round, after the new model was in memory);
* timings whose sum exceeds the round deadline;
* ``num_samples=10**12`` with zeroed weights (used to outweigh the honest device and pin the
  accuracy at chance; the sample count is the aggregation weight);
* a training loss of 1e308 (the round record's weighted mean became infinite, and the status
  endpoint could no longer encode it as JSON);
* a tensor with zero elements but a dimension of 2**63.

Every one must be refused with a 4xx naming the reason, and must take ``dev-001`` out of that
attempt at once (its honest upload after it is refused too), so the attempt completes with
``dev-000`` long before the round deadline, and the record says why ``dev-001`` left. The run
completes every round with a model better than the initial one and the honest timings in the
records.
"""
from __future__ import annotations

import threading

import httpx

from device_agent.clients import HttpFedClient, main_connector
from device_agent.device import Device
from integration_support import final_status, server_pair, small_config
from shared.schemas import API, UpdateRequest
from shared.wire import packb

# Long next to a round of this size (seconds), so that waiting for dev-001 would show in the run time.
ROUND_S = 120.0
ROUNDS = 5   # one harmful version a round


def _harmful_versions(body: UpdateRequest) -> list[tuple[str, dict, str]]:
    """(what, body, a word the refusal must name) for each harmful variant of an honest upload."""
    honest = body.model_dump()
    zeroed = {k: {**v, "data": bytes(len(v["data"]))} for k, v in honest["weights"].items()}
    first = next(iter(honest["weights"]))
    huge_dim = {**honest["weights"], first: {"dtype": "float32", "shape": [0, 1 << 63], "data": b""}}
    return [
        ("1e308 timings", {**honest, "timings": {**honest["timings"], "compute_s": 1e308, "transfer_s": 1e308}},
         "deadline"),
        ("timings summing past the deadline",
         {**honest, "timings": {**honest["timings"], "compute_s": ROUND_S * 0.6, "transfer_s": ROUND_S * 0.6}},
         "deadline"),
        ("10**12 samples, zeroed weights", {**honest, "num_samples": 10**12, "weights": zeroed}, "num_samples"),
        ("a training loss of 1e308", {**honest, "train_loss": 1e308}, "train_loss"),
        ("a zero-element tensor of dimension 2**63", {**honest, "weights": huge_dim}, "shape"),
    ]


def test_harmful_uploads_are_refused_take_the_device_out_and_the_run_completes():
    config = small_config(algorithm="s2fl", rounds=ROUNDS, **{
        "data.num_devices": 2, "data.max_samples": 400, "train.batch_size": 32,
        "deadlines.round_s": ROUND_S, "deadlines.join_s": 8, "deadlines.step_s": 8,
        "deadlines.max_failed_attempts": 5})
    refusals: list[tuple[str, int, str, bool]] = []   # (what, status, detail, names the reason)
    genuine: list[int] = []                            # the status of dev-001's honest upload after each
    stop = threading.Event()
    with server_pair(config, "robust") as servers:
        class EvilFedClient(HttpFedClient):
            """Sends one harmful version of each genuine upload (a different one each round), then the
            genuine one, and records the answers."""

            def upload(self, req: UpdateRequest) -> None:
                path = f"{servers.fed_url}{API}/rounds/{req.round_id}/updates"
                versions = _harmful_versions(req)
                what, bad, word = versions[len(refusals) % len(versions)]
                resp = httpx.post(path, content=packb(bad), timeout=30, headers={"content-type": "application/msgpack"})
                detail = str(resp.json().get("detail")) if resp.headers["content-type"].startswith(
                    "application/json") else resp.text
                refusals.append((what, resp.status_code, detail, word in detail))
                resp = httpx.post(path, content=packb(req.model_dump()), timeout=30,
                                  headers={"content-type": "application/msgpack"})
                genuine.append(resp.status_code)

        honest = Device("dev-000", 0, HttpFedClient(servers.fed_url), main_connector(), kind=None, stop=stop)
        evil = Device("dev-001", 1, EvilFedClient(servers.fed_url), main_connector(), kind=None, stop=stop)
        errors: list[BaseException] = []

        def run(device: Device) -> None:
            try:
                device.run()
            except BaseException as exc:  # reported below, with the servers' logs
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(d,), daemon=True) for d in (honest, evil)]
        for t in threads:
            t.start()
        status = final_status(servers.fed_url, 300)
        stop.set()
        for t in threads:
            t.join(30)
        fed_log = servers.fed.log_tail(40)

    assert not errors, errors
    assert status["driver_error"] is None, status["driver_error"]
    assert status["state"] == "finished", (status, fed_log)
    # Every harmful upload was refused with a 4xx naming the reason, and the genuine one after it
    # found the device already out of the attempt.
    assert len(refusals) == ROUNDS, refusals
    assert len({what for what, *_ in refusals}) == ROUNDS, refusals   # every harmful version once
    for what, code, detail, named in refusals:
        assert 400 <= code < 500, (what, code, detail)
        assert named, (what, detail)
    assert genuine == [409] * ROUNDS, genuine
    ok = [r for r in status["history"] if r["status"] == "ok"]
    assert [r["round"] for r in ok] == list(range(1, ROUNDS + 1)), status["history"]
    for record, (what, _, detail, _) in zip(ok, refusals):
        assert record["aggregated"] == ["dev-000"], record
        assert record["left"]["dev-001"] == f"upload refused: {detail}", (what, record["left"])
        # Not held to the round deadline by the device that was taken out.
        assert record["round_time_s"] < ROUND_S / 2, record
        for device, timings in record["device_times"].items():   # the honest figures were recorded
            assert timings["compute_s"] + timings["transfer_s"] + timings["server_s"] <= ROUND_S, (device, timings)
    assert status["summary"]["final_accuracy"] > status["summary"]["initial_accuracy"] + 0.1, status["summary"]

