"""FedSiam-DA: siamese stop-gradient local training and dual aggregation (Wang et al.;
docs/algorithms.md#fedsiam-da).

Collaborator: two trainable copies during a round — the site's local model ``w_k`` (with its
prediction head ``h_k``) and the received global copy ``w_f'`` (with ``h_f'``). The loss is
``CE(w_k) + μ (L_hist + L_stop)``; the global copy learns only through its prediction branch in
``L_stop``. The site uploads ``w_k`` (encoder, projection head, classifier and ``h_k``).

Aggregator: dual aggregation (:func:`fedcontrast.aggregation.dual_aggregation`); the weights ξ are
logged every round, and so is the fall-back to the first pass when no cosine is positive.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..aggregation import dual_aggregation
from ..config import TrainingConfig
from ..errors import ConfigError
from ..losses import history_loss, stop_gradient_loss
from ..models import ContrastiveNet, PredictionHead
from .base import (
    WEIGHT_PREFIX,
    Algorithm,
    Downlink,
    ServerContext,
    SiteContext,
    TaskResult,
    TensorSpec,
    load_weights,
    weight_specs,
    weight_tensors,
)
from .moon import frozen_copy, represent_all
from .registry import register_algorithm
from .training import augment, batch_indices, make_optimizer, optimizer_step, site_generator

logger = logging.getLogger(__name__)

PREDICTOR_PREFIX = "predictor."  # the prediction head h travels beside the model.* weights
LOCAL_MODEL = "fedsiam.local_model"  # site state: w_k and h_k after the site's last round


@dataclass(frozen=True)
class FedSiamHyperparameters:
    mu: float = 0.1  # the paper's best μ on CIFAR-10/100
    predictor_hidden: int = 64  # hidden width of h (SimSiam's bottleneck: a quarter of d)
    first_pass: str = "weighted"  # dual aggregation's first pass: Σ n_k/n w_k, or "mean" (paper eq. 13)
    # Where w_k starts a round: "global" — the received global model, as Algorithm 1's
    # LocalTraining(k, w_t^f) reads; the copy w_f' then starts equal to it and the two drift apart
    # during the round — or "previous": the site's own model from its last round, a persistently
    # personalised w_k (the global model on a site's first round). Measured on digits (RESULTS.md),
    # "previous" keeps the sites' models apart and the dual-aggregated global model far behind.
    local_start: str = "global"

    def __post_init__(self) -> None:
        if not (isinstance(self.mu, (int, float)) and math.isfinite(self.mu) and self.mu >= 0):
            raise ValueError(f"mu must be a number >= 0, got {self.mu!r}")
        if not (isinstance(self.predictor_hidden, int) and self.predictor_hidden >= 1):
            raise ValueError(f"predictor_hidden must be an integer >= 1, got {self.predictor_hidden!r}")
        if self.first_pass not in ("weighted", "mean"):
            raise ValueError(f"first_pass must be weighted or mean, got {self.first_pass!r}")
        if self.local_start not in ("previous", "global"):
            raise ValueError(f"local_start must be previous or global, got {self.local_start!r}")


def predictor_tensors(head: nn.Module) -> dict[str, torch.Tensor]:
    return {PREDICTOR_PREFIX + k: v.detach().clone() for k, v in head.state_dict().items() if v.is_floating_point()}


def load_predictor(head: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    state = head.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            if name.startswith(PREDICTOR_PREFIX):
                state[name[len(PREDICTOR_PREFIX):]].copy_(value)


def siamese_objective(local: ContrastiveNet, local_head: nn.Module, global_copy: ContrastiveNet, global_head: nn.Module,
                      x: torch.Tensor, y: torch.Tensor, z_prev: torch.Tensor,
                      mu: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of FedSiam-DA's local loss ``CE(w_k) + μ (L_hist + L_stop)`` (paper eq. 11).

    ``local``/``global_copy`` return ``(z, logits)``; ``z_prev`` is the local model's representation
    of ``x`` at the previous local update. Returns ``(loss, ce, l_stop, l_hist, logits)``.
    """
    z_k, logits = local(x)  # (B, d), (B, C)
    z_f = global_copy.represent(x)  # (B, d)
    ce = F.cross_entropy(logits, y)
    l_stop = stop_gradient_loss(global_head(z_f), z_f, local_head(z_k), z_k)
    l_hist = history_loss(z_prev, z_k)
    return ce + mu * (l_hist + l_stop), ce, l_stop, l_hist, logits


@register_algorithm
class FedSiamDA(Algorithm):
    """Loss ``CE + μ (L_hist + L_stop)`` with the global copy trained alongside; dual aggregation.
    Reports the global model's accuracy and, per site, the local model's (engines evaluate every
    uploaded local model, :attr:`evaluates_local_models`)."""

    name = "fedsiam_da"
    task_metrics = {"train": ("loss", "ce", "stop", "hist", "accuracy")}
    evaluation_metrics = ("accuracy", "loss", "local_accuracy", "local_loss")
    Hyperparameters = FedSiamHyperparameters
    hp: FedSiamHyperparameters
    evaluates_local_models = True

    @property
    def uploads_follow_global(self) -> bool:
        """Each upload starts from the received global model (the upload screen's stale-upload check,
        :mod:`fedcontrast.robust.replay`); not under ``local_start: previous``."""
        return self.hp.local_start == "global"

    def validate_training(self, training: TrainingConfig) -> None:
        if training.batch_size < 2:  # BatchNorm in h needs two samples per batch
            raise ConfigError("fedsiam_da needs training.batch_size >= 2 (BatchNorm in the prediction head)")

    def predictor(self, dim: int) -> PredictionHead:
        """The prediction head ``h``, built on the host (the caller moves it)."""
        with torch.device("cpu"):
            return PredictionHead(dim, self.hp.predictor_hidden)

    # --- collaborator ---------------------------------------------------------------------------
    def task_train(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        device, cfg, mu = site.device, site.training, self.hp.mu
        load_weights(site.model, received)
        global_copy = copy.deepcopy(site.model).train()
        global_head = self.predictor(site.model.projection_dim).to(device)
        load_predictor(global_head, received)
        local = copy.deepcopy(site.model).train()
        local_head = copy.deepcopy(global_head)
        previous = site.state.get(LOCAL_MODEL) if self.hp.local_start == "previous" else None
        if previous is not None:
            load_weights(local, previous)
            load_predictor(local_head, previous)
        local.requires_grad_(True)
        global_copy.requires_grad_(True)

        params = nn.ModuleList([local, local_head, global_copy, global_head])
        optimizer = make_optimizer(params, cfg)
        generator = site_generator(site.seed)
        x_all, y_all = site.data.x.to(device), site.data.y.to(device)
        totals = torch.zeros(4, device=device)  # loss, ce, l_stop, l_hist
        correct = torch.zeros((), device=device, dtype=torch.long)
        steps = seen = 0
        for epoch in range(cfg.local_epochs):
            # z_k^prev: the local model as it was at the previous local update (the start of this epoch)
            snapshot = frozen_copy(local, "fedsiam snapshot")
            cached = represent_all(snapshot, x_all) if cfg.augmentation == "none" else None
            last_epoch = epoch == cfg.local_epochs - 1
            for idx in batch_indices(len(site.data), cfg.batch_size, generator):
                idx = idx.to(device)
                x = augment(x_all[idx], cfg.augmentation, generator)
                y = y_all[idx]
                with torch.no_grad():
                    z_prev = cached[idx] if cached is not None else snapshot.represent(x)
                loss, ce, l_stop, l_hist, logits = siamese_objective(local, local_head, global_copy, global_head,
                                                                     x, y, z_prev, mu)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer_step(optimizer, cfg)
                totals += torch.stack([loss.detach(), ce.detach(), l_stop.detach(), l_hist.detach()])
                steps += 1
                if last_epoch:
                    correct += (logits.detach().argmax(1) == y).sum()
                    seen += len(y)
        loss, ce, l_stop, l_hist = (totals / max(steps, 1)).tolist()
        uploads = {**weight_tensors(local), **predictor_tensors(local_head)}
        site.state[LOCAL_MODEL] = {k: v.clone() for k, v in uploads.items()}
        return TaskResult(uploads, float(len(site.data)),
                          {"loss": loss, "ce": ce, "stop": l_stop, "hist": l_hist,
                           "accuracy": correct.item() / max(seen, 1)})

    def evaluate_at_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """The received global model (``accuracy``) and the site's own local model from its last
        round (``local_accuracy``, once it has one) on the site's held-out split."""
        from ..evaluation import evaluate_classifier

        metrics = super().evaluate_at_site(site, received, test)
        if LOCAL_MODEL in site.state:
            load_weights(site.model, site.state[LOCAL_MODEL])
            local = evaluate_classifier(site.model, test, site.device)
            metrics.update(local_accuracy=local["accuracy"], local_loss=local["loss"])
        return metrics

    # --- aggregator -----------------------------------------------------------------------------
    def initial_downlink(self, server: ServerContext) -> Downlink:
        with torch.random.fork_rng(devices=[]):  # h's initial weights: the same in every process
            torch.manual_seed(server.seed)
            head = self.predictor(server.model.projection_dim)
        return Downlink({**weight_tensors(server.model), **predictor_tensors(head)})

    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        if self.facts.robustness is not None and self.facts.robustness.rule != "mean":
            # A robust rule replaces dual aggregation: its cosine weights are a weighted mean of every upload,
            # which a poisoned model with a positive cosine would still enter.
            return Downlink(self.average_weights(uploads, weights), metrics={"dual_fallback": 0.0})
        averaged, xi = dual_aggregation(uploads, weights, first_pass=self.hp.first_pass)
        fallback = not any(v > 0 for v in xi.values())
        if fallback:
            logger.warning("round %d: no local model has a positive cosine with the first-pass average; "
                           "dual aggregation fell back to the first pass", server.round_num)
        else:
            logger.info("round %d: dual aggregation weights ξ %s", server.round_num,
                        ", ".join(f"{s}={v:.4f}" for s, v in xi.items()))
        metrics = {f"xi_{site}": value for site, value in xi.items()}
        metrics["dual_fallback"] = float(fallback)
        return Downlink(averaged, metrics=metrics)

    # --- declarations ---------------------------------------------------------------------------
    def _predictor_specs(self, model: ContrastiveNet, direction: str, description: str) -> list[TensorSpec]:
        head = self.predictor(model.projection_dim)
        return [TensorSpec(PREDICTOR_PREFIX + k, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                           direction, description=description, kind="weights")
                for k, v in head.state_dict().items() if v.is_floating_point()]

    def upload_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        return (weight_specs(model, "upload", "local model weights after training")
                + self._predictor_specs(model, "upload", "local prediction head weights"))

    def download_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        return (weight_specs(model, "download", "dual-aggregated global model weights")
                + self._predictor_specs(model, "download", "dual-aggregated prediction head"))


__all__ = ["FedSiamDA", "siamese_objective", "FedSiamHyperparameters", "LOCAL_MODEL", "PREDICTOR_PREFIX",
           "WEIGHT_PREFIX"]
