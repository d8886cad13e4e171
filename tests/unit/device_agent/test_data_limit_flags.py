"""``--max-data-bytes`` and ``--max-image-pixels``: the limits a device's ``--data`` files are
checked against before they are read (shared/data/limits.py)."""
from __future__ import annotations

import numpy as np
import pytest

from shared.data.limits import DEFAULT_MAX_IMAGE_PIXELS, FileLimits, default_max_data_bytes


@pytest.fixture
def data_file(tmp_path) -> str:
    path = tmp_path / "site.npz"
    np.savez(path, x=np.zeros((4, 2), dtype=np.float32), y=np.zeros(4, dtype=np.int64))
    return str(path)


def test_the_devices_sources_carry_the_limits_of_the_flags(agent_cli, data_file):
    kwargs = agent_cli.built_with(["--data", data_file, "--max-data-bytes", "5000", "--max-image-pixels", "640"])
    assert [source.limits for source in kwargs["sources"]] == [FileLimits(max_bytes=5000, max_pixels=640)]


def test_the_limits_default_to_the_machine_and_come_from_the_environment(agent_cli, data_file, monkeypatch):
    kwargs = agent_cli.built_with(["--data", data_file])
    assert kwargs["sources"][0].limits == FileLimits(default_max_data_bytes(), DEFAULT_MAX_IMAGE_PIXELS)
    monkeypatch.setenv("SFL_MAX_IMAGE_PIXELS", "1000")
    monkeypatch.setenv("SFL_MAX_DATA_BYTES", "2000")
    kwargs = agent_cli.built_with(["--data", data_file])
    assert kwargs["sources"][0].limits == FileLimits(max_bytes=2000, max_pixels=1000)


@pytest.mark.parametrize("flag", ["--max-data-bytes", "--max-image-pixels"])
@pytest.mark.parametrize("value", ["0", "-5", "1.5", "lots"])
def test_a_limit_that_is_not_a_positive_whole_number_is_refused(agent_cli, data_file, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        agent_cli.built_with(["--data", data_file, flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: '{value}' is not a whole number above zero" in capsys.readouterr().err
