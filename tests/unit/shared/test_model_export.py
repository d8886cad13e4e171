"""Exporting a trained model: the user's own key names, every format plain PyTorch loads, clear refusals."""
from __future__ import annotations

import json
import stat
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shared.models import SplitModel, build_model
from shared.models.export import export_model, load_trained, plain_model, user_state


def _trained(seed: int = 1):
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    return model, build_model("cnn", 10, (1, 28, 28), seed=seed).state_dict()


def test_the_files_hold_the_blocks_under_their_own_names_and_give_the_same_outputs(tmp_path):
    model, state = _trained()
    done = export_model(model, state, tmp_path, description={"model": "cnn", "num_classes": 10, "input_shape": [1, 28, 28]})
    assert set(done.files) == {"pt", "safetensors", "pt2", "torchscript", "onnx"}, done.skipped
    expected = {k[len("blocks."):]: v for k, v in state.items()}
    for weights in (torch.load(tmp_path / "model.pt", weights_only=True), load_file(str(tmp_path / "model.safetensors"))):
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    x = torch.randn(3, 1, 28, 28)
    reference = build_model("cnn", 10, (1, 28, 28), seed=1).eval()
    with torch.no_grad():
        want = reference(x)
        assert torch.allclose(load_trained(tmp_path)(x), want, atol=1e-6)
        assert torch.allclose(load_trained(tmp_path / "model.safetensors")(x), want, atol=1e-6)
        assert torch.allclose(torch.jit.load(str(tmp_path / "model.torchscript.pt"))(x), want, atol=1e-6)
        assert torch.allclose(torch.export.load(str(tmp_path / "model.pt2")).module()(x), want, atol=1e-6)
    info = json.loads((tmp_path / "model.json").read_text())
    assert info["model"] == "cnn" and info["keys"] == list(expected) and info["files"]["pt"] == "model.pt"


def test_the_onnx_file_runs_in_onnxruntime_with_the_same_outputs_for_any_batch(tmp_path):
    import onnxruntime as ort   # the export extra (pyproject.toml)
    model, state = _trained()
    export_model(model, state, tmp_path, formats=["onnx"])
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    reference = build_model("cnn", 10, (1, 28, 28), seed=1).eval()
    for batch in (1, 5):
        x = torch.randn(batch, 1, 28, 28)
        (got,) = session.run(["logits"], {"input": x.numpy()})
        with torch.no_grad():
            assert torch.allclose(torch.from_numpy(got), reference(x), atol=1e-5)


def test_a_plain_sequential_of_the_blocks_loads_the_pt_strictly():
    model, state = _trained()
    net = plain_model(build_model("cnn", 10, (1, 28, 28)))
    net.load_state_dict(user_state(model, state))   # strict by default: no key missing or left over


def test_an_unknown_format_is_refused_before_anything_is_written(tmp_path):
    model, state = _trained()
    with pytest.raises(ValueError, match="unknown export format.*'tflite'"):
        export_model(model, state, tmp_path / "out", ["pt", "tflite"])
    assert not (tmp_path / "out").exists()


def test_a_state_that_is_not_a_split_models_is_refused():
    with pytest.raises(ValueError, match="the state is not this model's"):
        user_state(build_model("cnn", 10, (1, 28, 28)), {"conv.weight": torch.zeros(1)})


def test_every_file_gets_the_same_permissions_and_the_exporters_print_nothing(tmp_path, capfd):
    # model.safetensors used to be written 0600 beside 0644 files, and the ONNX export printed
    # its progress lines, a note per torchvision operator and PyTorch's deprecations of its own code.
    model, state = _trained()
    done = export_model(model, state, tmp_path)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in tmp_path.iterdir()}
    assert len(set(modes.values())) == 1, modes
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    assert done.warnings == []


def test_a_small_models_onnx_file_is_one_file_and_a_large_ones_weights_go_beside_it(tmp_path, monkeypatch):
    import onnxruntime as ort

    import shared.models.export as export

    model, state = _trained()
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        want = build_model("cnn", 10, (1, 28, 28), seed=1).eval()(x)
    small = export_model(model, state, tmp_path / "small", formats=["onnx"])
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == ["model.json", "model.onnx"] and not small.companions
    monkeypatch.setattr(export, "ONNX_SINGLE_FILE_MAX_BYTES", 1000)
    large = export_model(model, state, tmp_path / "large", formats=["onnx"])
    assert large.companions == {"onnx": tmp_path / "large" / "model.onnx.data"}
    assert json.loads((tmp_path / "large" / "model.json").read_text())["companions"] == {"onnx": "model.onnx.data"}
    for folder in ("small", "large"):
        session = ort.InferenceSession(str(tmp_path / folder / "model.onnx"), providers=["CPUExecutionProvider"])
        (got,) = session.run(["logits"], {"input": x.numpy()})
        assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)


class _Warns(nn.Module):
    """A model whose forward warns: a warning about the model itself, which the export keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("this layer is experimental", UserWarning)
        return self.fc(x)


def test_a_warning_about_the_model_is_kept_once_per_format_in_one_line(tmp_path):
    model = SplitModel({"fc": _Warns(), "out": nn.Identity()}, (1,), None, None, (4,), 2)
    done = export_model(model, model.state_dict(), tmp_path, formats=["pt", "pt2", "onnx"])
    assert set(done.files) == {"pt", "pt2", "onnx"}, done.skipped
    assert done.warnings == ["pt2: UserWarning: this layer is experimental", "onnx: UserWarning: this layer is experimental"]
