"""FedProx (Li et al. 2020; MOON §2.1; docs/algorithms.md#fedprox): FedAvg plus a proximal term toward
the global weights."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..losses import proximal_term
from .base import SiteContext
from .fedavg import FedAvg
from .registry import register_algorithm
from .training import ExtraLoss, ExtraTerm


@dataclass(frozen=True)
class FedProxHyperparameters:
    mu: float = 0.01  # the best value of MOON's FedProx grid {0.001, 0.01, 0.1, 1} on CIFAR-10

    def __post_init__(self) -> None:
        if not (isinstance(self.mu, (int, float)) and math.isfinite(self.mu) and self.mu >= 0):
            raise ValueError(f"mu must be a number >= 0, got {self.mu!r}")


@register_algorithm
class FedProx(FedAvg):
    """Loss ``CE + μ/2 · ||w − w_glob||²``; aggregation as FedAvg."""

    name = "fedprox"
    task_metrics = {"train": ("loss", "ce", "accuracy", "proximal")}
    Hyperparameters = FedProxHyperparameters
    hp: FedProxHyperparameters
    # Opacus's per-sample gradients leave out the proximal term (it acts on the parameters, not
    # through a module's forward), so DP-SGD would silently train plain FedAvg.
    dp_kinds = frozenset()

    def local_loss(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> ExtraLoss:
        params = [p for p in site.model.parameters() if p.requires_grad]
        global_params = [p.detach().clone() for p in params]  # w_glob, loaded just before
        mu = self.hp.mu

        def extra(x: torch.Tensor, idx: torch.Tensor, z: torch.Tensor, logits: torch.Tensor, epoch: int) -> ExtraTerm:
            term = proximal_term(params, global_params, mu=mu)
            return term, {"proximal": term.detach()}

        return extra
