"""An in-process federation: the sites, the server and one round, driven through the plugin calls.

This is the whole engine of the simulator; it holds no algorithm logic. The OpenFL glue drives the
same plugin calls (``run_task``, ``aggregate``) across processes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..algorithms import (Algorithm, Downlink, ServerContext, SiteContext, get_algorithm, nbytes,
                          validate_uploads)
from ..config import RunConfig
from ..data import load_dataset, partition_indices
from ..errors import ConfigError
from ..models import build_model
from .outputs import GLOBAL_SITE, metric_row


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was requested but CUDA is not available on this machine")
    return torch.device(name)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers: the same parts always give the same seed, any process."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def build_algorithm(config: RunConfig) -> Algorithm:
    """The configured plugin; settings for other algorithms are validated too, so typos surface."""
    for name, settings in config.hyperparameters.items():
        get_algorithm(name).from_settings(settings)
    algorithm = get_algorithm(config.algorithm).from_settings(config.hyperparameters.get(config.algorithm))
    algorithm.validate_training(config.training)
    return algorithm


@dataclass
class Site:
    name: str
    index: int
    data: Any  # ArrayDataset
    state: dict[str, Any] = field(default_factory=dict)


class Federation:
    """Sites holding their shards and state, a server holding the downlink, one plugin."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.algorithm = build_algorithm(config)
        splits = load_dataset(config.dataset, root=config.data_root, image_size=config.image_size,
                              test_fraction=config.test_fraction, public_fraction=config.public_fraction,
                              split_seed=config.split_seed)
        self.splits = splits
        parts = partition_indices(splits.train.y.numpy(), config.clients, method=config.partition,
                                  beta=config.beta, shards_per_client=config.shards_per_client,
                                  min_samples=config.min_samples, seed=config.seed)
        self.partition = parts
        on_device = (lambda d: d) if self.device.type == "cpu" else (lambda d: _to_device(d, self.device))
        self.sites = [Site(f"site_{i}", i, on_device(splits.train.subset(p))) for i, p in enumerate(parts)]
        self.test = on_device(splits.test)
        self.public = on_device(splits.public) if splits.public is not None else None
        torch.manual_seed(config.seed)  # the initial global model
        model = build_model(config.model, in_channels=splits.in_channels, image_size=splits.image_size,
                            num_classes=splits.num_classes, projection_dim=config.projection_dim).to(self.device)
        self.server = ServerContext(model=model, round_num=0, seed=derive_seed(config.seed, 0, 1 << 20),
                                    device=self.device, num_classes=splits.num_classes, public=self.public)
        self.site_model = copy.deepcopy(model)  # scratch network the site tasks load weights into
        self.upload_specs = self.algorithm.upload_specs(model, splits.num_classes)
        self.downlink: Downlink = self.algorithm.initial_downlink(self.server)

    # --- state for checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"downlink": {"global": self.downlink.global_tensors, "personal": self.downlink.personal,
                             "metrics": self.downlink.metrics},
                "server_state": self.server.state,
                "site_states": {s.name: s.state for s in self.sites}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        d = state["downlink"]
        self.downlink = Downlink(dict(d["global"]), dict(d["personal"]), dict(d["metrics"]))
        self.server.state = state["server_state"]
        for site in self.sites:
            site.state = state["site_states"][site.name]

    # --- one round ----------------------------------------------------------------------------
    def select_sites(self, round_num: int) -> list[Site]:
        k = len(self.sites)
        m = max(1, int(round(self.config.sample_fraction * k)))
        if m == k:
            return list(self.sites)
        rng = np.random.default_rng([self.config.seed, round_num, 7919])
        return [self.sites[i] for i in sorted(rng.choice(k, m, replace=False))]

    def run_round(self, round_num: int) -> list[dict[str, Any]]:
        """Run round ``round_num`` (0-based); returns its metrics rows (``round`` is 1-based)."""
        cfg = self.config
        uploads: dict[str, dict[str, torch.Tensor]] = {}
        weights: dict[str, float] = {}
        rows = []
        for site in self.select_sites(round_num):
            received = self.downlink.for_site(site.name)
            down = nbytes(received)
            merged: dict[str, torch.Tensor] = {}
            for t, task in enumerate(self.algorithm.tasks):
                ctx = SiteContext(name=site.name, data=site.data, model=self.site_model, training=cfg.training,
                                  round_num=round_num, seed=derive_seed(cfg.seed, round_num, site.index, t),
                                  device=self.device, state=site.state, public=self.public)
                result = self.algorithm.run_task(task, ctx, received)
                merged.update(result.uploads)
                weights[site.name] = result.weight
                rows.append(metric_row(round_num + 1, site.name, task, len(site.data), result.metrics,
                                       nbytes(result.uploads), down if t == 0 else 0))
            validate_uploads(site.name, merged, self.upload_specs)
            uploads[site.name] = merged
        self.server.round_num = round_num
        self.server.seed = derive_seed(cfg.seed, round_num, 1 << 20)
        self.downlink = self.algorithm.aggregate(uploads, weights, self.server)
        evaluation = self.algorithm.evaluate(self.downlink, self.server, self.test)
        rows.append(metric_row(round_num + 1, GLOBAL_SITE, "evaluate", len(self.test),
                               {**evaluation, **self.downlink.metrics}))
        return rows


def _to_device(data, device: torch.device):
    return dataclasses.replace(data, x=data.x.to(device), y=data.y.to(device))
