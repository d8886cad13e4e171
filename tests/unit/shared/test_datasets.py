"""Dataset loader tests: embedded MNIST, CIFAR pickles and LEAF json written as tiny fixtures."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.data import (
    ArrayDataset,
    DataSpec,
    dataset_input_shape,
    dataset_num_classes,
    device_shard,
    load_cifar,
    load_dataset,
    load_embedded_mnist,
    load_femnist,
    to_rgb32,
)


# ------------------------------------------------------------------ embedded MNIST
def test_embedded_mnist_sizes_and_normalisation() -> None:
    train, test = load_embedded_mnist("train"), load_embedded_mnist("test")
    assert len(train) == 4000 and len(test) == 1000
    assert train.x.shape == (4000, 1, 28, 28) and train.x.dtype == torch.float32
    assert train.y.dtype == torch.int64 and train.num_classes == 10 and train.writers is None
    assert np.array_equal(train.label_counts(), np.full(10, 400))
    assert np.array_equal(test.label_counts(), np.full(10, 100))
    assert abs(train.x.mean().item()) < 0.1 and 0.8 < train.x.std().item() < 1.2
    # the split is fixed: a second call gives the same data
    assert torch.equal(load_embedded_mnist("train").y, train.y)
    assert not torch.equal(train.x[:1000], test.x)
    with pytest.raises(ValueError):
        load_embedded_mnist("val")  # type: ignore[arg-type]


def test_rgb32_and_load_dataset_mnist() -> None:
    spec = DataSpec(transform="rgb32", num_devices=5, seed=2)
    train, test = load_dataset(spec)
    assert train.x.shape == (4000, 3, 32, 32) and test.x.shape == (1000, 3, 32, 32)
    assert torch.equal(train.x[:, 0], train.x[:, 2])
    assert dataset_input_shape(spec) == (3, 32, 32) == tuple(train.x.shape[1:])
    assert dataset_input_shape(DataSpec()) == (1, 28, 28)
    assert dataset_num_classes(spec) == 10
    shards = [device_shard(spec, train, i) for i in range(5)]
    assert sum(len(s) for s in shards) == len(train)
    assert to_rgb32(train) is train  # already rgb32


def test_subset_and_label_counts() -> None:
    ds = ArrayDataset(torch.zeros(6, 1, 2, 2), torch.tensor([0, 1, 1, 2, 2, 2]), 4, list("abcdef"))
    sub = ds.subset(np.array([5, 0]))
    assert sub.y.tolist() == [2, 0] and sub.writers == ["f", "a"]
    assert ds.label_counts().tolist() == [1, 2, 3, 0] and ds.label_counts().dtype == np.int64


# ------------------------------------------------------------------ CIFAR fixtures
def _write_batch(path: Path, n: int, label_key: bytes, num_classes: int, seed: int, protocol: int) -> None:
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"fixture",
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        label_key: [int(v) for v in rng.integers(0, num_classes, size=n)],
        b"filenames": [b"img%d.png" % i for i in range(n)],
    }
    if label_key == b"fine_labels":
        batch[b"coarse_labels"] = [0] * n
    with open(path, "wb") as fh:
        pickle.dump(batch, fh, protocol=protocol)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_loader(tmp_path: Path, protocol: int) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        _write_batch(folder / f"data_batch_{i}", 4, b"labels", 10, seed=i, protocol=protocol)
    _write_batch(folder / "test_batch", 5, b"labels", 10, seed=9, protocol=protocol)
    train = load_cifar(tmp_path, 10, "train")  # parent folder accepted
    test = load_cifar(folder, 10, "test")  # extracted folder accepted
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (5, 3, 32, 32)
    assert train.num_classes == 10 and train.y.dtype == torch.int64
    # row layout is R(1024) G(1024) B(1024), row-major 32x32; check layout and normalisation
    with open(folder / "data_batch_1", "rb") as fh:
        raw = pickle.load(fh)[b"data"]
    expected = (raw[0, 1024] / 255.0 - 0.4822) / 0.2435  # green channel, first pixel
    assert train.x[0, 1, 0, 0].item() == pytest.approx(expected, abs=1e-5)
    spec = DataSpec(dataset="cifar10", root=str(tmp_path), partition="iid", num_devices=4)
    tr, te = load_dataset(spec)
    assert len(tr) == 20 and len(te) == 5
    assert dataset_input_shape(spec) == (3, 32, 32)
    assert sum(len(device_shard(spec, tr, i)) for i in range(4)) == 20


def test_cifar100_loader(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    _write_batch(folder / "train", 20, b"fine_labels", 100, seed=1, protocol=2)
    _write_batch(folder / "test", 6, b"fine_labels", 100, seed=2, protocol=2)
    spec = DataSpec(dataset="cifar100", root=str(folder), transform="rgb32", partition="iid", num_devices=2)
    train, test = load_dataset(spec)
    assert train.x.shape == (20, 3, 32, 32) and len(test) == 6 and train.num_classes == 100
    assert dataset_num_classes(spec) == 100
    assert train.y.max().item() < 100


def test_cifar_restricted_unpickler_rejects_code(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    for name in ("train", "test"):
        with open(folder / name, "wb") as fh:
            pickle.dump({b"data": Evil(), b"fine_labels": []}, fh)
    with pytest.raises(pickle.UnpicklingError):
        load_cifar(folder, 100, "train")


def test_missing_roots_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_dataset(DataSpec(dataset="cifar10"))  # no root
    with pytest.raises(ValueError):
        load_dataset(DataSpec(dataset="cifar10", root=str(tmp_path / "nope")))
    with pytest.raises(ValueError):
        load_cifar(tmp_path, 10, "train")  # exists but empty
    with pytest.raises(ValueError):
        load_femnist(tmp_path, "train")


# ------------------------------------------------------------------ FEMNIST fixture
def _write_leaf(path: Path, users: dict[str, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    user_data = {
        u: {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, size=n).tolist()}
        for u, n in users.items()
    }
    blob = {"users": list(users), "num_samples": list(users.values()), "user_data": user_data}
    path.write_text(json.dumps(blob))


def test_femnist_loader_and_natural_partition(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    _write_leaf(tmp_path / "train" / "all_data_0.json", {"f0001": 3, "f0002": 4}, seed=0)
    _write_leaf(tmp_path / "train" / "all_data_1.json", {"f0003": 2, "f0004": 5}, seed=1)
    _write_leaf(tmp_path / "test" / "all_data_0.json", {"f0001": 1, "f0003": 2}, seed=2)
    train = load_femnist(tmp_path, "train")
    assert train.x.shape == (14, 1, 28, 28) and train.num_classes == 62
    assert train.writers == ["f0001"] * 3 + ["f0002"] * 4 + ["f0003"] * 2 + ["f0004"] * 5
    blob = json.loads((tmp_path / "train" / "all_data_0.json").read_text())
    px = blob["user_data"]["f0001"]["x"][0][30]
    assert train.x[0, 0, 1, 2].item() == pytest.approx((px - 0.1307) / 0.3081, abs=1e-5)
    assert train.y[:3].tolist() == blob["user_data"]["f0001"]["y"]

    spec = DataSpec(dataset="femnist", root=str(tmp_path), partition="natural", num_devices=2)
    tr, te = load_dataset(spec)
    assert len(tr) == 14 and len(te) == 3 and dataset_num_classes(spec) == 62
    assert dataset_input_shape(spec) == (1, 28, 28)
    shards = [device_shard(spec, tr, i) for i in range(2)]
    assert sum(len(s) for s in shards) == 14
    assert not set(shards[0].writers or []) & set(shards[1].writers or [])
    with pytest.raises(ValueError):
        device_shard(spec.model_copy(update={"num_devices": 5}), tr, 0)  # 4 writers < 5 devices


def test_cifar_pickle_from_numpy1_loads(tmp_path: Path) -> None:
    """Official CIFAR files (numpy 1 era) name numpy.core.*; the allow-list maps it to numpy 2."""
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 3), ("test", 2)):
        _write_batch(folder / name, n, b"fine_labels", 100, seed=n, protocol=2)
        blob = (folder / name).read_bytes().replace(b"numpy._core.", b"numpy.core.")
        assert b"numpy.core.multiarray" in blob
        (folder / name).write_bytes(blob)
    assert load_cifar(folder, 100, "train").x.shape == (3, 3, 32, 32)


def test_max_samples_takes_the_same_seeded_subset_everywhere():
    from shared.data import DataSpec, load_dataset

    spec = DataSpec(max_samples=300, seed=3)
    a, _ = load_dataset(spec)
    b, _ = load_dataset(spec)
    full, _ = load_dataset(DataSpec(seed=3))
    assert len(a) == 300 and torch.equal(a.y, b.y) and torch.equal(a.x, b.x)
    other, _ = load_dataset(DataSpec(max_samples=300, seed=4))
    assert not torch.equal(a.y, other.y) or not torch.equal(a.x, other.x)
    assert len(full) == 4000


def test_public_set_is_stratified_disjoint_from_device_data_and_repeatable():
    from shared.data import DataSpec, load_dataset, load_public_set

    spec = DataSpec(public_samples=200, seed=2)
    train, test = load_dataset(spec)
    public = load_public_set(spec)
    assert len(public) == 200 and len(train) == 4000 - 200 and len(test) == 1000
    assert public.label_counts().tolist() == [20] * 10
    full, _ = load_dataset(DataSpec(seed=2))
    # every public image is one of the training images, and none of them is left in `train`
    as_rows = {row.numpy().tobytes() for row in train.x.flatten(1)}
    assert not any(row.numpy().tobytes() in as_rows for row in public.x.flatten(1))
    assert torch.equal(load_public_set(spec).y, public.y)


def test_unknown_device_transform_is_refused():
    from shared.data import DataSpec
    from shared.data.device_transforms import check_device_transform
    from shared.run_config import load_run_config

    with pytest.raises(ValueError, match="unknown device_transform 'nope'"):
        check_device_transform(DataSpec(device_transform="nope", num_devices=2, partition="iid"))
    with pytest.raises(ValueError, match="unknown device_transform 'nope'"):
        load_run_config({"data": {"device_transform": "nope", "num_devices": 2, "partition": "iid"}})


@pytest.mark.parametrize("transform, params, message", [
    ("rotation", {"angles": "x"}, "angles"),
    ("gaussian_noise", {"sigma": -1}, "sigma"),
    ("gaussian_noise", {"bogus": 1}, "bogus"),
    ("color", {}, "rgb32"),
])
def test_bad_device_transform_parameters_fail_when_the_config_is_read(transform, params, message):
    from shared.run_config import load_run_config

    data = {"device_transform": transform, "num_devices": 3, "partition": "iid"}
    with pytest.raises(ValueError, match=message):
        load_run_config({"algorithm": "fedavg", "data": {**data, "device_transform_params": params}})
    load_run_config({"algorithm": "fedavg",   # the defaults are valid
                     "data": {**data, **({"transform": "rgb32"} if transform == "color" else {})}})


def test_concurrent_first_loads_parse_the_file_once(monkeypatch) -> None:
    """An agent's device threads all start at once; only one of them may parse the embedded file."""
    import threading

    from shared.data import datasets

    calls = []
    real = datasets.np.loadtxt

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets.np, "loadtxt", counting)
    for cached in (datasets._embedded_mnist_raw, datasets._embedded_mnist_split, datasets._load_pair_cached):
        cached.cache_clear()
    spec = DataSpec(dataset="mnist")
    threads = [threading.Thread(target=load_dataset, args=(spec,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_writer_runs_read_as_the_list_they_stand_for_and_partition_the_same():
    import numpy as np

    from shared.data.datasets import WriterRuns
    from shared.data.partition import partition_natural

    names, counts = ["0", "1", "2", "10"], np.array([3, 0, 2, 4])
    runs = WriterRuns(names, counts)
    listed = [name for name, n in zip(names, counts) for _ in range(n)]
    assert len(runs) == len(listed) == 9 and list(runs) == listed
    assert [runs[i] for i in range(-9, 9)] == listed[-9:] + listed
    assert runs[2:7] == listed[2:7] and runs[::-2] == listed[::-2]
    for bad in (9, -10):
        with pytest.raises(IndexError):
            runs[bad]
    assert all(np.array_equal(a, b) for a, b in zip(partition_natural(runs, 2, 3), partition_natural(listed, 2, 3)))
    assert len(WriterRuns([], np.array([], dtype=np.int64))) == 0
