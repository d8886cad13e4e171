"""Write a generated tabular regression data set: one ``.csv`` file per device and a server test set.

Nothing is downloaded: the rows are drawn from a fixed, seeded generator,

    x ~ N(shift_d, I)  (8 features; each device's features are shifted: shift_d ~ N(0, 0.5^2 I))
    y = x . w + 0.5 sin(2 x_0) + 0.3 x_1 x_2 + noise,  noise ~ N(0, 0.1^2)

with one ``w`` for all devices, so a federated model can learn it from everyone's rows, while
every device sees another part of the feature space (the non-IID part):

    data/devices/device-<d>.csv      header f0..f7,target; the target column is float (data.label_column)
    data/test.npz                    x [N, 8] float32, y [N] float32: the Fed Server's test set (data.test_file)

The features are already on a unit scale, so the run needs no ``data.input_transform``. The test
set is drawn from the same devices' distributions (the same number of rows from each).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FEATURES = 8


def target(x: np.ndarray, w: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The generator's target of every row of ``x``: linear, plus a curve and an interaction."""
    return (x @ w + 0.5 * np.sin(2 * x[:, 0]) + 0.3 * x[:, 1] * x[:, 2] + noise).astype(np.float32)


def generate(devices: int = 3, rows: int = 200, test_rows: int = 60, seed: int = 0
             ) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    """Each device's ``(x, y)`` (``rows`` rows) and the test set (``test_rows`` per device), seeded."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 1.0, FEATURES) / np.sqrt(FEATURES)
    parts, test_x, test_y = [], [], []
    for _ in range(devices):
        shift = rng.normal(0.0, 0.5, FEATURES)
        x = (rng.normal(0.0, 1.0, (rows + test_rows, FEATURES)) + shift).astype(np.float32)
        y = target(x, w, rng.normal(0.0, 0.1, rows + test_rows))
        parts.append((x[:rows], y[:rows]))
        test_x.append(x[rows:])
        test_y.append(y[rows:])
    return parts, (np.concatenate(test_x), np.concatenate(test_y))


def write(out: Path, devices: int = 3, rows: int = 200, test_rows: int = 60, seed: int = 0) -> list[Path]:
    """Write the devices' ``.csv`` files and ``test.npz`` under ``out``; returns the device files."""
    parts, (test_x, test_y) = generate(devices, rows, test_rows, seed)
    (out / "devices").mkdir(parents=True)
    np.savez(out / "test.npz", x=test_x, y=test_y)
    header = ",".join([*(f"f{i}" for i in range(FEATURES)), "target"])
    paths = []
    for d, (x, y) in enumerate(parts):
        path = out / "devices" / f"device-{d}.csv"
        np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="", fmt="%.6g")
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="folder to create (default data)")
    parser.add_argument("--devices", type=int, default=3, help="number of devices (default 3)")
    parser.add_argument("--rows", type=int, default=200, help="rows per device (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.devices < 1 or args.rows < 1:
        parser.error("need --devices >= 1 and --rows >= 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; remove it to write new data")
    for path in write(out, args.devices, args.rows, seed=args.seed):
        print(f"{path}: {args.rows} rows")
    print(f"{out / 'test.npz'}: {60 * args.devices} rows")


if __name__ == "__main__":
    main()
