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

from ..algorithms import Downlink, ServerContext, SiteContext, nbytes, validate_uploads
from ..config import RunConfig
from ..construction import (build_algorithm, derive_seed, initial_model, load_splits, partition, resolve_device,
                            server_seed, site_name, site_privacy, task_seed)
from .outputs import GLOBAL_SITE, metric_row

__all__ = ["Federation", "build_algorithm", "derive_seed"]

NOISE_STREAM = 0xD9  # derive_seed(task seed, NOISE_STREAM): the simulated DP noise, apart from batch order


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
        splits = self.splits = load_splits(config)
        parts = self.partition = partition(config, splits)
        on_device = (lambda d: d) if self.device.type == "cpu" else (lambda d: _to_device(d, self.device))
        self.sites = [Site(site_name(i), i, on_device(splits.train.subset(p))) for i, p in enumerate(parts)]
        self.test = on_device(splits.test)
        self.public = on_device(splits.public) if splits.public is not None else None
        model = initial_model(config, in_channels=splits.in_channels, image_size=splits.image_size,
                              num_classes=splits.num_classes).to(self.device)
        self.server = ServerContext(model=model, round_num=0, seed=server_seed(config, 0),
                                    device=self.device, num_classes=splits.num_classes, public=self.public,
                                    sites=[site.name for site in self.sites])
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

    def site_context(self, site: Site, round_num: int, seed: int) -> SiteContext:
        # Simulation only: the noise seed derives from the task seed, so runs are reproducible.
        privacy = site_privacy(self.config, site.state, round_num, noise_seed=derive_seed(seed, NOISE_STREAM))
        return SiteContext(name=site.name, data=site.data, model=self.site_model, training=self.config.training,
                           round_num=round_num, seed=seed, device=self.device, state=site.state,
                           public=self.public, index=site.index, privacy=privacy)

    def personalized_evaluation(self, round_num: int) -> dict[str, float]:
        """Each site's own model on the test split: mean ("accuracy") and spread over sites."""
        per_site = [self.algorithm.evaluate_site(self.site_context(site, round_num, 0),
                                                 self.downlink.for_site(site.name), self.test)
                    for site in self.sites]
        out: dict[str, float] = {}
        for key in per_site[0]:
            out[key], out[f"{key}_std"] = _mean_std([m[key] for m in per_site])
        return out

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
                ctx = self.site_context(site, round_num, task_seed(cfg, round_num, site.index, t))
                result = self.algorithm.run_task(task, ctx, received)
                if ctx.privacy is not None:
                    result.metrics.update(ctx.privacy.metrics())
                merged.update(result.uploads)
                weights[site.name] = result.weight
                rows.append(metric_row(round_num + 1, site.name, task, len(site.data), result.metrics,
                                       nbytes(result.uploads), down if t == 0 else 0))
            validate_uploads(site.name, merged, self.upload_specs)
            self.algorithm.check_upload(site.name, merged, weights[site.name])
            uploads[site.name] = merged
        self.server.round_num = round_num
        self.server.seed = server_seed(cfg, round_num)
        self.downlink = self.algorithm.aggregate(uploads, weights, self.server)
        evaluation = (self.personalized_evaluation(round_num) if self.algorithm.personalized
                      else self.algorithm.evaluate(self.downlink, self.server, self.test))
        rows.append(metric_row(round_num + 1, GLOBAL_SITE, "evaluate", len(self.test),
                               {**evaluation, **self.downlink.metrics}))
        return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)) ** 0.5


def _to_device(data, device: torch.device):
    return dataclasses.replace(data, x=data.x.to(device), y=data.y.to(device))
