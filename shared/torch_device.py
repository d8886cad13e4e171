"""Which torch device a service computes on: ``--torch-device auto|cpu|cuda|cuda:N|mps``.

One resolver serves the Main Server, the device agent and the Fed Server, so a name means the same
thing everywhere and a wrong one fails at start with one line saying why. Tensors leave the device
only for the wire (``shared/wire.py`` encodes from the CPU) and for aggregation (the Fed Server
averages on the CPU, where uploads arrive).
"""
from __future__ import annotations

import argparse
import re

import torch

#: The names ``--torch-device`` accepts, for help texts and error messages.
TORCH_DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, mps"
_CUDA = re.compile(r"cuda(?::(\d+))?")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_torch_device(text: str) -> torch.device:
    """``auto|cpu|cuda|cuda:N|mps`` -> a ``torch.device`` that exists on this machine.

    ``auto`` picks CUDA (device 0) if available, else MPS if available, else the CPU. Raises
    ValueError with a message naming the problem: an unknown name, CUDA or MPS not available
    (a CPU-only torch build, no driver), or a CUDA index beyond the visible devices.
    """
    name = str(text).strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _mps_available():
            raise ValueError("torch device 'mps' is not available: it needs Apple silicon, macOS 12.3 or later "
                             "and a torch build with MPS (use 'cpu' or 'auto')")
        return torch.device("mps")
    match = _CUDA.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown torch device {text!r}: use one of {TORCH_DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} built without CUDA" if torch.version.cuda is None \
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU or driver"
        raise ValueError(f"torch device {text!r} is not available: {build} (use 'cpu' or 'auto')")
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"torch device {text!r} does not exist: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def torch_device_flag(text: str) -> torch.device:
    """``argparse`` type of ``--torch-device``: the resolver, its error shown as the flag's error."""
    try:
        return resolve_torch_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters (or, without any, buffers) live; the CPU for an empty module."""
    for tensor in model.parameters():
        return tensor.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA and MPS run asynchronously), so a wall-clock
    measurement around compute covers the compute; nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
