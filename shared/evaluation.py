"""Test accuracy and loss of a model over a data set (the Fed Server's global model, per-domain and local evaluations)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.data import ArrayDataset


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ArrayDataset, batch_size: int = 500) -> tuple[float, float]:
    """(accuracy in [0, 1], mean cross-entropy) over ``data``, in eval mode."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(data), batch_size):
        x, y = data.x[start:start + batch_size], data.y[start:start + batch_size]
        logits = model(x)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    n = max(1, len(data))
    return correct / n, loss_sum / n
