"""MOON: model-contrastive federated learning (Li et al., CVPR 2021, §3; docs/algorithms.md#moon)."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import TrainingConfig
from ..errors import ConfigError
from ..losses import check_temperature, moon_loss_from_difference, moon_reference_difference
from ..models import ContrastiveNet
from .base import WEIGHT_PREFIX, SiteContext, TaskResult, load_weights
from .fedavg import FedAvg
from .registry import register_algorithm
from .training import ExtraLoss, ExtraTerm

PREVIOUS_WEIGHTS = "moon.previous_weights"  # key in the site's persistent state


@dataclass(frozen=True)
class MoonHyperparameters:
    mu: float = 5.0  # 5 for CIFAR-10, 1 for CIFAR-100 (paper §4.1)
    temperature: float = 0.5
    # Compute R_global(x) and R_prev(x) once per round instead of in every step. "auto" does so when
    # it is exact: no random augmentation (the frozen models are always in eval mode).
    cache_reference_representations: bool | str = "auto"

    def __post_init__(self) -> None:
        if not (isinstance(self.mu, (int, float)) and math.isfinite(self.mu) and self.mu >= 0):
            raise ValueError(f"mu must be a number >= 0, got {self.mu!r}")
        check_temperature(self.temperature)
        if self.cache_reference_representations not in (True, False, "auto"):
            raise ValueError("cache_reference_representations must be true, false or auto, "
                             f"got {self.cache_reference_representations!r}")


_FROZEN = threading.local()  # this thread's reusable frozen copies: (slot, architecture) → model


def frozen_copy(model: ContrastiveNet, slot: str | None = None) -> ContrastiveNet:
    """A copy in eval mode with gradients off: the paper's frozen R_global / R_prev. With ``slot``,
    the copy is this thread's one for that slot and architecture, its weights and buffers overwritten
    (a module's deep copy cost more than a site's local epoch on digits): valid until the next call
    with the same slot, so a site's round uses it and lets it go."""
    if slot is None:
        frozen = copy.deepcopy(model).eval()
        frozen.requires_grad_(False)
        return frozen
    cache: dict[Hashable, ContrastiveNet] | None = getattr(_FROZEN, "models", None)
    if cache is None:
        cache = _FROZEN.models = {}
    state = model.state_dict()
    key = (slot, type(model), repr(model), tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in state.items()))
    kept = cache.get(key)
    if kept is None:
        kept = cache[key] = frozen_copy(model)
        return kept
    with torch.no_grad():
        for target, source in zip(kept.state_dict().values(), state.values()):
            target.copy_(source)
    return kept


@torch.no_grad()
def represent_all(model: ContrastiveNet, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """``model.represent`` over every sample. Shape: ``(N, C, H, W) → (N, d)``."""
    return torch.cat([model.represent(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])


@register_algorithm
class Moon(FedAvg):
    """Loss ``CE + μ · l_con``, ``l_con`` contrasting the local representation with the global
    model's (positive) and the previous local model's (negative). Aggregation: FedAvg.

    R_prev is the model this site uploaded the last time it took part; it is kept in the site's
    persistent state (on the site's disk under OpenFL) and is the global model on the first round.
    """

    name = "moon"
    task_metrics = {"train": ("loss", "ce", "accuracy", "contrastive")}
    Hyperparameters: ClassVar[type] = MoonHyperparameters  # FedSSC, a subclass, has its own

    @property
    def moon_weight(self) -> float:
        """μ of ``CE + μ · l_con``."""
        hp: MoonHyperparameters = self.hp  # FedSSC, whose settings differ, has its own moon_weight
        return hp.mu

    def validate_training(self, training: TrainingConfig) -> None:
        if self.hp.cache_reference_representations is True and training.augmentation != "none":
            raise ConfigError("moon.cache_reference_representations=true is only exact without random "
                              f"augmentation, but training.augmentation is {training.augmentation!r}")

    def uses_cache(self, training: TrainingConfig) -> bool:
        setting = self.hp.cache_reference_representations
        return training.augmentation == "none" if setting == "auto" else bool(setting)

    def local_loss(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> ExtraLoss:
        self.validate_training(site.training)
        global_model = frozen_copy(site.model, "moon global")  # site.model holds the global weights now
        previous = site.state.get(PREVIOUS_WEIGHTS)
        if previous is None:
            prev_model = global_model
        else:
            prev_model = frozen_copy(site.model, "moon previous")
            load_weights(prev_model, previous)
        mu, tau = self.moon_weight, self.hp.temperature

        if self.uses_cache(site.training):
            x_all = site.data.x.to(site.device)
            z_glob_all = represent_all(global_model, x_all)  # (N, d)
            if previous is None:  # R_prev = R_global: the difference is 0 and the loss log 2
                diff_all = torch.zeros_like(z_glob_all)
            else:
                diff_all = moon_reference_difference(z_glob_all, represent_all(prev_model, x_all))

            def extra(x: torch.Tensor, idx: torch.Tensor, z: torch.Tensor, logits: torch.Tensor,
                      epoch: int) -> ExtraTerm:
                con = moon_loss_from_difference(z, diff_all[idx], temperature=tau)
                return mu * con, {"contrastive": con.detach()}
        else:
            def extra(x: torch.Tensor, idx: torch.Tensor, z: torch.Tensor, logits: torch.Tensor,
                      epoch: int) -> ExtraTerm:
                with torch.no_grad():
                    z_glob = global_model.represent(x)  # (B, d)
                    diff = (torch.zeros_like(z_glob) if previous is None
                            else moon_reference_difference(z_glob, prev_model.represent(x)))
                con = moon_loss_from_difference(z, diff, temperature=tau)
                return mu * con, {"contrastive": con.detach()}

        return extra

    def task_train(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        result = super().task_train(site, received)
        site.state[PREVIOUS_WEIGHTS] = {k: v.clone() for k, v in result.uploads.items() if k.startswith(WEIGHT_PREFIX)}
        return result
