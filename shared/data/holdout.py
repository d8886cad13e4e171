"""A device's fixed held-out part: the one split of a device's local data into a training part and
a part it never trains on.

Two users, one function: FedBC's local test split (``shared/algorithms/fedbc.py``,
``local_test_fraction``) and federated evaluation (``evaluation.holdout``: the device evaluates the
new global model on its held-out part and reports, ``shared/evaluation.py``).
"""
from __future__ import annotations

import hashlib

import numpy as np

from shared.data.datasets import ArrayDataset


def holdout_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A device's fixed (train, held-out) index split: ``floor(n * fraction)`` held-out samples, stratified.

    Samples are shuffled with ``seed``, grouped by class (stable), and every position where
    ``floor((k + 1) f) > floor(k f)`` is held out, so each class gives about ``f`` of its samples
    (docs/algorithms/fedbc.md#local-test-split: shuffled and stratified, not the FedBC code's
    unshuffled tail). As ``fraction < 1``, at least one sample always trains; a device with
    ``n * fraction < 1`` holds out none. Both arrays sorted. Float (regression) targets have no
    classes: they are held out as one class, i.e. every ``1/fraction``-th of the shuffled samples.
    """
    labels = np.asarray(labels)
    n = labels.shape[0] if labels.ndim else 0
    labels = labels.reshape(-1) if np.issubdtype(labels.dtype, np.integer) else np.zeros(n, dtype=np.int64)
    if fraction <= 0 or n == 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(n)
    order = perm[np.argsort(labels[perm], kind="stable")]
    k = np.arange(n)
    is_test = np.floor((k + 1) * fraction) > np.floor(k * fraction)
    return np.sort(order[~is_test]).astype(np.int64), np.sort(order[is_test]).astype(np.int64)


def holdout_seed(purpose: str, run_seed: int, device_id: str) -> int:
    """Seed of a device's split for ``purpose``: fixed for the run and the device, the same every
    round and after a restart, and different between purposes (FedBC's split of the training part
    is not the evaluation split again)."""
    digest = hashlib.sha256(f"{purpose}/{run_seed}/{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF


def evaluation_holdout(data: ArrayDataset, fraction: float | None, run_seed: int,
                       device_id: str) -> tuple[ArrayDataset, ArrayDataset | None]:
    """(training part, held-out part) of a device's data for federated evaluation.

    ``fraction`` None (the server evaluates): the whole data trains and nothing is held out.
    """
    if fraction is None:
        return data, None
    train, held_out = holdout_split(data.y.numpy(), fraction, holdout_seed("evaluation-holdout", run_seed, device_id))
    return data.subset(train), data.subset(held_out)
