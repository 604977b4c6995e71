"""Test-set evaluation of a classifier, batched over an in-memory data set."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .tensors import load_weights


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


@torch.no_grad()
def predict(model: nn.Module, data, device: torch.device, batch_size: int = 1024) -> torch.Tensor:
    """Predicted classes of ``model`` (returning ``(z, logits)``) for every sample. ``→ (N,)``."""
    was_training = model.training
    model.eval()
    preds = [model(data.x[i:i + batch_size].to(device))[1].argmax(1) for i in range(0, len(data), batch_size)]
    model.train(was_training)
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=device)


def local_model_accuracy(model: nn.Module, local_models, test, device: torch.device,
                         class_counts=None) -> dict[str, float]:
    """Each site's local model (``local_models``: site → its uploaded ``model.*`` tensors, loaded
    into ``model`` in turn) on ``test``: ``local_balanced_accuracy`` on the split as it is and, when
    ``class_counts`` (site → per-class sample counts) is given, ``local_accuracy`` on the split
    re-weighted to each site's own label distribution; mean and sample std (``_std``) over sites."""
    y = test.y.to(device)
    weighted, balanced = [], []
    for site in sorted(local_models):
        load_weights(model, local_models[site])
        pred = predict(model, test, device)
        balanced.append((pred == y).double().mean().item())
        if class_counts is not None:
            weighted.append(distribution_weighted_accuracy(pred, y, class_counts[site].to(device, torch.float64)))
    out: dict[str, float] = {}
    for key, values in (("local_accuracy", weighted), ("local_balanced_accuracy", balanced)):
        if values:
            mean = sum(values) / len(values)
            out[key] = mean
            out[f"{key}_std"] = (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5
    return out


def own_accuracy(model: nn.Module, weights, test, device: torch.device) -> float:
    """A site's local model (its uploaded ``model.*`` tensors, loaded into ``model``) on its own
    held-out samples ``test``."""
    load_weights(model, weights)
    return (predict(model, test, device) == test.y.to(device)).double().mean().item()


PROTOTYPE_METRICS = ("euclidean", "cosine")


def nearest_prototype(z: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor | None = None, *,
                      metric: str = "euclidean") -> torch.Tensor:
    """The class of the nearest prototype for each row of ``z``: ``argmin_c ‖z − P_c‖²`` (euclidean,
    FedPCL's official rule) or ``argmax_c cos(z, P_c)`` (cosine); classes with ``present == 0`` are
    never chosen. Not ``argmax z·P``: prototypes are means of unit vectors, their norms differ by
    class, and the dot product favours the longer ones. ``(N, d), (C, d), (C,) → (N,)``."""
    if metric not in PROTOTYPE_METRICS:
        raise ValueError(f"metric must be one of {', '.join(PROTOTYPE_METRICS)}, got {metric!r}")
    if metric == "euclidean":
        scores = -torch.cdist(z.double(), prototypes.double()).square()  # (N, C)
    else:
        scores = F.normalize(z.double(), dim=1) @ F.normalize(prototypes.double(), dim=1).T
    if present is not None:
        scores = scores.masked_fill(~present.to(device=scores.device, dtype=torch.bool), float("-inf"))
    return scores.argmax(1)


def distribution_weighted_accuracy(pred: torch.Tensor, y: torch.Tensor, class_weights: torch.Tensor) -> float:
    """``Σ_c w_c · acc_c / Σ_c w_c`` over the classes present in ``y``: accuracy on a test set whose
    label distribution follows ``class_weights`` (e.g. a site's class counts)."""
    num, den = 0.0, 0.0
    for c in range(len(class_weights)):
        in_class = y == c
        if bool(in_class.any()) and class_weights[c] > 0:
            num += float(class_weights[c]) * (pred[in_class] == c).double().mean().item()
            den += float(class_weights[c])
    return num / den if den else 0.0


@torch.no_grad()
def _encode_all(encode: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, device: torch.device,
                batch_size: int) -> torch.Tensor:
    """``encode`` over ``x`` in batches, as float32 ``(N, F)`` features on ``device``."""
    parts = [encode(x[i:i + batch_size].to(device, non_blocking=True)).flatten(1).float()
             for i in range(0, x.shape[0], batch_size)]
    return torch.cat(parts)


def linear_probe(encode: Callable[[torch.Tensor], torch.Tensor], train, test, device: torch.device, *,
                 epochs: int = 100, lr: float = 1.0, weight_decay: float = 1e-4, seed: int = 0,
                 batch_size: int = 1024, module: nn.Module | None = None) -> dict[str, float]:
    """Linear probing of a frozen encoder (FLESD's evaluation; SimCLR's linear evaluation protocol).

    ``encode(x) → (B, F)`` features (more dimensions are flattened) is run without gradients and with
    ``module`` in eval mode (default: ``encode`` itself when it is an ``nn.Module``, or the module a
    bound method belongs to; its training flag is restored afterwards). The features of ``train`` and
    ``test`` (objects with ``.x (N, C, H, W)`` and ``.y (N,)`` int64, like ``ArrayDataset``) are
    standardised with the train mean and standard deviation, and a multinomial logistic regression
    (``nn.Linear``, classes = max label + 1 over both sets) is fitted full-batch with L-BFGS for
    ``epochs`` iterations on ``mean CE + weight_decay/2 · ‖W‖²`` (bias not decayed), starting from
    weights drawn with ``seed``: the same inputs and seed give the same numbers.
    Returns ``{"probe_accuracy": test accuracy, "probe_train_accuracy": train accuracy}``.
    """
    if len(train) == 0 or len(test) == 0:
        raise ValueError(f"linear_probe needs non-empty train and test sets, got {len(train)} and {len(test)} samples")
    if epochs < 1 or lr <= 0 or weight_decay < 0 or batch_size < 1:
        raise ValueError(f"linear_probe needs epochs >= 1, lr > 0, weight_decay >= 0 and batch_size >= 1, got "
                         f"{epochs}, {lr}, {weight_decay} and {batch_size}")
    if module is None:
        owner = encode if isinstance(encode, nn.Module) else getattr(encode, "__self__", None)
        module = owner if isinstance(owner, nn.Module) else None
    was_training = module.training if module is not None else False
    if module is not None:
        module.eval()
    try:
        train_f = _encode_all(encode, train.x, device, batch_size)  # (N, F)
        test_f = _encode_all(encode, test.x, device, batch_size)  # (M, F)
    finally:
        if module is not None:
            module.train(was_training)

    mean = train_f.mean(0)
    std = train_f.std(0, unbiased=False).clamp_min(1e-6)  # constant features become 0, not NaN
    train_f, test_f = (train_f - mean) / std, (test_f - mean) / std
    train_y, test_y = train.y.to(device), test.y.to(device)
    num_classes = max(int(train.y.max()), int(test.y.max())) + 1

    generator = torch.Generator(device="cpu").manual_seed(seed)  # the same start on every device
    probe = nn.Linear(train_f.shape[1], num_classes, device="cpu")
    with torch.no_grad():
        probe.weight.copy_(0.01 * torch.randn(probe.weight.shape, generator=generator, device="cpu"))
        probe.bias.zero_()
    probe.to(device)
    optimizer = torch.optim.LBFGS(probe.parameters(), lr=lr, max_iter=epochs, history_size=20,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(probe(train_f), train_y) + 0.5 * weight_decay * probe.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    with torch.no_grad():
        train_acc = (probe(train_f).argmax(1) == train_y).double().mean().item()
        test_acc = (probe(test_f).argmax(1) == test_y).double().mean().item()
    return {"probe_accuracy": test_acc, "probe_train_accuracy": train_acc}
