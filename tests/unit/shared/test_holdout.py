"""The one held-out split (FedBC's local test split and federated evaluation's held-out part)."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from shared.algorithms.base import RoundContext
from shared.algorithms.fedbc import FedBC
from shared.data import ArrayDataset
from shared.data.holdout import evaluation_holdout, holdout_seed, holdout_split
from shared.run_config import load_run_config


def test_holdout_split_is_seeded_stratified_and_disjoint():
    labels = np.array([0] * 50 + [1] * 30 + [2] * 20)
    train, test = holdout_split(labels, 0.2, seed=4)
    assert len(test) == 20 and len(train) == 80
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(100))
    assert np.bincount(labels[test], minlength=3).tolist() == [10, 6, 4]
    again = holdout_split(labels, 0.2, seed=4)
    assert np.array_equal(again[1], test) and not np.array_equal(holdout_split(labels, 0.2, seed=5)[1], test)
    train, test = holdout_split(labels, 0.0, seed=4)
    assert len(test) == 0 and len(train) == 100
    assert len(holdout_split(np.array([3]), 0.2, 0)[0]) == 1  # never an empty training part


def test_fedbc_split_seed_is_the_one_it_always_was():
    # FedBC's local split moved to shared/data/holdout.py; its seeds (hence its runs) must not change.
    fedbc = FedBC(load_run_config({"algorithm": "fedbc", "seed": 7, "data": {"num_devices": 2, "max_samples": 100}}))
    for device in ("d0", "dev-017"):
        digest = hashlib.sha256(f"fedbc-local-split/7/{device}".encode()).digest()
        expected = int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF
        assert holdout_seed("fedbc-local-split", 7, device) == expected
        assert fedbc.task_extras(device, RoundContext(index=1, attempt=1)).split_seed == expected


def _data(n: int) -> ArrayDataset:
    return ArrayDataset(torch.arange(n, dtype=torch.float32).reshape(n, 1), torch.arange(n) % 3, 3)


def test_evaluation_holdout_splits_once_per_device_and_keeps_a_training_sample():
    data = _data(50)
    train, held = evaluation_holdout(data, 0.2, run_seed=1, device_id="d0")
    assert (len(train), len(held)) == (40, 10)
    assert sorted(torch.cat([train.x, held.x]).flatten().tolist()) == list(range(50))
    again = evaluation_holdout(data, 0.2, run_seed=1, device_id="d0")[1]
    other = evaluation_holdout(data, 0.2, run_seed=1, device_id="d1")[1]
    assert torch.equal(again.x, held.x) and not torch.equal(other.x, held.x)
    # The evaluation split is not FedBC's split of the same device (different purpose, different seed).
    assert holdout_seed("evaluation-holdout", 1, "d0") != holdout_seed("fedbc-local-split", 1, "d0")
    # Too few samples: at least one trains, none may be held out.
    train, held = evaluation_holdout(_data(1), 0.5, run_seed=1, device_id="d0")
    assert (len(train), len(held)) == (1, 0)
    train, held = evaluation_holdout(_data(3), 0.2, run_seed=1, device_id="d0")
    assert (len(train), len(held)) == (3, 0)
    # The server evaluates: everything trains.
    train, held = evaluation_holdout(data, None, run_seed=1, device_id="d0")
    assert train is data and held is None
