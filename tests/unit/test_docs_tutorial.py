"""The tutorial's data check (step 3) runs as written, on a classification device's file and on a
regression device's (it used to refuse the regression file's float targets as labels)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _data_check() -> str:
    """The Python of the tutorial's data check: the ``python -c "..."`` of step 3."""
    step = (ROOT / "docs" / "tutorial.md").read_text().split("## 3. The data", 1)[1].split("## 4.", 1)[0]
    match = re.search(r'python -c "\n(.*?)"\n```', step, re.S)
    assert match, "step 3 has no python -c data check"
    return match.group(1)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_the_tutorials_data_check_reads_a_device_file_of_either_task(task, tmp_path):
    (tmp_path / "my_project").mkdir()
    (tmp_path / "data" / "device-0").mkdir(parents=True)
    rng = np.random.default_rng(0)
    data = {"dataset": "local", "num_devices": 1, "input_shape": [1, 2, 2]}
    if task == "regression":
        run = {"algorithm": "fedavg", "model": "logreg", "train": {"loss": "mse"}, "data": {**data, "num_classes": 1}}
        y = rng.normal(size=12).astype(np.float32)
    else:
        run = {"algorithm": "fedavg", "model": "logreg", "data": {**data, "num_classes": 3}}
        y = np.arange(12) % 3
    (tmp_path / "my_project" / "run.yaml").write_text(yaml.safe_dump(run))
    np.savez(tmp_path / "data" / "device-0" / "site.npz", x=rng.normal(size=(12, 1, 2, 2)).astype(np.float32), y=y)
    done = subprocess.run([sys.executable, "-c", _data_check()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    expected = ("site 12 samples, per class [4 4 4]" if task == "classification" else
                f"site 12 samples, targets {float(y.min())} to {float(y.max())}")
    assert done.stdout.strip() == expected, done.stdout
