"""Test accuracy and loss of a model over a data set (the Fed Server's global model, per-domain and local evaluations)."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.func import functional_call

from shared.data import ArrayDataset
from shared.torch_device import model_device


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ArrayDataset, batch_size: int = 500,
             device: torch.device | None = None) -> tuple[float, float]:
    """(accuracy in [0, 1], mean cross-entropy) over ``data``, in eval mode.

    Without ``device`` it runs where the model's weights are (a device agent's model on its
    ``--torch-device``). With ``device`` (the Fed Server's ``--torch-device``) the model itself
    stays where it is (the global model stays on the CPU, where uploads are aggregated): its
    parameters and buffers are copied to ``device`` once per call and used through
    ``torch.func.functional_call``, which is cheaper than copying the module (one copy of the
    weights, none of the structure; no copy at all when ``device`` is where they already are,
    so the CPU runs this same path bit for bit). The data set stays on the CPU and each batch
    follows the weights.
    """
    was_training = model.training
    model.eval()
    weights = None
    if device is None:
        target = model_device(model)
    else:
        target = torch.device(device)
        weights = {name: t.to(target) for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    correct, loss_sum = 0, 0.0
    try:
        for start in range(0, len(data), batch_size):
            x = data.x[start:start + batch_size].to(target)
            y = data.y[start:start + batch_size].to(target)
            logits = model(x) if weights is None else functional_call(model, weights, (x,))
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    finally:
        model.train(was_training)
    n = max(1, len(data))
    return correct / n, loss_sum / n
