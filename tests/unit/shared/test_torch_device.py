"""``--torch-device``: the one resolver every service uses, its errors, and the common flag.

CUDA and MPS are simulated with monkeypatch where a test needs them present or absent, so the
tests mean the same on a CPU-only build and on a GPU machine.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from shared.data import ArrayDataset
from shared.evaluation import evaluate
from shared.models import build_model
from shared.service import add_common_args, parse_service_args
from shared.torch_device import model_device, resolve_torch_device, synchronize, torch_device_flag


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_cpu_in_any_case_and_spacing():
    for text in ("cpu", "CPU", " cpu "):
        assert resolve_torch_device(text) == torch.device("cpu")


def test_unknown_names_are_refused_naming_the_choices():
    for text in ("gpu", "cuda:", "cuda:x", "cuda:-1", "cuda0", "tpu", "", "cpu:0"):
        with pytest.raises(ValueError, match=r"unknown torch device .*auto, cpu, cuda, cuda:N, mps"):
            resolve_torch_device(text)


def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch, no_gpu):
    assert resolve_torch_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_torch_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_torch_device("auto") == torch.device("cuda", 0)


def test_cuda_without_cuda_says_it_is_not_available(no_gpu):
    for text in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(ValueError, match=rf"torch device '{text}' is not available: torch .*use 'cpu' or 'auto'"):
            resolve_torch_device(text)


def test_cuda_index_must_exist(two_gpus):
    assert resolve_torch_device("cuda") == torch.device("cuda", 0)
    assert resolve_torch_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2' does not exist: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_torch_device("cuda:2")


def test_mps_without_mps_says_it_is_not_available(no_gpu, monkeypatch):
    with pytest.raises(ValueError, match=r"torch device 'mps' is not available"):
        resolve_torch_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_torch_device("mps") == torch.device("mps")


def test_flag_type_turns_the_error_into_an_argparse_error(no_gpu):
    assert torch_device_flag("cpu") == torch.device("cpu")
    with pytest.raises(argparse.ArgumentTypeError, match="not available"):
        torch_device_flag("cuda")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    return parser


def test_common_flag_defaults_to_cpu_and_takes_env_settings_and_flag(tmp_path, monkeypatch, two_gpus):
    monkeypatch.delenv("SFL_TORCH_DEVICE", raising=False)
    assert parse_service_args(_parser(), []).torch_device == torch.device("cpu")
    settings = tmp_path / "s.yaml"
    settings.write_text("torch-device: cuda:1\n")
    assert parse_service_args(_parser(), ["--settings", str(settings)]).torch_device == torch.device("cuda", 1)
    monkeypatch.setenv("SFL_TORCH_DEVICE", "auto")
    assert parse_service_args(_parser(), []).torch_device == torch.device("cuda", 0)
    assert parse_service_args(_parser(), ["--torch-device", "cpu"]).torch_device == torch.device("cpu")


def test_common_flag_refuses_an_unavailable_device_with_the_reason(capsys, monkeypatch, no_gpu):
    monkeypatch.delenv("SFL_TORCH_DEVICE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_service_args(_parser(), ["--torch-device", "cuda:0"])
    assert exit_info.value.code == 2
    assert "argument --torch-device: torch device 'cuda:0' is not available" in capsys.readouterr().err
    monkeypatch.setenv("SFL_TORCH_DEVICE", "gpu")  # a bad environment value is refused the same way
    with pytest.raises(SystemExit):
        parse_service_args(_parser(), [])
    assert "unknown torch device 'gpu'" in capsys.readouterr().err


def test_model_device_and_synchronize_on_the_cpu():
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(torch.nn.BatchNorm1d(2, affine=False)) == torch.device("cpu")  # buffers only
    assert model_device(torch.nn.Sequential()) == torch.device("cpu")
    with torch.device("meta"):
        assert model_device(torch.nn.Linear(2, 2)) == torch.device("meta")
    synchronize(torch.device("cpu"))  # nothing to wait for; must not touch CUDA


def test_evaluate_on_an_explicit_device_matches_the_model_in_place_and_leaves_it_alone():
    """The Fed Server's path (weights copied to ``device``, ``functional_call``) gives exactly the
    direct call's figures on the CPU, and restores the model's mode without touching its weights."""
    model = build_model("cnn", 10, (1, 12, 12), seed=1)
    gen = torch.Generator().manual_seed(2)
    data = ArrayDataset(x=torch.randn(70, 1, 12, 12, generator=gen), y=torch.randint(0, 10, (70,), generator=gen),
                        num_classes=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    direct = evaluate(model, data, batch_size=32)
    assert model.training
    explicit = evaluate(model, data, batch_size=32, device=torch.device("cpu"))
    assert explicit == direct and model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
