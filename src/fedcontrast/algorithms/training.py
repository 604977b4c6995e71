"""The local training loop shared by the supervised algorithms.

Data sits in memory as tensors; a batch is an index into them, so there is no per-sample Python
work on the hot path. An algorithm adds its own term through ``extra_loss``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TrainingConfig

if TYPE_CHECKING:
    from ..data import ArrayDataset
    from ..privacy.site import SitePrivacy

# extra_loss(x, idx, z, logits, epoch) -> (term added to the loss, {component name: detached raw value})
ExtraTerm = tuple[torch.Tensor, dict[str, torch.Tensor]]
ExtraLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], ExtraTerm]


@dataclass
class TrainStats:
    loss: float  # mean total loss over every batch of every epoch
    ce: float  # mean cross-entropy part
    accuracy: float  # training accuracy over the last epoch
    steps: int
    components: dict[str, float]  # mean of each named extra-loss component (unweighted)


def make_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                           momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def optimizer_step(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, *, clip: bool = True) -> None:
    """``optimizer.step()``, the whole gradient of its parameters first clipped to ``cfg.clip_grad_norm``
    in L2 (where set and ``clip``: off under DP-SGD, whose optimiser clips each sample's instead)."""
    if clip and cfg.clip_grad_norm:  # None or 0: off
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)
    optimizer.step()


def augment(x: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Batch-wise random augmentation: ``crop`` (pad 2, random 4-pixel shift) and ``crop_flip``.

    Shape: ``(B, C, H, W) → (B, C, H, W)``. One shift per batch keeps it a single tensor op.
    """
    if kind == "none":
        return x
    dx, dy = (int(v) for v in torch.randint(0, 5, (2,), generator=generator, device=generator.device))
    h, w = x.shape[-2:]
    x = F.pad(x, (2, 2, 2, 2))[..., dy:dy + h, dx:dx + w]
    if kind == "crop_flip":
        flip = torch.rand(x.shape[0], generator=generator, device=generator.device) < 0.5
        x = torch.where(flip.to(x.device)[:, None, None, None], x.flip(-1), x)
    return x


def batch_indices(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random permutation cut into batches; a last batch of one sample is dropped (BatchNorm)."""
    perm = torch.randperm(n, generator=generator, device=generator.device)
    batches = list(perm.split(batch_size))
    if len(batches) > 1 and len(batches[-1]) < 2:
        batches.pop()
    return batches


def train_supervised(model: nn.Module, data: ArrayDataset, cfg: TrainingConfig, *, generator: torch.Generator,
                     device: torch.device, extra_loss: ExtraLoss | None = None,
                     private: SitePrivacy | None = None) -> TrainStats:
    """``cfg.local_epochs`` epochs of SGD on cross-entropy (+ ``extra_loss``) over ``data``.

    ``private``: the site's privacy object (``site.privacy``); when it turns DP-SGD on, training runs
    in its session (per-sample clipping, noise, Poisson batches) instead of shuffled batches.
    """
    model.train()
    optimizer = make_optimizer(model, cfg)
    session = None
    if private is not None and private.dp_sgd is not None:
        session = private.training_session(model, optimizer, num_samples=len(data), batch_size=cfg.batch_size)
        optimizer = session.optimizer
    try:
        return _train(session.model if session else model, optimizer, data, cfg, generator=generator, device=device,
                      extra_loss=extra_loss,
                      epoch_batches=session.epoch_batches if session else
                      (lambda: batch_indices(len(data), cfg.batch_size, generator)),
                      private_steps=session is not None)
    finally:
        if session is not None:
            session.close()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, data: ArrayDataset, cfg: TrainingConfig, *,
           generator: torch.Generator, device: torch.device, extra_loss: ExtraLoss | None,
           epoch_batches: Callable[[], Iterable[torch.Tensor]], private_steps: bool = False) -> TrainStats:
    x_all, y_all = data.x.to(device), data.y.to(device)
    loss_sum = torch.zeros((), device=device)  # summed on device: no sync per step
    ce_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    component_sums: dict[str, torch.Tensor] = {}
    steps = seen = 0
    for epoch in range(cfg.local_epochs):
        last_epoch = epoch == cfg.local_epochs - 1
        for idx in epoch_batches():
            idx_d = idx.to(device)
            x = augment(x_all[idx_d], cfg.augmentation, generator)
            y = y_all[idx_d]
            z, logits = model(x)  # (B, d), (B, C)
            ce = F.cross_entropy(logits, y)
            loss = ce
            if extra_loss is not None:
                term, parts = extra_loss(x, idx_d, z, logits, epoch)
                loss = ce + term
                for key, value in parts.items():
                    component_sums[key] = component_sums.get(key, 0) + value
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer_step(optimizer, cfg, clip=not private_steps)
            loss_sum += loss.detach()
            ce_sum += ce.detach()
            steps += 1
            if last_epoch:
                correct += (logits.detach().argmax(1) == y).sum()
                seen += len(y)
    steps_ = max(steps, 1)
    return TrainStats(loss=(loss_sum / steps_).item(), ce=(ce_sum / steps_).item(),
                      accuracy=correct.item() / max(seen, 1), steps=steps,
                      components={k: float(v / steps_) for k, v in component_sums.items()})


def site_generator(seed: int) -> torch.Generator:
    """The CPU generator of a site's task: batches and augmentations are drawn on the host."""
    return torch.Generator(device="cpu").manual_seed(seed)
