"""FedAvg (McMahan et al. 2017; MOON §2.1; docs/algorithms.md#fedavg): local cross-entropy SGD,
sample-weighted averaging."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .base import Downlink, ServerContext, SiteContext, TaskResult, load_weights, weight_tensors
from .capabilities import SecureSum
from .registry import register_algorithm
from .training import ExtraLoss, site_generator, train_supervised


@register_algorithm
class FedAvg(SecureSum):
    """Collaborator: E epochs of cross-entropy SGD from the global weights. Uploads: weights.
    Aggregator: ``w = Σ_k n_k/n · w_k``."""

    name = "fedavg"
    # SecureSum's defaults are FedAvg's: w = Σ n_k·w_k / Σ n_k (FedProx and MOON inherit it)
    dp_kinds = frozenset({"dp_sgd"})
    task_metrics = {"train": ("loss", "ce", "accuracy")}

    def local_loss(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> ExtraLoss | None:
        """The term added to cross-entropy; ``None`` for plain FedAvg. Called after the global
        weights are loaded into ``site.model``."""
        return None

    def task_train(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        load_weights(site.model, received)
        extra = self.local_loss(site, received)
        stats = train_supervised(site.model, site.data, site.training, generator=site_generator(site.seed),
                                 device=site.device, extra_loss=extra, private=site.privacy)
        metrics = {"loss": stats.loss, "ce": stats.ce, "accuracy": stats.accuracy}
        metrics.update(stats.components)
        uploads = weight_tensors(site.model)
        uploads.update(self.extra_uploads(site))
        return TaskResult(uploads, float(len(site.data)), metrics)

    def extra_uploads(self, site: SiteContext) -> dict[str, torch.Tensor]:
        """Tensors uploaded besides the weights; called after local training."""
        return {}

    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        return Downlink(self.average_weights(uploads, weights))
