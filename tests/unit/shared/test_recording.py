"""The honest-but-curious recording (``--record-received``): off unless asked, loud when on, its
limits checked, and what it keeps readable without pickle."""
from __future__ import annotations

import argparse
import json
import logging

import numpy as np
import pytest
import torch

from shared.recording import BANNER, add_recording_args, recording_from_args


def _recording(argv: list[str], tmp_path):
    parser = argparse.ArgumentParser()
    add_recording_args(parser)
    return recording_from_args(parser.parse_args(argv), parser, "main_server")


def test_off_by_default_and_its_limits_need_it(tmp_path):
    assert _recording([], tmp_path) is None
    with pytest.raises(SystemExit):
        _recording(["--record-steps", "2"], tmp_path)


@pytest.mark.parametrize("argv", [["--record-rounds", "0"], ["--record-rounds", "a,b"], ["--record-steps", "0"]])
def test_bad_limits_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        _recording(["--record-received", str(tmp_path), *argv], tmp_path)


def test_keeps_the_rounds_and_steps_asked_for_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="recording"):
        recording = _recording(["--record-received", str(tmp_path), "--record-rounds", "2,3", "--record-steps", "2"],
                               tmp_path)
        assert recording is not None and recording.folder == tmp_path / "main_server"
        assert [recording.keeps(r) for r in (1, 2, 3, None)] == [False, True, True, False]
        assert [recording.keeps(2, s) for s in (0, 1, 2)] == [True, True, False]
        recording.tensor(2, 7, "dev-000-step-0000-fx", torch.ones(2, 3, dtype=torch.float16))
        recording.state(2, 7, "global", {"w": torch.zeros(4)})
        recording.value(2, 7, "dev-000-join", {"label_counts": [1, 2]})
    assert sum(BANNER in r.getMessage() for r in caplog.records) == 2   # at start, and the round's first record
    folder = tmp_path / "main_server" / "round-002-attempt-7"
    assert np.load(folder / "dev-000-step-0000-fx.npy", allow_pickle=False).dtype == np.float32
    with np.load(folder / "global.npz", allow_pickle=False) as state:
        assert state.files == ["w"]
    assert json.loads((folder / "dev-000-join.json").read_text()) == {"label_counts": [1, 2]}
