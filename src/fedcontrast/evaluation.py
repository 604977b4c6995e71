"""Test-set evaluation of a classifier, batched over an in-memory data set."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate_classifier(model: nn.Module, data, device: torch.device, batch_size: int = 1024) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``model`` (returning ``(z, logits)``) on ``data``."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(data), batch_size):
        x = data.x[start:start + batch_size].to(device, non_blocking=True)
        y = data.y[start:start + batch_size].to(device, non_blocking=True)
        _, logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
    model.train(was_training)
    n = max(len(data), 1)
    return {"accuracy": correct / n, "loss": loss_sum / n}
