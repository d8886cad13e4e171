"""``python -m testbed``'s command line: --device-data and the device count it implies."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

import testbed.__main__ as cli


def test_cli_counts_the_devices_of_device_data_paths(tmp_path, monkeypatch):
    for name in ("a", "b"):
        np.savez(tmp_path / f"{name}.npz", x=np.zeros((2, 3)), y=np.zeros(2, dtype=int))
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("d", "e"):
        np.savez(folder / f"{name}.npz", x=np.zeros((2, 3)), y=np.zeros(2, dtype=int))
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump({"data": {"dataset": "local", "num_classes": 2, "input_shape": [3]}}))
    seen = {}

    class Stop(Exception):
        pass

    def fake_testbed(config, run_dir, **kwargs):
        seen.update(num_devices=config.data.num_devices, device_data=kwargs["device_data"])
        raise Stop

    monkeypatch.setattr(cli, "Testbed", fake_testbed)
    paths = [str(tmp_path / "a.npz"), str(folder)]
    args = ["--config", str(config), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(Stop):
        cli.main([*args, *(a for p in paths for a in ("--device-data", p))])
    assert seen == {"num_devices": 3, "device_data": paths}
    with pytest.raises(Stop):
        cli.main([*args, "--device-data", paths[0], "--devices", "5"])
    assert seen["num_devices"] == 5
