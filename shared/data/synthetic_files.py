"""Synthetic(alpha, beta) kept in files: generated once per machine, read through memory maps.

Every process of a run (the Fed Server, each agent) derives the same Synthetic data from the run's
settings. At 10,000 generated devices that is 4.9 M samples, 1.2 GB as float32, and seconds of one
core to draw (benchmarks/results/2026-12-01_population-data-cache/README.md). Generated in each
process, it cost each process that time and held the whole set
in its memory, although a device trains on its own rows only, and only while it has a task.

Here the first process that needs a data set generates it into a cache folder, one device at a
time, and every process then maps the files. A process pays in memory for the rows it reads (a
device's rows while it trains), not for the set, and gives the rows' memory back once it has
copied them (:meth:`MappedRows.release`). Processes that start together generate it once: the
others wait on a file lock and then map what it wrote. The folder appears complete or not at all
(written under another name, then renamed).

The cache folder is ``$SFL_DATA_CACHE`` when set; else ``$XDG_CACHE_HOME/sfl-data`` (default
``~/.cache/sfl-data``) when it can be created; else ``sfl-data-<uid>`` in the system's temporary
folder (a container with a read-only home). Each data set is one subfolder named after its
settings; deleting it costs only its generation the next time.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from shared.data.synthetic import SYNTHETIC_DIM, device_parts, train_size

__all__ = ["MappedRows", "SyntheticArrays", "data_cache_folder", "synthetic_arrays"]

#: Bumped when the files' layout changes, so an old cache is not read as the new one.
_LAYOUT = 1
_PARTS = ("x_train", "y_train", "x_test", "y_test")
#: Linux's default ``fault_around_bytes``: a read fault maps up to this window of cached pages.
_FAULT_AROUND = 64 * 1024


class MappedRows:
    """The rows of one ``.npy`` file (C order), memory-mapped copy-on-write: ``array`` is
    writable for its holder and never written back. Pages of the file that a process has read stay
    in its memory until it gives them back with :meth:`release`; a later read maps them again."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version != (1, 0):
                raise ValueError(f"{path}: .npy version {version}, expected 1.0")
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
            if fortran_order:
                raise ValueError(f"{path}: Fortran order, expected C order")
            offset = f.tell()
            self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._offset = offset
        self._row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        count = int(np.prod(shape, dtype=np.int64))
        self.array: np.ndarray = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def release(self, first: int, last: int) -> None:
        """Give back the memory of rows ``first..last`` (inclusive), of pages no row was written to
        (a written page would lose the write: :class:`SyntheticArrays` are read-only in use)."""
        start = self._offset + first * self._row_bytes
        end = self._offset + (last + 1) * self._row_bytes
        # Widened to the windows a read maps: the kernel maps the cached pages around a faulting
        # one (fault-around), so the rows' neighbours were mapped by this read too.
        start = max(0, start - start % _FAULT_AROUND)
        end = min(len(self._map), end + (-end) % _FAULT_AROUND)
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass(frozen=True)
class SyntheticArrays:
    """One Synthetic draw: ``samples`` (n_i per generated device, in memory) and the unions of the
    devices' 80/20 parts in device order, mapped from the files: features float32 [N, 60], labels
    int64 [N]."""

    samples: np.ndarray
    x_train: MappedRows
    y_train: MappedRows
    x_test: MappedRows
    y_test: MappedRows


def data_cache_folder() -> Path:
    """Where generated data sets are kept (module docstring), created owner-only if missing."""
    configured = os.environ.get("SFL_DATA_CACHE")
    if configured:
        folder = Path(configured).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"SFL_DATA_CACHE={configured!r} cannot be created: {exc.strerror}") from exc
        return folder
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sfl-data"
    for folder in (home_cache, Path(tempfile.gettempdir()) / f"sfl-data-{os.getuid()}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK | os.X_OK):
            return folder
    raise OSError(f"no writable folder for generated data sets ({home_cache} nor the temporary folder): "
                  "set SFL_DATA_CACHE to one")


def synthetic_arrays(num_devices: int, alpha: float, beta: float, iid: bool, seed: int) -> SyntheticArrays:
    """The Synthetic draw of these settings (``shared.data.synthetic.device_parts``), generated
    into the cache folder unless it is there already, and mapped from it."""
    name = f"synthetic-v{_LAYOUT}-n{int(num_devices)}-a{float(alpha)!r}-b{float(beta)!r}-{'iid' if iid else 'niid'}-s{int(seed)}"
    root = data_cache_folder()
    folder = root / name
    if not folder.is_dir():
        with open(root / f"{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
            if not folder.is_dir():
                _generate(folder, num_devices, alpha, beta, iid, seed)
    return SyntheticArrays(np.load(folder / "samples.npy"), *(MappedRows(folder / f"{part}.npy") for part in _PARTS))


def _generate(folder: Path, num_devices: int, alpha: float, beta: float, iid: bool, seed: int) -> None:
    """Write the draw's files into a fresh folder beside ``folder``, then rename it to ``folder``.
    One device's float64 draws exist at a time; each part is cast to float32 as it is written."""
    samples, devices = device_parts(num_devices, alpha, beta, iid, seed)
    n_train = sum(train_size(int(n)) for n in samples)
    n_test = int(samples.sum()) - n_train
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        np.save(staging / "samples.npy", samples)
        shapes = {"x_train": (n_train, SYNTHETIC_DIM), "y_train": (n_train,),
                  "x_test": (n_test, SYNTHETIC_DIM), "y_test": (n_test,)}
        dtypes = {"x_train": "<f4", "y_train": "<i8", "x_test": "<f4", "y_test": "<i8"}
        files = {part: _open_npy(staging / f"{part}.npy", dtypes[part], shapes[part]) for part in _PARTS}
        try:
            for parts in devices:
                for part, values in zip(_PARTS, parts):
                    files[part].write(np.ascontiguousarray(values, dtype=dtypes[part]).tobytes())
        finally:
            for f in files.values():
                f.close()
        staging.chmod(0o755)
        os.rename(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _open_npy(path: Path, dtype: str, shape: tuple[int, ...]) -> BinaryIO:
    """A new ``.npy`` file of ``shape``/``dtype``, its header written, open for the values in C order."""
    f = open(path, "wb")
    np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape})
    return f
