"""Synthetic(alpha, beta): the generated federated benchmark of FedProx (Li et al., MLSys 2020),
used verbatim by FedBC (docs/algorithms/fedbc.md#synthetic-generator; FedBC code ``utils/synthetic.py``).

Each of N devices gets its own logistic-regression "teacher" and its own feature distribution:

    n_i = int(LogNormal(4, 2)) + 50                       (heavy-tailed device sizes)
    u_i ~ N(0, alpha_syn)  (mean of W_i and b_i entries)  model heterogeneity
    B_i ~ N(0, beta_syn),  v_i ~ N(B_i, 1)^60              data heterogeneity
    x ~ N(v_i, diag(j^-1.2)),  y = argmax(x W_i + b_i)     60 features, 10 classes

The draws happen in exactly the original order on a numpy *legacy* ``RandomState(seed)`` (the
original seeds the global legacy RNG with ``np.random.seed``; a private ``RandomState`` with the same
seed yields the same stream without touching global state), and each device's samples are shuffled
with Python's ``random`` (a private ``random.Random(seed)`` here, same stream as ``random.seed``)
before the first ``floor(0.8 n_i)`` become its training part and the rest its test part. With
seed 1, N = 30, alpha = beta = 0.5 this reproduces the documented check values (sizes summing to 8678,
label histogram ``[494, 716, 2779, 580, 149, 404, 1125, 1398, 450, 583]``).

Choices where the sources leave room:
* alpha/beta are standard deviations (the generator's meaning; the paper writes N(0, alpha)).
* The label is the argmax of the logits; the original takes the argmax of a softmax, which is the
  same except where ``exp`` overflows to inf (not the case for these parameters: the check values
  match).
* ``iid=True``: shared ``W``, ``b`` drawn once after the feature means, and each device still draws
  (and discards) its own ``W_i``, ``b_i`` as the original does, so the RNG stream stays identical.
* The split fraction is 0.8 (FedBC); FedProx's own script used 0.9.

The features are drawn as numpy's legacy ``multivariate_normal`` draws them (standard normals times
the covariance's SVD factor, plus the mean), with the factor computed once instead of once per
device: the same numbers and the same RNG stream, without 10,000 SVDs for 10,000 devices.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["SyntheticFederated", "device_parts", "generate_synthetic", "generate_raw", "raw_devices", "train_size",
           "SYNTHETIC_DIM", "SYNTHETIC_CLASSES"]

SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10
TRAIN_FRACTION = 0.8


@dataclass(frozen=True)
class SyntheticFederated:
    """Per-device train/test parts of one Synthetic(alpha, beta) draw (numpy, read-only use)."""

    x_train: list[np.ndarray]  # per device, float64 [n_train_i, 60]
    y_train: list[np.ndarray]  # per device, int64 [n_train_i]
    x_test: list[np.ndarray]
    y_test: list[np.ndarray]
    samples_per_device: np.ndarray  # n_i (train + test), int64 [N]


def raw_devices(num_devices: int, alpha: float, beta: float, iid: bool, seed: int
                ) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]]]:
    """Steps 1-6 of docs/algorithms/fedbc.md#synthetic-generator: every n_i, and an iterator over the
    devices in generation order, each as its raw (X_i, y_i), unshuffled, and its teacher (W_i, b_i).
    One device at a time, so that a caller keeping float32 copies never holds every device's
    float64 draws at once."""
    rs = np.random.RandomState(seed)
    dim, classes = SYNTHETIC_DIM, SYNTHETIC_CLASSES
    samples = rs.lognormal(4, 2, num_devices).astype(int) + 50
    mean_w = rs.normal(0, alpha, num_devices)
    mean_b = mean_w  # the bias entries share the weight entries' mean u_i (as in the original)
    b_shift = rs.normal(0, beta, num_devices)
    cov_x = np.diag(np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2))
    _, singular, v = np.linalg.svd(cov_x)
    factor_x = np.sqrt(singular)[:, None] * v   # RandomState.multivariate_normal's factor of cov_x
    mean_x = np.zeros((num_devices, dim))
    for i in range(num_devices):
        mean_x[i] = np.ones(dim) * b_shift[i] if iid else rs.normal(b_shift[i], 1, dim)
    if iid:
        w_global = rs.normal(0, 1, (dim, classes))
        b_global = rs.normal(0, 1, classes)

    def devices() -> Iterator[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]]:
        for i in range(num_devices):
            w = rs.normal(mean_w[i], 1, (dim, classes))
            b = rs.normal(mean_b[i], 1, classes)
            if iid:  # the per-device draws above still happen: they advance the RNG like the original
                w, b = w_global, b_global
            x = np.dot(rs.standard_normal((int(samples[i]), dim)), factor_x)   # = rs.multivariate_normal(mean_x[i], cov_x, n_i)
            x += mean_x[i]
            y = np.argmax(x @ w + b, axis=1).astype(np.int64)
            yield x, y, (w, b)

    return samples.astype(np.int64), devices()


def generate_raw(num_devices: int, alpha: float, beta: float, iid: bool, seed: int
                 ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """:func:`raw_devices` collected: raw per-device (X_i, y_i), n_i, and each device's teacher."""
    samples, devices = raw_devices(num_devices, alpha, beta, iid, seed)
    xs, ys, teachers = [], [], []
    for x, y, teacher in devices:
        xs.append(x)
        ys.append(y)
        teachers.append(teacher)
    return xs, ys, samples, teachers


def train_size(n: int) -> int:
    """How many of a device's ``n`` samples are its training part (the first ``floor(0.8 n)``)."""
    return int(TRAIN_FRACTION * n)


def device_parts(num_devices: int = 30, alpha: float = 0.5, beta: float = 0.5, iid: bool = False, seed: int = 1
                 ) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]:
    """Synthetic(alpha, beta) for ``num_devices`` devices: every n_i, and an iterator over the
    devices in order, each as its shuffled (x_train, y_train, x_test, y_test), float64 features.
    Deterministic: every process derives the same data from the args."""
    if int(num_devices) != num_devices or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"synthetic {name} must be a finite standard deviation >= 0, got {value!r}")
    samples, devices = raw_devices(int(num_devices), float(alpha), float(beta), bool(iid), int(seed))
    # Python's random.Random(seed), the stream the original's random.seed(seed) gives.
    shuffler = random.Random(seed)

    def parts() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        for x, y, _ in devices:
            # random.shuffle's permutation depends only on the length, so shuffling indices equals
            # the original's shuffle of the list of (x, y) pairs.
            order = list(range(len(y)))
            shuffler.shuffle(order)
            idx = np.asarray(order, dtype=np.int64)
            n_train = train_size(len(y))
            yield x[idx[:n_train]], y[idx[:n_train]], x[idx[n_train:]], y[idx[n_train:]]

    return samples, parts()


def generate_synthetic(num_devices: int = 30, alpha: float = 0.5, beta: float = 0.5, iid: bool = False,
                       seed: int = 1) -> SyntheticFederated:
    """:func:`device_parts` collected into per-device lists (float64). ``load_dataset`` does not
    use it: it copies each device's parts into float32 arrays as they are drawn."""
    samples, devices = device_parts(num_devices, alpha, beta, iid, seed)
    # x_train, y_train, x_test, y_test: one array per device each
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [], [])
    for device in devices:
        for target, part in zip(parts, device):
            target.append(part)
    return SyntheticFederated(*parts, samples_per_device=samples)
