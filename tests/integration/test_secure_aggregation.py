"""Secure aggregation through the real services (docs/privacy.md, "Secure aggregation").

- Five devices played by hand over HTTP, each running the project's own device side of the
  protocol (``shared.secagg.protocol``) with an update the test chose: one withdraws after sharing
  its secrets (dropped before masking), one uploads its masked update and then goes silent
  (dropped in the unmasking stage). The round completes, and the Fed Server's new global model is
  the plain FedAvg of the four uploaded (clipped) updates within the fixed-point bound, while
  every upload the Fed Server recorded (``--record-received``) is not the device's update. A
  public key one device sent, sent again by another, is refused (422), and a batch far beyond what
  the attempt's devices' messages take (413). The same with a survivor
  answering the unmasking with a false share of another's seed: refused (422), and the others'
  shares rebuild the sum. Either way the survivor the unmasking waited for in vain sits out.
- The same attempt with one device adding 2^62 to each of its words (an update far beyond its
  range, which it need not clip): each entry of the unmasked sum is clamped to what the survivors'
  clipped updates can add up to, so the model moves by at most ``value_range``; the record and the
  Fed Server's metric count the clamped entries.
- The same attempt with only two answers in the unmasking stage, below the threshold of three:
  the attempt fails, its record says so, and the logical round is retried.
- A FedAvg run with real device agents and ``secure_aggregation.enabled``: its rounds complete and
  move the model.
- Distributed noise (``privacy.noise: distributed``): the same attempt, each device adding its
  share of the noise before masking; the unmasked mean carries the whole noise (the four
  survivors' shares, each of variance (z C)^2 / threshold) and the round's record its epsilon.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from device_agent.secure_aggregation import SecureSession
from fed_server.run_dir import RunDirectory
from fed_server.update_checks import shard_sizes, trained_samples
from integration_support import body_bytes, read_metrics, server_pair, small_config, wait_for
from shared.config import RunConfig
from shared.privacy.accountant import PrivacyLedger
from shared.schemas import (
    API, DeviceProfileMsg, DeviceTimings, RegisterRequest, SecAggInbox, SecAggKeys, SecAggRoster, SecAggShares,
    SecAggUnmask, SecAggUnmaskPlan, TaskResponse, UpdateRequest, WeightsResponse, WithdrawRequest,
)
from shared.secagg.encoding import decode
from shared.secagg.masks import BlockLayout
from shared.secagg.protocol import DeviceSecrets, state_to_words, words_to_state
from shared.secagg.shamir import SHARE_BYTES
from shared.models import build_model
from shared.wire import decode_state, encode_state, packb, unpackb
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

HEADERS = {"content-type": "application/msgpack", "accept": "application/msgpack"}
DEVICES = [f"dev-{i}" for i in range(5)]
RANGE = 0.05


def _config(**overrides) -> RunConfig:
    return small_config(algorithm="fedavg", **{
        "rounds": 1, "data.num_devices": 5, "data.max_samples": 500, "aggregation.rule": "mean", "devices.profiles": [],
        "evaluation.mode": "server", "secure_aggregation.enabled": True, "secure_aggregation.value_range": RANGE,
        "secure_aggregation.stage_s": 5.0, **overrides})


def _call(client: httpx.Client, method: str, url: str, message=None, **params):
    answer = client.request(method, url, params=params or None,
                            content=packb(message.model_dump()) if message is not None else None)
    assert answer.status_code == 200, answer.text
    return unpackb(answer.content)


def _task(client: httpx.Client, fed_url: str, device: str) -> TaskResponse:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        task = TaskResponse.model_validate(_call(client, "GET", f"{fed_url}{API}/devices/{device}/task", wait_s=5))
        if task.status == "train":
            return task
    raise AssertionError(f"{device} got no training task")


class _StageChannel:
    """A device's stage messages and questions over a client of the test's (the session fetches its
    inbox when it masks, and answers the unmasking as a device does)."""

    def __init__(self, client: httpx.Client, stage_url: str) -> None:
        self.client, self.stage_url = client, stage_url

    def secagg_send(self, round_id: int, stage: str, req) -> None:
        _call(self.client, "POST", f"{self.stage_url}/{stage}", req)

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float, model):
        return model.model_validate(_call(self.client, "GET", f"{self.stage_url}/{stage}", device_id=device_id,
                                          wait_s=wait_s))


def _play_attempt(client: httpx.Client, config: RunConfig, fed: str, answering: list[str], norm: float | None = None,
                  harmful: str | None = None, lying: str | None = None, misdealing: str | None = None,
                  straggling: bool = False):
    """Register the five devices and play their first attempt: all send keys and shares, dev-4
    withdraws before masking, dev-0..3 upload masked updates (each of L2 norm ``norm`` if given,
    as a private device's clipped update is), masked as a device masks them
    (:meth:`SecureSession.masked_weights`, with the task's privacy terms), ``harmful`` adding 2^62
    to every word of its own (an update far beyond its range), and only ``answering`` answer the
    unmasking stage, ``lying`` with a share of dev-0's seed moved by one (a field element that would
    rebuild the seed plus a known amount), which is refused, and nothing after; ``misdealing``
    commits to a seed other than the one it shares. ``straggling``: dev-4 does not withdraw but goes
    silent (uploads close at the round deadline), and ``answering`` answer the unmasking as devices
    do (``SecureSession.answer_unmasking``, all at once), each with a task deadline 2 s before the
    round's (as a split run's are, relative to the unmasking: its Fed Server may wait on its
    replicas after the round deadline before it opens the stage). The weights the attempt started from, the updates, their sample counts and
    the task's terms."""
    sizes = {d: trained_samples(n, None) for d, n in zip(DEVICES, shard_sizes(config.data))}
    for shard, device in enumerate(DEVICES):
        _call(client, "POST", f"{fed}{API}/devices/register", RegisterRequest(
            device_id=device, shard=shard, num_samples=sizes[device], profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    tasks = {d: _task(client, fed, d) for d in DEVICES}
    deadlines = {d: time.monotonic() + (t.deadline_s or 0) - (2.0 if straggling else 0.0) for d, t in tasks.items()}
    round_id, terms = tasks[DEVICES[0]].round_id, tasks[DEVICES[0]].secure_aggregation
    assert round_id is not None and terms is not None and all(t.secure_aggregation == terms for t in tasks.values())
    stage = f"{fed}{API}/rounds/{round_id}/secagg"
    start = decode_state(WeightsResponse.model_validate(_call(
        client, "GET", f"{fed}{API}/devices/{DEVICES[0]}/weights/{tasks[DEVICES[0]].weights_id}")).weights)

    # Stages 1 and 2, each device with its own fresh secrets.
    secrets = {d: DeviceSecrets(d, _run_id(client, fed), round_id) for d in DEVICES}
    for device, own in secrets.items():
        mask_key, share_key = own.public_keys()
        keys = SecAggKeys(device_id=device, round_id=round_id, mask_key=mask_key, share_key=share_key)
        if device == "dev-1":   # first a key of dev-0's, as a device colluding with it would send
            copied = keys.model_copy(update={"mask_key": secrets["dev-0"].public_keys()[0]})
            refused = client.post(f"{stage}/keys", content=packb(copied.model_dump()))
            assert refused.status_code == 422 and "sent already by dev-0" in refused.text, refused.text
        _call(client, "POST", f"{stage}/keys", keys)
    rosters = {d: SecAggRoster.model_validate(_call(client, "GET", f"{stage}/roster", device_id=d, wait_s=10))
               for d in DEVICES}
    assert all(r.ready and sorted(r.keys) == DEVICES and r.threshold == 3 for r in rosters.values())
    roster = {d: (k.mask_key, k.share_key) for d, k in rosters[DEVICES[0]].keys.items()}
    for device, own in secrets.items():
        shares = own.seal_shares(roster, 3)
        _call(client, "POST", f"{stage}/shares", SecAggShares(device_id=device, round_id=round_id, shares=shares,
                                                               seed_commitment=(bytes(16) if device == misdealing
                                                                                else own.seed_commitment()),
                                                               own_commitments=own.own_commitments))
    # A batch far beyond what the attempt's five devices' messages take is refused before it is read.
    oversized = client.post(f"{stage}/batch", content=bytes(1 << 20))
    assert oversized.status_code == 413 and "exceeds the limit of 17440 bytes" in oversized.text, oversized.text
    partners = {d: secrets[d].open_inbox(roster, SecAggInbox.model_validate(
        _call(client, "GET", f"{stage}/inbox", device_id=d, wait_s=10)).shares) for d in DEVICES}
    assert all(p == DEVICES for p in partners.values())

    # Stage 3: dev-4 drops before masking (it withdraws); the others upload masked updates.
    rng = np.random.default_rng(5)
    updates = {d: {k: rng.uniform(-2 * RANGE, 2 * RANGE, size=tuple(v.shape)) for k, v in start.items()}
               for d in DEVICES[:4]}
    if norm is not None:
        for update in updates.values():
            scale = norm / np.sqrt(sum(float(np.sum(v ** 2)) for v in update.values()))
            update.update({k: v * scale for k, v in update.items()})
    layout = BlockLayout.of(build_model(config.model, 10, (1, 28, 28), seed=config.seed))
    sessions = {}
    for device, update in updates.items():
        session = sessions[device] = SecureSession(_StageChannel(client, stage), secrets[device], terms, roster,
                                                   deadlines[device], rosters[device].threshold, rosters[device].splits)
        trained = {k: start[k].double() + torch.from_numpy(v) for k, v in update.items()}
        masked = session.masked_weights(trained, start, sizes[device], layout, tasks[device].privacy)
        if device == harmful:
            masked = encode_state(words_to_state({k: w + np.uint64(1 << 62)
                                                  for k, w in state_to_words(decode_state(masked)).items()}))
        _call(client, "POST", f"{fed}{API}/rounds/{round_id}/updates", UpdateRequest(
            device_id=device, round_id=round_id, num_samples=sizes[device], steps=1, train_loss=1.0,
            weights=masked, bytes_up=0, bytes_down=0,
            timings=DeviceTimings(compute_s=1.0, transfer_s=0.1, wait_s=0.0, server_s=0.0, total_s=1.1)))
    if straggling:
        def answer(device: str) -> None:
            with httpx.Client(timeout=60.0, headers=HEADERS) as own:
                sessions[device].fed = _StageChannel(own, stage)
                sessions[device].answer_unmasking()
        with ThreadPoolExecutor(len(answering)) as pool:
            for done in [pool.submit(answer, d) for d in answering]:
                done.result()   # every one answered, none expired
        return start, updates, sizes, terms
    _call(client, "POST", f"{fed}{API}/rounds/{round_id}/withdrawals",
          WithdrawRequest(device_id="dev-4", round_id=round_id, reason="battery"))

    # Stage 4: the devices not ``answering`` go silent.
    plans = {d: SecAggUnmaskPlan.model_validate(_call(client, "GET", f"{stage}/unmask", device_id=d, wait_s=20))
             for d in answering}
    assert all(p.ready and p.survivors == DEVICES[:4] and p.dropped == ["dev-4"] for p in plans.values())
    for device in answering:
        seeds, keys = secrets[device].unmask(plans[device].survivors, plans[device].dropped)
        if device == lying:
            moved = (int.from_bytes(seeds["dev-0"], "big") + 1).to_bytes(SHARE_BYTES, "big")
            refused = client.post(f"{stage}/unmask", content=packb(SecAggUnmask(
                device_id=device, round_id=round_id, seed_shares={**seeds, "dev-0": moved}, key_shares=keys
            ).model_dump()))
            assert refused.status_code == 422, refused.text
            assert f"'{device}': the shares of the seeds of dev-0 are not the ones their owners dealt it" in refused.text
            continue
        _call(client, "POST", f"{stage}/unmask", SecAggUnmask(device_id=device, round_id=round_id,
                                                               seed_shares=seeds, key_shares=keys))
    return start, updates, sizes, terms


@pytest.mark.parametrize("lying", [None, "dev-0"], ids=["honest", "a-false-unmasking-share"])
def test_the_fed_server_recovers_the_fedavg_sum_from_masked_uploads_despite_two_dropouts(tmp_path: Path,
                                                                                        lying: str | None):
    config = _config()
    records, run_dir = tmp_path / "records", tmp_path / "run"
    # A false share from dev-0 (index 1: among the three the seed would be rebuilt from) is refused,
    # and dev-1..3's true ones rebuild every secret.
    answering = DEVICES[:3] if lying is None else DEVICES[:4]
    with server_pair(config, "secagg", fed_args=["--run-dir", str(run_dir), "--record-received", str(records)]) as servers, \
            httpx.Client(timeout=60.0, headers=HEADERS) as client:
        start, updates, sizes, terms = _play_attempt(client, config, servers.fed_url, answering, lying=lying)
        wait_for(lambda: client.get(f"{servers.fed_url}{API}/status").json()["state"] == "finished", 120,
                 "the run to finish")
        log = servers.fed.log_path.read_text()

    (record,) = read_metrics(run_dir)
    assert record["status"] == "ok" and sorted(record["aggregated"]) == DEVICES[:4] and record["secure_clamped"] == 0
    # The survivor the unmasking stage waited for in vain (silent, or its answer false) sits out.
    held, answered = ("dev-3", "dev-0") if lying is None else ("dev-0", "dev-3")
    assert f"{held} held secure aggregation's unmasking up; it sits out the next 1 attempt" in log
    assert f"{answered} held" not in log
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    weight = sum(sizes[d] for d in updates)
    bound = len(updates) / 2.0 ** (terms.fraction_bits + 1) / weight + 1e-6   # + float32 storage of the model
    for key, before in start.items():
        plain = sum(sizes[d] * np.clip(updates[d][key], -RANGE, RANGE) for d in updates) / weight
        np.testing.assert_allclose(state[key].double().numpy(), before.double().numpy() + plain, atol=bound, rtol=0)
    # What the Fed Server kept of each upload is masked: decoded alone, no entry is its update's.
    (attempt,) = (records / "fed_server").iterdir()
    for device, update in updates.items():
        with np.load(attempt / f"{device}-upload.npz", allow_pickle=False) as kept:
            for key, value in update.items():
                alone = decode(kept[key].view(np.uint64), terms.fraction_bits)
                truth = sizes[device] * np.clip(value, -RANGE, RANGE)
                assert np.mean(np.abs(alone - truth) < 1e-3) < 0.01, (device, key)



def test_an_upload_beyond_its_range_moves_each_entry_of_the_mean_by_at_most_value_range(tmp_path: Path):
    config = _config()
    run_dir = tmp_path / "run"
    with server_pair(config, "secagg-harmful", fed_args=["--run-dir", str(run_dir)]) as servers, \
            httpx.Client(timeout=60.0, headers=HEADERS) as client:
        start, updates, _, terms = _play_attempt(client, config, servers.fed_url, answering=DEVICES[:3],
                                                 harmful="dev-0")
        wait_for(lambda: client.get(f"{servers.fed_url}{API}/status").json()["state"] == "finished", 120,
                 "the run to finish")
        clamped = client.get(f"{servers.fed_url}/metrics").text

    (record,) = read_metrics(run_dir)
    entries = sum(v.numel() for v in start.values())
    # 2^62 in fixed point is more than every device at its limit adds up to: most entries of the sum
    # land beyond it (those where the honest sum is not far below zero) and are clamped.
    assert record["status"] == "ok" and entries // 2 < record["secure_clamped"] <= entries, record["secure_clamped"]
    (counted,) = [float(line.split()[1]) for line in clamped.splitlines()
                  if line.startswith("sfl_fed_secure_clamped_entries_total ")]
    assert counted == record["secure_clamped"]
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    moved = max(float((state[k].double() - v.double()).abs().max()) for k, v in start.items())
    assert RANGE * 0.99 < moved <= RANGE * (1 + 1e-5), moved   # unclamped, the 2^62 alone moves it 1.57 x RANGE


def test_with_distributed_noise_the_unmasked_mean_carries_the_devices_shares_of_the_noise_and_an_epsilon(
        tmp_path: Path):
    clip, z, threshold = 0.05, 1.0, 3
    config = _config(**{"privacy.clipping": "fixed", "privacy.clip_norm": clip, "privacy.noise": "distributed",
                        "privacy.noise_multiplier": z, "privacy.delta": 1e-3, "secure_aggregation.threshold": threshold,
                        "secure_aggregation.value_range": 0.3})
    run_dir = tmp_path / "run"
    with server_pair(config, "secagg-dp", fed_args=["--run-dir", str(run_dir)]) as servers, \
            httpx.Client(timeout=60.0, headers=HEADERS) as client:
        start, updates, _, _ = _play_attempt(client, config, servers.fed_url, answering=DEVICES[:3], norm=clip)
        wait_for(lambda: client.get(f"{servers.fed_url}{API}/status").json()["state"] == "finished", 120,
                 "the run to finish")

    (record,) = read_metrics(run_dir)
    assert record["status"] == "ok" and sorted(record["aggregated"]) == DEVICES[:4], record
    # Every device weighs 1: the mean of the four clipped updates, plus the mean of their noise,
    # whose standard deviation is sqrt(4 (z C)^2 / 3) / 4 on every entry.
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    residual = np.concatenate([(state[k].double().numpy() - start[k].double().numpy()
                                - sum(u[k] for u in updates.values()) / len(updates)).ravel() for k in start])
    expected = np.sqrt(len(updates) * (z * clip) ** 2 / threshold) / len(updates)
    assert residual.size > 10_000 and abs(residual.mean()) < 0.05 * expected
    assert abs(residual.std() / expected - 1) < 0.03, (residual.std(), expected)
    # The round is counted as central noise of multiplier z would be: what the survivors' sum
    # carries is at least that noise.
    ledger = PrivacyLedger("rdp", 1e-3)
    ledger.spend(z, config.per_round / config.data.num_devices)
    assert record["privacy"]["epsilon"] == pytest.approx(ledger.epsilon())
    assert record["privacy"]["noise_multiplier"] == z


def _run_id(client: httpx.Client, fed_url: str) -> str:
    return str(_call(client, "GET", f"{fed_url}{API}/run")["run_id"])


@pytest.mark.parametrize("private, sparse", [(False, False), (True, False), (False, True)],
                         ids=["plain", "distributed-noise", "sparse-graph"])
def test_a_fedavg_run_with_real_agents_aggregates_securely(tmp_path: Path, private: bool, sparse: bool):
    # Private: each agent's device clips, noises and masks its update (device_agent/task_training.py).
    # Sparse: SecAgg+'s graph, each device sharing with and masking with two of the other four.
    noise = {"privacy.clipping": "fixed", "privacy.clip_norm": 0.5, "privacy.noise": "distributed",
             "privacy.noise_multiplier": 0.5, "privacy.delta": 1e-3, "secure_aggregation.threshold": 3,
             "secure_aggregation.value_range": 2.0} if private else {}
    graph = {"secure_aggregation.neighbours": 2, "secure_aggregation.threshold": 2} if sparse else {}
    config = _config(rounds=2, **{"data.max_samples": 1200, "secure_aggregation.value_range": 1.0, **noise, **graph})
    with Testbed(config, tmp_path, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=300)
        metrics = httpx.get(f"{testbed.fed_url}/metrics", timeout=30, verify=testbed.verify).text
    assert status["state"] == "finished"
    # The agent hosting the five devices sent their stages in batches, never one device at a time.
    prefix = f"{API}/rounds/{{round_id}}/secagg"
    assert body_bytes(metrics, f"{prefix}/batch", "received") > 0 and body_bytes(metrics, f"{prefix}/{{stage}}/batch") > 0
    assert all(body_bytes(metrics, f"{prefix}/{stage}", "received") == 0 for stage in ("keys", "shares", "unmask"))
    assert body_bytes(metrics, f"{prefix}/{{stage}}") == 0, metrics
    rounds = read_metrics(tmp_path)
    assert [r["status"] for r in rounds] == ["ok", "ok"] and all(len(r["aggregated"]) == 5 for r in rounds), rounds
    epsilons = [r["privacy"]["epsilon"] if r["privacy"] else None for r in rounds]
    assert (epsilons[0] < epsilons[1]) if private else epsilons == [None, None], epsilons
    _, state, _ = RunDirectory(tmp_path).read_checkpoint()
    initial = build_model("cnn", 10, (1, 28, 28), seed=config.seed).state_dict()
    # Every entry of a mean of updates clipped to value_range moves at most that much a round; a
    # mask left in the sum would move it by about 2**63 over the fixed point's scale.
    change = max(float((state[k] - initial[k]).abs().max()) for k in initial)
    assert 1e-3 < change <= len(rounds) * config.secure_aggregation.value_range, change
    assert all(torch.isfinite(v).all() for v in state.values())


def test_fewer_unmasking_answers_than_the_threshold_fail_the_attempt_and_the_round_is_retried(tmp_path: Path):
    config = _config()
    run_dir = tmp_path / "run"
    with server_pair(config, "secagg-short", fed_args=["--run-dir", str(run_dir)]) as servers, \
            httpx.Client(timeout=60.0, headers=HEADERS) as client:
        _play_attempt(client, config, servers.fed_url, answering=DEVICES[:2])   # 2 shares, threshold 3
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the attempt's record")
        retried = _task(client, servers.fed_url, DEVICES[0])
    (record,) = read_metrics(run_dir)
    assert record["status"] == "failed" and record["round"] == 1 and record["aggregated"] == DEVICES[:4], record
    assert retried.round_index == 1 and retried.round_id != record["round_id"]
    assert retried.secure_aggregation is not None


def test_a_device_that_never_uploads_closes_uploads_at_the_round_deadline_and_the_survivors_still_answer(
        tmp_path: Path):
    # The unmasking opens only at the round deadline, when each survivor's task deadline passes too:
    # a device waits for its question past it, and none is taken for one that held the attempt up.
    config = _config(**{"deadlines.round_s": 6.0, "deadlines.patience": None})
    run_dir = tmp_path / "run"
    with server_pair(config, "secagg-straggler", fed_args=["--run-dir", str(run_dir)]) as servers, \
            httpx.Client(timeout=60.0, headers=HEADERS) as client:
        _play_attempt(client, config, servers.fed_url, answering=DEVICES[:4], straggling=True)
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the attempt's record")
        log = servers.fed.log_path.read_text()
    (record,) = read_metrics(run_dir)
    assert record["status"] == "ok" and sorted(record["aggregated"]) == DEVICES[:4], record
    assert "dev-4 missed a deadline; it sits out the next 1 attempt" in log
    assert "held secure aggregation's unmasking up" not in log


def test_an_owner_whose_shares_rebuild_no_secret_it_committed_to_fails_the_attempt_and_sits_out(tmp_path: Path):
    config = _config()
    run_dir = tmp_path / "run"
    with server_pair(config, "secagg-misdealt", fed_args=["--run-dir", str(run_dir)]) as servers, \
            httpx.Client(timeout=60.0, headers=HEADERS) as client:
        _play_attempt(client, config, servers.fed_url, answering=DEVICES[:4], misdealing="dev-2")
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the attempt's record")
        retried = _task(client, servers.fed_url, DEVICES[0])
        log = servers.fed.log_path.read_text()
    (record,) = read_metrics(run_dir)
    assert record["status"] == "failed" and record["round"] == 1, record
    assert "the shares of dev-2 rebuild no secret they committed to" in log
    assert "dev-2 held secure aggregation's unmasking up; it sits out the next 1 attempt" in log
    assert retried.round_index == 1 and retried.round_id != record["round_id"]


@pytest.mark.parametrize("private", [False, True], ids=["plain", "distributed-noise"])
def test_an_s2fl_run_with_real_agents_sums_each_block_over_the_devices_that_hold_it(tmp_path: Path, private: bool):
    # Two devices pinned at the deepest cut (3 of the cnn's 4 blocks), two sliding through the
    # paper's warm-up (cut 1, then 2): every attempt mixes cuts, the blocks past a sliding device's cut
    # are summed over the two deep devices only (the threshold), and the Main Server's group
    # copies stand in for the blocks a device does not hold (Algorithm 1, layer-wise).
    deep = ["dev-000", "dev-001"]
    noise = {"privacy.clipping": "fixed", "privacy.clip_norm": 0.5, "privacy.noise": "distributed",
             "privacy.noise_multiplier": 0.5, "privacy.delta": 1e-3} if private else {}
    config = small_config(rounds=2, **{"aggregation.rule": "mean", "devices.profiles": [],
                                       "split.pinned": {d: 3 for d in deep}, "split.warm_up": "every_split",
                                       "secure_aggregation.enabled": True, "secure_aggregation.threshold": 2,
                                       "secure_aggregation.value_range": 2.0 if private else 1.0, **noise})
    with Testbed(config, tmp_path, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=300)
    assert status["state"] == "finished"
    rounds = read_metrics(tmp_path)
    assert [r["status"] for r in rounds] == ["ok", "ok"] and all(len(r["aggregated"]) == 4 for r in rounds), rounds
    assert [r["split_points"] for r in rounds] == [
        {"dev-000": 3, "dev-001": 3, "dev-002": 1, "dev-003": 1}, {"dev-000": 3, "dev-001": 3, "dev-002": 2, "dev-003": 2}]
    _, state, _ = RunDirectory(tmp_path).read_checkpoint()
    model = build_model("cnn", 10, (1, 28, 28), seed=config.seed)
    initial = model.state_dict()
    # Block 0 is every device's in both rounds: each of its entries moves at most value_range a
    # round; a mask left in its sum would move it by about 2**63 over the fixed point's scale.
    first = model.portion_keys(0, 1)
    change = max(float((state[k] - initial[k]).abs().max()) for k in first)
    assert 1e-4 < change <= len(rounds) * config.secure_aggregation.value_range, change
    assert all(torch.isfinite(v).all() for v in state.values())
    assert max(float((state[k] - initial[k]).abs().max()) for k in model.portion_keys(2, 3)) > 1e-4
    epsilons = [r["privacy"]["epsilon"] if r["privacy"] else None for r in rounds]
    assert (epsilons[0] < epsilons[1]) if private else epsilons == [None, None], epsilons


def test_a_u_shaped_s2fl_run_with_real_agents_masks_each_devices_head_with_its_front_blocks(tmp_path: Path):
    # Every device holds the cnn's head (block 3) beside its front blocks, and masks it with them:
    # the head is summed over all four devices, each front block over the devices cut after it.
    config = small_config(rounds=2, **{"aggregation.rule": "mean", "devices.profiles": [], "split.u_shaped": True,
                                       "split.pinned": {"dev-000": 2, "dev-001": 2},
                                       "secure_aggregation.enabled": True, "secure_aggregation.threshold": 2,
                                       "secure_aggregation.value_range": 1.0})
    with Testbed(config, tmp_path, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=300)
    assert status["state"] == "finished"
    rounds = read_metrics(tmp_path)
    assert [r["status"] for r in rounds] == ["ok", "ok"] and all(len(r["aggregated"]) == 4 for r in rounds), rounds
    assert all(0 < k < 3 for r in rounds for k in r["split_points"].values())
    _, state, _ = RunDirectory(tmp_path).read_checkpoint()
    model = build_model("cnn", 10, (1, 28, 28), seed=config.seed)
    initial = model.state_dict()
    # Block 0 and the head are every device's: each entry moves at most value_range a round, where a
    # mask left in the sum would move it by about 2**63 over the fixed point's scale.
    for keys in (model.portion_keys(0, 1), model.portion_keys(3, 4)):
        change = max(float((state[k] - initial[k]).abs().max()) for k in keys)
        assert 1e-4 < change <= len(rounds) * config.secure_aggregation.value_range, (keys, change)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert status["summary"]["final_accuracy"] > status["summary"]["initial_accuracy"]
