"""OpenFL aggregation function that runs the plugin's aggregator task over the whole round.

OpenFL calls an aggregation function once per tensor name; a plugin's rule may need every tensor of
every site at once (dual aggregation, prototype fill, distillation). So the first call of a round
reads all uploads of the round from the tensor database, validates each site's upload against the
plugin's declaration, runs ``algorithm.aggregate`` once, and later calls of the round only look the
result up.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from openfl.interface.aggregation_functions.core import AggregationFunction

from ..algorithms import InvalidUploadError, ServerContext, validate_uploads
from ..config import RunConfig
from ..construction import build_algorithm, initial_model, resolve_device, server_seed
from ..errors import FedContrastError
from .runner import PERSONAL_TAG, WEIGHT_METRIC

logger = logging.getLogger(__name__)

# Sites whose upload was rejected in the current round; the aggregator reads and clears this after
# the round (see components.SafeAggregator) and stops the federation, naming them.
REJECTED: list[str] = []
# Where per-site downlinks are saved for a restarted aggregator (set by components.SafeAggregator).
PERSONAL_DIR: str | None = None


class AggregationFailure(FedContrastError):
    """The plugin's aggregator task cannot produce this round's result."""


class PluginAggregation(AggregationFunction):
    """``tasks.<task>.aggregation_type: {template: fedcontrast.openfl.aggregation.PluginAggregation,
    settings: {run_config: ..., model_shape: ...}}``."""

    def __init__(self, run_config: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None) -> None:
        super().__init__()
        self._privileged = True  # receives the tensor database itself (OpenFL holds its lock)
        self.config = RunConfig.from_dict(run_config or {})
        self.algorithm = build_algorithm(self.config)
        shape = model_shape or {}
        device = resolve_device(self.config.device)
        model = initial_model(self.config, in_channels=shape["in_channels"], image_size=shape["image_size"],
                              num_classes=shape["num_classes"]).to(device)
        self.server = ServerContext(model=model, round_num=0, seed=server_seed(self.config, 0), device=device,
                                    num_classes=shape["num_classes"])
        self.specs = self.algorithm.upload_specs(model, shape["num_classes"])
        self._round_key: tuple | None = None
        self._result: dict[str, np.ndarray] = {}

    def call(self, local_tensors, tensor_db, tensor_name: str, fl_round: int, tags: tuple[str, ...]) -> np.ndarray:
        sites = tuple(sorted(lt.col_name for lt in local_tensors))
        key = (fl_round, sites)
        if key != self._round_key:
            self._result = self._aggregate_round(tensor_db, fl_round, sites)
            self._round_key = key
        if tensor_name not in self._result:
            raise AggregationFailure(f"{self.algorithm.name} produced no tensor {tensor_name!r} in round {fl_round}")
        return self._result[tensor_name]

    def _aggregate_round(self, db, fl_round: int, sites: tuple[str, ...]) -> dict[str, np.ndarray]:
        uploads, weights = read_round(db, fl_round, sites)
        valid = {}
        for site in sites:
            try:
                if site not in weights:
                    raise InvalidUploadError(f"site {site!r} sent no aggregation weight; rejected")
                validate_uploads(site, uploads[site], self.specs)
                valid[site] = uploads[site]
            except InvalidUploadError as exc:
                logger.error("round %d: %s", fl_round, exc)
                REJECTED.append(str(exc))
        if not valid:
            raise AggregationFailure(f"round {fl_round}: every upload was rejected; nothing to aggregate")
        self.server.round_num = fl_round
        self.server.seed = server_seed(self.config, fl_round)
        self.server.sites = list(sites)
        downlink = self.algorithm.aggregate(valid, {s: weights[s] for s in valid}, self.server)
        if downlink.personal:
            origin = aggregator_origin(db)
            for site, tensors in downlink.personal.items():
                for name, tensor in tensors.items():
                    db.store(tensor_name=name, origin=origin, fl_round=fl_round + 1, tags=(site, PERSONAL_TAG),
                             nparray=tensor.detach().cpu().numpy())
            if PERSONAL_DIR is not None:
                save_personal(PERSONAL_DIR, fl_round + 1, downlink.personal)
        return {name: t.detach().cpu().numpy() for name, t in downlink.global_tensors.items()}


def aggregator_origin(db) -> str:
    """The aggregator's id, as the origin of the global model rows it wrote."""
    rows = db[db["tags"] == ("model",)]
    if len(rows) == 0:
        raise AggregationFailure("the tensor database holds no global model rows; cannot address per-site tensors")
    return rows["origin"].iloc[0]


def personal_path(directory: str, round_number: int):
    from pathlib import Path

    return Path(directory) / f"personal_round_{round_number}.pt"


def save_personal(directory: str, round_number: int, personal: dict[str, dict[str, torch.Tensor]]) -> None:
    """Per-site downlinks are not in OpenFL's persistent DB: keep them so a restart can serve them."""
    import os

    path = personal_path(directory, round_number)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({s: {k: v.detach().cpu() for k, v in t.items()} for s, t in personal.items()}, tmp)
    os.replace(tmp, path)


def read_round(db, fl_round: int, sites: tuple[str, ...]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, float]]:
    """Every site's ``trained`` tensors and aggregation weight of ``fl_round`` from the tensor DB.

    Collaborator rows carry the site name among their tags (in no fixed order); rows of the
    aggregator's own tensors do not.
    """
    uploads: dict[str, dict[str, torch.Tensor]] = {s: {} for s in sites}
    weights: dict[str, float] = {}
    wanted = set(sites)
    rows = db[db["round"] == fl_round]
    for name, row_tags, array in zip(rows["tensor_name"], rows["tags"], rows["nparray"]):
        tagset = set(row_tags)
        owners = tagset & wanted
        if len(owners) != 1:
            continue
        site = owners.pop()
        rest = tagset - {site}
        if rest == {"trained"}:
            uploads[site][name] = torch.from_numpy(np.array(array, copy=True))
        elif rest == {"metric"} and name == WEIGHT_METRIC:
            weights[site] = float(np.asarray(array))
    return uploads, weights
