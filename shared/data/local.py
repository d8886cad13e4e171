"""Data that lives on the device (``dataset="local"``): loaders for local files and the run's input transform.

Four sources make one device's :class:`ArrayDataset` (docs/data.md):

* an ``.npz`` file with arrays ``x`` (numeric, ``[N, *raw_shape]``) and ``y`` (integer labels, or
  for a regression task float targets ``[N]`` or ``[N, k]``);
* a ``.csv`` file with a header row: the column ``data.label_column`` holds the labels, the others
  (numbers, in header order) make one sample of ``data.input_shape`` per row;
* a folder of images with one sub-folder per class (needs Pillow);
* a user function by import path ``package.module:function``, called with the ``--data-arg``
  strings as keywords, returning ``(x, y)`` or an :class:`ArrayDataset` (both taken as raw samples).

Every source goes through the same steps (:func:`model_inputs`): raw samples to the run's layout
(:func:`to_layout`), the check that they can make samples of ``data.input_shape``, the run's
:class:`InputTransform` (:func:`apply_input_transform`), then the check that each sample has
``data.input_shape``; and the labels must be ``0..num_classes-1`` (a regression task's targets:
finite numbers, ``num_classes`` of them per sample). Anything wrong raises one
:class:`DataError` naming the file and the field, before the device registers.

What a file declares is checked against :class:`FileLimits` before it is decompressed or decoded
(an ``.npz`` member's npy header and zip entry, a ``.csv`` file's size, an image's header), so a
file that would unpack to more than the device can hold is refused in the same way.

Import paths come only from the operator's command line, never from a message.
"""
from __future__ import annotations

import csv
import errno
import math
import os
import warnings
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib import format as npformat

from shared.data.datasets import ArrayDataset
from shared.data.limits import FileLimits
from shared.data.spec import DataSpec, InputTransform
from shared.imports import import_callable, is_import_path
from shared.losses import Task

__all__ = [
    "DataError",
    "FileLimits",
    "LocalSource",
    "apply_input_transform",
    "data_sources",
    "device_sources",
    "load_csv",
    "load_image_folder",
    "load_local",
    "load_npz",
    "load_samples",
    "model_inputs",
    "to_layout",
]

#: File name endings read as images in a class folder (others, and hidden files, are ignored).
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
_PILLOW_HINT = "reading an image folder needs Pillow: pip install 's2fl-testbed[images]'"
#: Data files by their name's ending (a file with another ending is refused by name, not guessed at).
DATA_FILE_SUFFIXES = (".npz", ".csv")


class DataError(ValueError):
    """A device's local data cannot be used; the message names the file (or function) and the field."""


# --------------------------------------------------------------------------------------------
# Raw samples -> model inputs
# --------------------------------------------------------------------------------------------
def to_layout(x: np.ndarray | torch.Tensor, input_shape: list[int] | tuple[int, ...], where: str) -> torch.Tensor:
    """Raw samples ``[N, *raw]`` as a tensor in the run's layout, before the transform.

    When ``input_shape`` has three sizes ``[C, H, W]`` (images), raw samples may be ``[H, W]``
    (one channel: becomes ``[1, H, W]``), ``[C, H, W]`` (channels first: kept) or ``[H, W, C]``
    (channels last, e.g. uint8 photos: moved to ``[C, H, W]``). A raw shape whose first size is C
    is read as channels first, so a ``[3, H, 3]`` array stays as it is. Otherwise (tabular
    ``[N, D]``, or any other rank) the raw samples are kept as they are. Sizes are checked after
    the transform (which may resize), by :func:`model_inputs`.
    """
    # np.require copies a read-only array (Pillow's, a memory-mapped one): torch refuses to share it quietly.
    t = torch.as_tensor(np.require(x, requirements="W")) if not isinstance(x, torch.Tensor) else x
    if len(input_shape) == 3:
        channels = input_shape[0]
        if t.ndim == 3:
            t = t.unsqueeze(1)
        elif t.ndim == 4 and t.shape[1] != channels and t.shape[3] == channels:
            t = t.permute(0, 3, 1, 2)
        elif t.ndim != 4:
            raise DataError(f"{where}: field 'x' has samples of shape {list(t.shape[1:])}; images for "
                            f"input_shape {list(input_shape)} must be [H, W], [C, H, W] or [H, W, C]")
    return t.contiguous()


def apply_input_transform(x: torch.Tensor, transform: InputTransform) -> torch.Tensor:
    """The run's input transform on a batch ``[N, ...]``: float32, ``resize`` (images ``[N, C, H, W]``
    only, bilinear), times ``scale``, then per channel (dimension 1) ``(x - mean) / std``.

    Every device applies the same one (it is part of the run and of the model fingerprint).
    """
    out = x.to(torch.float32)
    if transform.resize is not None:
        if out.ndim != 4:
            raise DataError(f"input_transform.resize is for images [N, C, H, W]; these samples are "
                            f"{list(out.shape[1:])}")
        if tuple(out.shape[2:]) != tuple(transform.resize):
            out = F.interpolate(out, size=tuple(transform.resize), mode="bilinear", align_corners=False)
    if transform.scale != 1.0:
        out = out * transform.scale
    if transform.mean is not None and transform.std is not None:
        channels = out.shape[1] if out.ndim > 1 else 1
        for name, values in (("mean", transform.mean), ("std", transform.std)):
            if len(values) not in (1, channels):
                raise DataError(f"input_transform.{name} has {len(values)} values; the samples have "
                                f"{channels} channels (give one value or one per channel)")
        view = (1, -1) + (1,) * max(0, out.ndim - 2)
        mean = torch.tensor(transform.mean, dtype=torch.float32).view(view)
        std = torch.tensor(transform.std, dtype=torch.float32).view(view)
        out = (out - mean) / std
    return out


def model_inputs(raw: np.ndarray | torch.Tensor, spec: DataSpec, where: str) -> torch.Tensor:
    """Raw samples of ``where`` as model inputs: the layout, the check that the samples fit
    ``data.input_shape`` (:func:`_check_layout`), the run's transform, then the check that every
    sample has exactly ``data.input_shape``."""
    assert spec.input_shape is not None
    try:
        laid_out = to_layout(raw, spec.input_shape, where)
        _check_layout(laid_out, spec, where)
        x = apply_input_transform(laid_out, spec.input_transform)
    except DataError as exc:
        message = str(exc)
        raise DataError(message if message.startswith(f"{where}:") else f"{where}: {message}") from None
    if list(x.shape[1:]) != list(spec.input_shape):
        raise DataError(_shape_mismatch(where, list(x.shape[1:]), spec.input_shape))
    return x


def _check_layout(x: torch.Tensor, spec: DataSpec, where: str) -> None:
    """Refuse samples (in the run's layout) that the transform cannot make ``data.input_shape``,
    before it runs: a transposed table would otherwise be blamed on ``input_transform.mean``.
    Only ``input_transform.resize`` changes a sample's shape, and only an image's height and width."""
    assert spec.input_shape is not None
    resized = spec.input_transform.resize is not None and len(spec.input_shape) == 3
    expected: list[int | None] = [spec.input_shape[0], None, None] if resized else list(spec.input_shape)
    shape = list(x.shape)
    if len(shape) == len(expected) + 1 and all(e is None or e == n for e, n in zip(expected, shape[1:])):
        return
    sizes = ", ".join(str(e) if e is not None else "H" if i == 1 else "W" for i, e in enumerate(expected))
    raise DataError(f"{where}: field 'x' has shape {shape}, expected [N, {sizes}] (N samples of data.input_shape "
                    f"{list(spec.input_shape)}{', any H and W before the resize' if resized else ''}; the samples "
                    f"are along the first axis)")


def _shape_mismatch(where: str, shape: list[int], input_shape: list[int]) -> str:
    """The message for samples of ``shape`` (after the transform) in a run of ``input_shape``."""
    return (f"{where}: field 'x' gives samples of shape {shape} after data.input_transform, but "
            f"data.input_shape is {list(input_shape)}")


def load_samples(x: Any, y: Any, spec: DataSpec, where: str, task: Task = "classification") -> ArrayDataset:
    """Check raw ``x`` / ``y`` (arrays or tensors) and turn them into the run's model inputs.

    The one path every source takes, so each check exists once: y integer 1-D labels in range (a
    regression ``task``: finite float targets, see :func:`_regression_targets`), x numeric and
    finite, equal lengths, at least one sample, and the shape after the transform.
    """
    assert spec.num_classes is not None and spec.input_shape is not None  # DataSpec enforces for "local"
    x_np = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    y_np = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if task == "regression":
        y_np = _regression_targets(y_np, spec.num_classes, where)
    elif y_np.dtype == np.bool_ or not np.issubdtype(y_np.dtype, np.integer):
        raise DataError(f"{where}: field 'y' must hold integer class labels, got dtype {y_np.dtype} (float targets "
                        f"need a regression loss, docs/models.md \"Loss and task\")")
    elif y_np.ndim != 1:
        raise DataError(f"{where}: field 'y' must be one label per sample (shape [N]), got shape {list(y_np.shape)}")
    if x_np.dtype == np.bool_ or not (np.issubdtype(x_np.dtype, np.integer) or np.issubdtype(x_np.dtype, np.floating)):
        raise DataError(f"{where}: field 'x' must be numeric, got dtype {x_np.dtype}")
    if x_np.ndim < 2:
        raise DataError(f"{where}: field 'x' must be [N, ...] (one row per sample), got shape {list(x_np.shape)}")
    if x_np.shape[0] != y_np.shape[0]:
        raise DataError(f"{where}: fields 'x' and 'y' differ in length ({x_np.shape[0]} samples, {y_np.shape[0]} labels)")
    if y_np.shape[0] == 0:
        raise DataError(f"{where}: no samples (fields 'x' and 'y' are empty)")
    if np.issubdtype(x_np.dtype, np.floating) and not np.isfinite(x_np).all():
        bad = int(np.flatnonzero(~np.isfinite(x_np.reshape(x_np.shape[0], -1)).all(axis=1))[0])
        raise DataError(f"{where}: field 'x' holds NaN or infinite values (first in sample {bad})")
    if task == "regression":
        return ArrayDataset(x=model_inputs(x_np, spec, where), y=torch.from_numpy(y_np), num_classes=spec.num_classes)
    lo, hi = int(y_np.min()), int(y_np.max())
    if lo < 0 or hi >= spec.num_classes:
        raise DataError(f"{where}: field 'y' has labels {lo}..{hi}, outside 0..{spec.num_classes - 1} "
                        f"(data.num_classes = {spec.num_classes})")
    return ArrayDataset(x=model_inputs(x_np, spec, where), y=torch.from_numpy(y_np.astype(np.int64)), num_classes=spec.num_classes)


def _regression_targets(y: np.ndarray, outputs: int, where: str) -> np.ndarray:
    """A regression task's targets as float32: ``[N]`` when the model has one output
    (``data.num_classes`` 1; ``[N, 1]`` is taken too), else ``[N, outputs]``; numeric and finite."""
    if y.dtype == np.bool_ or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"{where}: field 'y' must hold numeric targets, got dtype {y.dtype}")
    if outputs == 1 and y.ndim == 2 and y.shape[1] == 1:
        y = y.reshape(-1)
    wanted = [y.shape[0]] if outputs == 1 else [y.shape[0], outputs]
    if y.ndim == 0 or list(y.shape) != wanted:
        raise DataError(f"{where}: field 'y' must be {'[N]' if outputs == 1 else f'[N, {outputs}]'} targets "
                        f"(data.num_classes = {outputs} model outputs), got shape {list(y.shape)}")
    with np.errstate(over="ignore"):
        targets = np.ascontiguousarray(y, dtype=np.float32)
    if not np.isfinite(targets).all():
        bad = int(np.flatnonzero(~np.isfinite(targets.reshape(len(targets), -1)).all(axis=1))[0])
        raise DataError(f"{where}: field 'y' holds NaN or infinite targets (first in sample {bad})")
    return targets


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
def load_npz(path: str | Path, spec: DataSpec, limits: FileLimits | None = None,
             task: Task = "classification") -> ArrayDataset:
    """An ``.npz`` file with arrays ``x`` and ``y`` as the run's model inputs (a device's data, or
    the Fed Server's ``data.test_file``) for the run's ``task``. Never unpickles: object arrays are
    refused. Sizes are checked against ``limits`` (default :class:`FileLimits`) before anything is
    decompressed."""
    p = _data_file(path)
    arrays = _read_npz_arrays(p, ("x", "y"), limits or FileLimits())
    return load_samples(arrays["x"], arrays["y"], spec, str(p), task)


def _data_file(path: str | Path) -> Path:
    """``path`` as a Path, once it is known to be a file that is not empty."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{p}: data file not found")
    if p.stat().st_size == 0:
        raise DataError(f"{p}: data file is empty")
    return p


def _read_npz_arrays(p: Path, keys: tuple[str, ...], limits: FileLimits) -> dict[str, np.ndarray]:
    """The arrays ``keys`` of the ``.npz`` file ``p``, each member's npy header and zip entry checked
    first (:func:`_member_bytes`), and their declared bytes together against ``limits.max_bytes``.

    Reads the archive with :mod:`zipfile` and :func:`numpy.lib.format.read_array` rather than
    ``numpy.load``, which allocates whatever a header declares (a 2^40-element header: a
    MemoryError) and decompresses whatever a member holds (2.5 GB from a 2.4 MB file) before
    anything could be checked. A member is found by its key or as ``key.npy``, as ``numpy.load``
    finds it.
    """
    with p.open("rb") as fh:
        if fh.read(len(npformat.MAGIC_PREFIX)) == npformat.MAGIC_PREFIX:
            raise DataError(f"{p}: not an .npz archive (a single .npy array); save with numpy.savez(path, x=..., y=...)")
    try:
        archive = zipfile.ZipFile(p)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:   # a text file, a truncated archive
        raise DataError(f"{p}: not a readable .npz file ({exc})") from None
    with archive:
        names = archive.namelist()
        members = {key: key if key in names else f"{key}.npy" for key in keys}
        missing = [key for key, name in members.items() if name not in names]
        if missing:
            held = sorted(name.removesuffix(".npy") for name in names)
            raise DataError(f"{p}: missing array {' and '.join(repr(k) for k in missing)} "
                            f"(the file holds {held}; it needs {' and '.join(repr(k) for k in keys)})")
        declared = {key: _member_bytes(archive, archive.getinfo(name), f"{p}: array {key!r}", limits)
                    for key, name in members.items()}
        if sum(declared.values()) > limits.max_bytes:
            raise DataError(f"{p}: arrays {' and '.join(repr(k) for k in keys)} hold {sum(declared.values())} "
                            f"bytes together, over the limit of {limits.max_bytes} bytes (--max-data-bytes)")
        arrays = {}
        for key, name in members.items():
            try:
                with archive.open(name) as stream:
                    arrays[key] = npformat.read_array(stream, allow_pickle=False)
            except _UNREADABLE as exc:   # damaged data: a bad CRC, or shorter than its header says
                raise DataError(f"{p}: array {key!r} is not readable ({exc})") from None
        return arrays


#: What zipfile and numpy raise for a damaged archive member (an encrypted one: RuntimeError; an
#: unknown compression method: NotImplementedError).
_UNREADABLE = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError)


def _member_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str, limits: FileLimits) -> int:
    """The bytes of the array in the archive member ``info``, from its npy header, once the header
    and the entry are checked: no object dtype (reading it would unpickle), neither the header's
    shape x item size nor the entry's uncompressed size over ``limits.max_bytes``, and the two
    agreeing. Only the header is decompressed."""
    try:
        with archive.open(info) as stream:
            version = npformat.read_magic(stream)
            read_header = _NPY_HEADER_READERS.get(version)
            if read_header is None:
                raise ValueError(f"npy format version {version[0]}.{version[1]}; numpy.savez writes 1.0 or 2.0")
            shape, _, dtype = read_header(stream)
            header_bytes = stream.tell()
    except _UNREADABLE as exc:
        raise DataError(f"{where} is not readable ({exc})") from None
    if dtype.hasobject:
        raise DataError(f"{where} has dtype {dtype}, which holds Python objects: refused (reading it would unpickle)")
    stored = info.file_size - header_bytes
    if stored > limits.max_bytes:
        raise DataError(f"{where} unpacks to {stored} bytes, over the limit of {limits.max_bytes} bytes (--max-data-bytes)")
    declared = math.prod(shape) * dtype.itemsize
    if declared > limits.max_bytes:
        raise DataError(f"{where} declares shape {list(shape)} of {dtype} ({declared} bytes), over the limit of "
                        f"{limits.max_bytes} bytes (--max-data-bytes)")
    if declared != stored:
        raise DataError(f"{where}: its header declares {declared} bytes (shape {list(shape)} of {dtype}) but the "
                        f"archive holds {stored}")
    return declared


_NPY_HEADER_READERS = {(1, 0): npformat.read_array_header_1_0, (2, 0): npformat.read_array_header_2_0}


#: Cells the CSV reader holds as text at once: each block of rows becomes one float32 array, so the
#: text's Python strings (some 50 bytes a cell) are held for a block at a time only.
_CSV_BLOCK_CELLS = 2 ** 18


def load_csv(path: str | Path, spec: DataSpec, limits: FileLimits | None = None,
             task: Task = "classification") -> ArrayDataset:
    """A ``.csv`` file (UTF-8, comma-separated, a header row) as the run's model inputs: the column
    named ``data.label_column`` holds integer labels (a regression ``task``: the one float target,
    so ``data.num_classes`` must be 1); every other column, in header order, is a
    number, and a row's numbers make one sample of ``data.input_shape``. The file's size is checked
    against ``limits.max_bytes`` (default :class:`FileLimits`) before it is read: a cell takes at
    least two bytes of text (a digit and a separator) and four as float32, so the samples hold at
    most twice the file's bytes."""
    assert spec.input_shape is not None
    p = _data_file(path)
    if task == "regression" and spec.num_classes != 1:
        raise DataError(f"{p}: a .csv file holds one target column (data.label_column), but data.num_classes is "
                        f"{spec.num_classes} model outputs: use .npz files for several targets per sample")
    label_dtype = np.float32 if task == "regression" else np.int64
    limits = limits or FileLimits()
    size = p.stat().st_size
    if size > limits.max_bytes:
        raise DataError(f"{p}: {size} bytes, over the limit of {limits.max_bytes} bytes (--max-data-bytes)")
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    try:
        with p.open(newline="", encoding="utf-8-sig") as fh:   # -sig: a byte-order mark (Excel's) is not a name
            reader = csv.reader(fh)
            header = [name.strip() for name in next(reader, [])]
            label_at = _csv_label_column(p, header, spec)
            block: list[list[str]] = []
            lines: list[int] = []
            for row in reader:
                if not row:   # a blank line
                    continue
                if len(row) != len(header):
                    raise DataError(f"{p}: line {reader.line_num} has {len(row)} cells, the header {len(header)} "
                                    f"(every row needs one cell per column)")
                block.append(row)
                lines.append(reader.line_num)
                if len(block) * len(header) >= _CSV_BLOCK_CELLS:
                    _convert_csv_block(p, header, label_at, label_dtype, block, lines, xs, ys)
                    block, lines = [], []
            _convert_csv_block(p, header, label_at, label_dtype, block, lines, xs, ys)
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not a UTF-8 text .csv file ({exc})") from None
    except csv.Error as exc:   # a NUL byte (a binary file), a cell over the csv module's field limit
        raise DataError(f"{p}: not a readable .csv file (line {reader.line_num}: {exc})") from None
    x = np.concatenate(xs) if xs else np.zeros((0, len(header) - 1), dtype=np.float32)
    y = np.concatenate(ys) if ys else np.zeros(0, dtype=label_dtype)
    return load_samples(x.reshape(len(x), *spec.input_shape), y, spec, str(p), task)


def _csv_label_column(p: Path, header: list[str], spec: DataSpec) -> int:
    """The index of the label column in ``header``, once the header names each column once and
    leaves as many feature columns as one sample of ``data.input_shape`` holds."""
    assert spec.input_shape is not None
    shown = header if len(header) <= 12 else [*header[:12], f"... ({len(header)} columns)"]
    twice = sorted(name for name, count in Counter(header).items() if count > 1)
    if twice:
        raise DataError(f"{p}: the header names column(s) {twice} more than once")
    if spec.label_column not in header:
        raise DataError(f"{p}: no label column {spec.label_column!r} (data.label_column); the header row names "
                        f"{shown}")
    features, needed = len(header) - 1, math.prod(spec.input_shape)
    if features != needed:
        raise DataError(f"{p}: {features} feature columns (all but {spec.label_column!r}), but one sample of "
                        f"data.input_shape {list(spec.input_shape)} is {needed} numbers")
    return header.index(spec.label_column)


def _convert_csv_block(p: Path, header: list[str], label_at: int, label_dtype: type, rows: list[list[str]],
                       lines: list[int], xs: list[np.ndarray], ys: list[np.ndarray]) -> None:
    """Append the features (float32) and labels (``label_dtype``: int64 class labels, float32
    regression targets) of ``rows`` (read from ``lines``) to ``xs`` and ``ys``; a cell that is not
    a number (or a label that is not an integer) is named by its line and column."""
    if not rows:
        return
    labels = [row.pop(label_at) for row in rows]
    try:
        with np.errstate(over="ignore"):   # a number past float32's range is inf, refused by load_samples
            x = np.array(rows, dtype=np.float32)
            y: np.ndarray = np.array(labels, dtype=label_dtype)
    except (ValueError, OverflowError):
        _raise_first_bad_cell(p, header, label_at, label_dtype, rows, labels, lines)
    xs.append(x)
    ys.append(y)


def _raise_first_bad_cell(p: Path, header: list[str], label_at: int, label_dtype: type, rows: list[list[str]],
                          labels: list[str], lines: list[int]) -> NoReturn:
    """The :class:`DataError` naming the first cell of ``rows`` (features without the label) and
    ``labels`` that does not convert, by its line and column."""
    features = header[:label_at] + header[label_at + 1:]
    for line, row, label in zip(lines, rows, labels):
        for name, cell in zip(features, row):
            _check_cell(cell, np.float32, f"{p}: line {line}, column {name!r}: {cell!r} is not a number")
        _check_cell(label, label_dtype, f"{p}: line {line}, column {header[label_at]!r}: {label!r} is not "
                                        + ("a number" if label_dtype is np.float32 else "an integer class label"))
    raise AssertionError("a block that failed to convert has a cell that does not")


def _check_cell(cell: str, dtype: type, message: str) -> None:
    """Raise :class:`DataError` with ``message`` when ``cell`` does not convert to ``dtype`` (the
    conversion :func:`_convert_csv_block` makes for a whole block)."""
    try:
        with np.errstate(over="ignore"):
            np.array([cell], dtype=dtype)
    except (ValueError, OverflowError):
        raise DataError(message) from None


def _link_problem(entry: Path, root: Path) -> str | None:
    """Why ``entry``, found in a folder inside the resolved folder ``root``, may not be followed, or
    None: a symbolic link whose target is outside ``root``, that loops (back to a folder that holds
    it, or through links that never end) or that leads nowhere. A device reads only its own data
    folder: a link out of it would hand the run files the operator never named."""
    if not entry.is_symlink():
        return None
    try:
        target = Path(os.path.realpath(entry, strict=True))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (f"{entry}: a symbolic link that loops (to {os.readlink(entry)}, which never leads to a file "
                    f"or folder)")
        return f"{entry}: a symbolic link that cannot be followed (to {os.readlink(entry)}: {exc.strerror or exc})"
    if not target.is_relative_to(root):
        return f"{entry}: a symbolic link to {target}, outside the data folder {root}"
    if Path(os.path.realpath(entry.parent)).is_relative_to(target):
        return f"{entry}: a symbolic link that loops (to {target}, a folder that holds it)"
    return None


def _entries(folder: Path, root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The entries of ``folder`` that a device may read, sorted, and those it may not with the
    reason (:func:`_link_problem`, against the resolved ``root``). Hidden entries are neither:
    they are never read."""
    readable: list[Path] = []
    refused: list[tuple[Path, str]] = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        problem = _link_problem(entry, root)
        if problem is None:
            readable.append(entry)
        else:
            refused.append((entry, problem))
    return readable, refused


def _device_entries(folder: Path, root: Path) -> list[Path]:
    """The entries of ``folder``, inside the device's data folder ``root`` (resolved), once none
    of them is a link the device may not follow (:class:`DataError` naming the first)."""
    readable, refused = _entries(folder, root)
    if refused:
        raise DataError(refused[0][1])
    return readable


def _class_folders(folder: Path, root: Path, num_classes: int) -> list[tuple[int, Path]]:
    """(class index, sub-folder) of the image folder ``folder`` (``root``, resolved): numeric names
    are the class index; otherwise the position in the sorted names, and then every class needs its
    folder (an empty one for a class this device does not have) so that all devices map names to
    the same indices."""
    subs = [d for d in _device_entries(folder, root) if d.is_dir()]
    if not subs:
        raise DataError(f"{folder}: no class sub-folders (an image folder holds one sub-folder per class)")
    if all(d.name.isdigit() for d in subs):
        out = [(int(d.name), d) for d in subs]
        bad = [d.name for i, d in out if i >= num_classes]
        if bad:
            raise DataError(f"{folder}: class folder(s) {bad} outside 0..{num_classes - 1} (data.num_classes = {num_classes})")
        return out
    if len(subs) != num_classes:
        raise DataError(f"{folder}: {len(subs)} class sub-folders with names, but data.num_classes = {num_classes}: "
                        f"named classes need one folder per class (empty for a class this device lacks), "
                        f"or name the folders 0..{num_classes - 1}")
    return list(enumerate(subs))


def _image_files(folder: Path, root: Path) -> list[Path]:
    """The image files of the class folder ``folder`` of the device folder ``root`` (resolved)."""
    return [f for f in _device_entries(folder, root) if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]


def _resolved(folder: Path) -> Path:
    """``folder`` with every symbolic link on its way followed: the data folder links are checked against."""
    return Path(os.path.realpath(folder))


def load_image_folder(path: str | Path, spec: DataSpec, limits: FileLimits | None = None,
                      task: Task = "classification") -> ArrayDataset:
    """A folder of images, one sub-folder per class (:func:`_class_folders` gives the indices), as
    the run's model inputs. Images are converted to the channel count of ``data.input_shape``
    (1: Pillow's "L", 3: "RGB") and transformed one at a time, so their sizes may differ when
    ``input_transform.resize`` is set. Each image's size is checked from its header before it is
    decoded (:func:`_check_image_size`). Class folders give class labels: a regression ``task``
    is refused. A symbolic link in the folder or a class folder that leaves the folder, loops or
    leads nowhere is refused (:func:`_link_problem`); hidden entries are not read."""
    assert spec.num_classes is not None and spec.input_shape is not None
    if task == "regression":
        raise DataError(f"{path}: an image folder's sub-folders are classes, but the run is a regression task: "
                        f"give regression targets in .npz or .csv files, or a data function")
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise DataError(_PILLOW_HINT) from None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DataError(f"{folder}: image folder not found")
    if len(spec.input_shape) != 3 or spec.input_shape[0] not in (1, 3):
        raise DataError(f"{folder}: an image folder needs data.input_shape [1, H, W] or [3, H, W], "
                        f"got {list(spec.input_shape)}")
    mode = "L" if spec.input_shape[0] == 1 else "RGB"
    limits = limits or FileLimits()
    # Pillow warns at open about an image over its own 89-megapixel mark; _check_image_size refuses
    # one over the device's limit in a line of its own right after, so the warning adds only noise.
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    xs: list[torch.Tensor] = []
    ys: list[int] = []
    root = _resolved(folder)
    for label, sub in _class_folders(folder, root, spec.num_classes):
        for f in _image_files(sub, root):
            try:
                with Image.open(f) as img:   # reads the header only
                    _check_image_size(img.size, spec, limits, str(f))
                    pixels = np.array(img.convert(mode), dtype=np.uint8)   # a writable copy
            except DataError:
                raise
            except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as exc:
                raise DataError(f"{f}: unreadable image ({exc})") from None
            xs.append(model_inputs(pixels[None], spec, str(f)))
            ys.append(label)
    if not xs:
        raise DataError(f"{folder}: no images in its class sub-folders (read: {', '.join(sorted(IMAGE_SUFFIXES))})")
    return ArrayDataset(x=torch.cat(xs), y=torch.tensor(ys, dtype=torch.int64), num_classes=spec.num_classes)


def _check_image_size(size: tuple[int, int], spec: DataSpec, limits: FileLimits, where: str) -> None:
    """Refuse an image from the (width, height) in its header, before it is decoded: more than
    ``limits.max_pixels``, or, without ``input_transform.resize``, another size than
    ``data.input_shape`` (the check :func:`model_inputs` would make after decoding it)."""
    assert spec.input_shape is not None
    width, height = size
    if width * height > limits.max_pixels:
        raise DataError(f"{where}: image of {width} x {height} = {width * height} pixels, over the limit of "
                        f"{limits.max_pixels} pixels (--max-image-pixels)")
    if spec.input_transform.resize is None and [height, width] != list(spec.input_shape[1:]):
        raise DataError(_shape_mismatch(where, [spec.input_shape[0], height, width], spec.input_shape))


def load_function(ref: str, spec: DataSpec, data_args: dict[str, str], task: Task = "classification") -> ArrayDataset:
    """Call ``package.module:function(**data_args)``; it returns ``(x, y)`` or an ArrayDataset of
    raw samples, which get the run's transform and checks like a file's."""
    try:
        func = import_callable(ref, ref)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    try:
        result = func(**data_args)
    except Exception as exc:  # the user's code: report it as theirs, in one line
        raise DataError(f"{ref}: the data function failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(result, ArrayDataset):
        x, y = result.x, result.y
    elif isinstance(result, tuple) and len(result) == 2:
        x, y = result
    else:
        raise DataError(f"{ref}: the data function must return (x, y) or an ArrayDataset, got {type(result).__name__}")
    return load_samples(x, y, spec, ref, task)


# --------------------------------------------------------------------------------------------
# --data PATH -> devices
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalSource:
    """One device's data: ``ref`` is an .npz file, an image folder or an import path; ``name``
    (the file's stem, the folder's or the function's name) becomes part of the device id;
    ``limits`` bound what its files may hold (the agent's ``--max-data-bytes`` and
    ``--max-image-pixels``). ``refused``: why ``ref`` cannot be read at all, found when its
    ``--data`` value was listed (:func:`device_sources`); the device stops with it, alone."""

    name: str
    ref: str
    limits: FileLimits = field(default_factory=FileLimits)
    refused: str | None = None

    def load(self, spec: DataSpec, data_args: dict[str, str] | None = None,
             task: Task = "classification") -> ArrayDataset:
        """The device's samples as model inputs for the run's ``task``; :class:`DataError` for
        anything unusable."""
        if self.refused is not None:
            raise DataError(self.refused)
        return load_local(self.ref, spec, data_args or {}, self.limits, task)


def is_data_function(ref: str) -> bool:
    """``package.module:function`` that is not an existing file or folder."""
    return is_import_path(ref) and not Path(ref).exists()


def load_local(ref: str, spec: DataSpec, data_args: dict[str, str], limits: FileLimits | None = None,
               task: Task = "classification") -> ArrayDataset:
    """One device's data from ``ref``: an import path, an image folder, an .npz or a .csv file
    (by its name's ending), its files checked against ``limits`` (default :class:`FileLimits`),
    its labels those of the run's ``task``."""
    if spec.dataset != "local":
        raise DataError(f"--data {ref}: the run uses the built-in data set {spec.dataset!r} (partitioned with "
                        f"--shards); --data needs a run with data.dataset: local")
    if is_data_function(ref):
        return load_function(ref, spec, data_args, task)
    if Path(ref).expanduser().is_dir():
        return load_image_folder(ref, spec, limits, task)
    return load_data_file(ref, spec, limits, task, other_sources=", an image folder, or package.module:function")


def load_data_file(path: str | Path, spec: DataSpec, limits: FileLimits | None = None,
                   task: Task = "classification", other_sources: str = "") -> ArrayDataset:
    """An ``.npz`` or ``.csv`` file (by its name's ending) as the run's model inputs for its
    ``task``: a device's file, or the Fed Server's ``data.test_file``. ``other_sources``: what
    else the caller takes, for the refusal of any other file."""
    p = _data_file(path)
    if p.suffix.lower() == ".csv":
        return load_csv(p, spec, limits, task)
    if p.suffix.lower() == ".npz":
        return load_npz(p, spec, limits, task)
    raise DataError(f"{p}: unsupported data file {p.name!r}: use .npz, .csv{other_sources}")


def _is_data_file(path: Path) -> bool:
    return path.suffix.lower() in DATA_FILE_SUFFIXES


def _holds_images(folder: Path) -> bool:
    return any(not f.name.startswith(".") and f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
               for f in folder.iterdir())


def _source_name(path: Path) -> str:
    """The name a device of ``path`` gets: a data file's stem, else the whole name."""
    return path.stem if _is_data_file(path) else path.name


def data_sources(ref: str, limits: FileLimits | None = None) -> list[LocalSource]:
    """The devices one ``--data`` value makes, their files to be checked against ``limits``
    (default :class:`FileLimits`).

    * an import path or a file: one device;
    * a folder holding ``.npz`` or ``.csv`` files (and no sub-folders): one device per file;
    * a folder whose sub-folders hold images (or are empty): one device, the sub-folders are its
      classes;
    * a folder whose sub-folders hold only sub-folders (no image files): a folder of device
      folders, one device per sub-folder.

    A symbolic link in a folder of files or of device folders that leaves the folder, loops or
    leads nowhere (:func:`_link_problem`) is a device of its own, ``refused`` with the reason, and
    takes no part in reading the folder; in a device folder, its load refuses it. Hidden entries are
    not read. Anything else (a mix, an empty folder) is a :class:`DataError`, so the reading is
    never a guess.
    """
    limits = limits or FileLimits()
    if is_data_function(ref):
        return [LocalSource(ref.rpartition(":")[2], ref, limits)]
    p = Path(ref).expanduser()
    if not p.exists():
        raise DataError(f"{p}: data file or folder not found (nor an import path package.module:function)")
    if p.is_file():
        return [LocalSource(p.stem, str(p), limits)]
    readable, links = _entries(p, _resolved(p))
    subs = [d for d in readable if d.is_dir()]
    files = [f for f in readable if f.is_file() and _is_data_file(f)]
    refused = [LocalSource(_source_name(link), str(link), limits, problem) for link, problem in links]
    if not subs and not files and refused:
        return [LocalSource(p.name, str(p), limits)]   # a device folder of nothing but bad links: its load names one
    if files and not subs:
        return [LocalSource(f.stem, str(f), limits) for f in files] + [s for s in refused if _is_data_file(Path(s.ref))]
    if not subs:
        raise DataError(f"{p}: neither .npz or .csv files nor sub-folders (a device folder holds one sub-folder "
                        f"per class)")
    if files:
        raise DataError(f"{p}: holds both data files and sub-folders; give each device its own path")
    nested = [d for d in subs if not _holds_images(d) and any(s.is_dir() for s in d.iterdir())]
    if not nested:
        return [LocalSource(p.name, str(p), limits)]
    if len(nested) != len(subs) or any(_holds_images(d) for d in subs):
        raise DataError(f"{p}: some sub-folders hold images and some hold folders; a device folder's sub-folders "
                        f"are classes (images), a folder of devices holds only device folders")
    return [LocalSource(d.name, str(d), limits) for d in subs] + refused


def device_sources(ref: str, limits: FileLimits | None = None) -> list[LocalSource]:
    """:func:`data_sources` for a device agent: a ``--data`` value that cannot be read as devices
    (missing, ambiguous) is one device, ``refused`` with the reason, so that it stops alone and
    the agent's other devices train."""
    try:
        return data_sources(ref, limits)
    except DataError as exc:
        return [LocalSource(_source_name(Path(ref)), ref, limits or FileLimits(), str(exc))]
