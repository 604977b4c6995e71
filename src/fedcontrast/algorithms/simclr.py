"""SimCLR local training shared by FLESD and its weight-averaging baseline, FedAvg-SimCLR (FLESD's
paper; docs/algorithms.md#fedavg-simclr): self-supervised NT-Xent over two augmented views of each
batch, in-batch negatives, Adam; labels are never read. Evaluation is a linear probe of the encoder
(``accuracy`` is the probe's test accuracy), on the aggregator and at each site."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import TrainingConfig
from ..data.views import ViewConfig
from ..errors import ConfigError
from ..evaluation import linear_probe
from ..losses import check_temperature, nt_xent
from ..models import ContrastiveNet
from .base import Algorithm, Downlink, ServerContext, SiteContext, TaskResult, load_weights, weight_tensors
from .registry import register_algorithm
from .training import batch_indices, optimizer_step, site_generator


def _pair(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class SimCLRHyperparameters:
    """Local SimCLR training (FLESD's and the FedAvg-SimCLR baseline's)."""

    temperature: float = 0.5  # NT-Xent τ
    lr: float = 1e-3  # Adam (the paper's local optimiser); training.lr/momentum are not used
    crop_scale: tuple[float, float] = (0.6, 1.0)  # views: see fedcontrast.data.views.ViewConfig
    max_shift: float = 0.1
    jitter: float = 0.4
    flip: bool = False
    noise_std: float = 0.0
    probe_epochs: int = 100  # linear-probe evaluation: L-BFGS iterations

    def __post_init__(self) -> None:
        object.__setattr__(self, "crop_scale", _pair(self.crop_scale))
        check_temperature(self.temperature)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        if not (isinstance(self.probe_epochs, int) and self.probe_epochs >= 1):
            raise ValueError(f"probe_epochs must be an integer >= 1, got {self.probe_epochs!r}")
        _ = self.views  # validates the augmentation settings

    @property
    def views(self) -> ViewConfig:
        return ViewConfig(crop_scale=self.crop_scale, max_shift=self.max_shift, flip=self.flip,
                          jitter=self.jitter, noise_std=self.noise_std)


def train_simclr(model: ContrastiveNet, data: Any, training: TrainingConfig, hp: SimCLRHyperparameters, *,
                 generator: torch.Generator, device: torch.device) -> dict[str, float]:
    """``training.local_epochs`` epochs of SimCLR on ``data.x`` (labels unused): NT-Xent between two
    augmented views of every batch, Adam on the encoder and projection head."""
    model.train()
    params = [p for name, p in model.named_parameters() if not name.startswith("classifier.")]
    optimizer = torch.optim.Adam(params, lr=hp.lr, weight_decay=training.weight_decay)
    views = hp.views
    x_all = data.x.to(device)
    total, steps = torch.zeros((), device=device), 0
    for _ in range(training.local_epochs):
        for idx in batch_indices(len(data), training.batch_size, generator):
            v1, v2 = views.views(x_all[idx.to(device)], generator)
            loss = nt_xent(model.represent(v1), model.represent(v2), temperature=hp.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer_step(optimizer, training)
            total += loss.detach()
            steps += 1
    return {"loss": (total / max(steps, 1)).item(), "steps": float(steps)}


def probe_at_site(model: ContrastiveNet, site: SiteContext, test: Any, epochs: int) -> dict[str, float]:
    """A site's linear probe of ``model``'s encoder: trained on the site's own labelled training
    split, tested on its held-out split (``accuracy`` is the probe's test accuracy)."""
    result = linear_probe(model.encoder, site.data, test, site.device, epochs=epochs, module=model)
    return {"accuracy": result["probe_accuracy"], **result}


def probe(model: ContrastiveNet, server: ServerContext, test: Any, epochs: int) -> dict[str, float]:
    """Linear-probe accuracy of ``model``'s encoder (features before the projection head): trained
    on ``server.labelled`` (the simulator's training split) or, on an aggregator, the public split."""
    train = server.labelled if server.labelled is not None else server.public
    if train is None:
        raise ConfigError("linear probing needs labelled data on the aggregator: a public split (public_fraction > 0)")
    result = linear_probe(model.encoder, train, test, server.device, epochs=epochs, module=model)
    return {"accuracy": result["probe_accuracy"], **result}


@register_algorithm
class FedAvgSimCLR(Algorithm):
    """The weight-averaging baseline of FLESD's paper: SimCLR local training, FedAvg aggregation,
    linear-probe evaluation (``accuracy`` is the probe's test accuracy)."""

    name = "fedavg_simclr"
    Hyperparameters = SimCLRHyperparameters
    hp: SimCLRHyperparameters
    task_metrics = {"train": ("loss", "steps")}
    evaluation_metrics = ("accuracy", "probe_accuracy", "probe_train_accuracy")

    def task_train(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        load_weights(site.model, received)
        metrics = train_simclr(site.model, site.data, site.training, self.hp,
                               generator=site_generator(site.seed), device=site.device)
        return TaskResult(weight_tensors(site.model), float(len(site.data)), metrics)

    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        return Downlink(self.average_weights(uploads, weights))

    def evaluate_at_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        load_weights(site.model, received)
        return probe_at_site(site.model, site, test, self.hp.probe_epochs)

    def evaluate(self, downlink: Downlink, server: ServerContext, test: Any) -> dict[str, float]:
        load_weights(server.model, downlink.global_tensors)
        return probe(server.model, server, test, self.hp.probe_epochs)
