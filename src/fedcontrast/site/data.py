"""A site's data under the plan: its shard of a configured partition, or its own image folder.

``plan/data.yaml`` names each collaborator's data, one ``name,path`` line each:

* ``site_3,shard:3`` — shard 3 of the partition the run configuration defines (the embedded digits
  demo, and parity with the simulator: the same shard the simulator gives ``site_3``);
* ``hospital_a,/data/hospital_a/images`` — an institution's own folder (``imagefolder`` layout),
  read under the plan's data schema; its ``test/`` folder, or a stratified ``test_fraction`` of it,
  is held out and evaluated every round (the site's own measure of what it receives).

A ``shard:N`` site evaluates on the shared test split sub-sampled to its own label distribution.
Engines wrap :class:`SiteData` in their own data-loader class (OpenFL: ``SiteDataLoader``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..construction import data_shape, load_public, load_splits, partition, site_test_of, split_site_data
from ..data import ArrayDataset
from ..deploy.workspace import SHARD_PREFIX, shard_index
from ..errors import ConfigError, DataError, FedContrastError, SiteRefusal
from .checks import enforce_site_policy


class SiteData:
    """A site's data as its collaborator reads it, whatever engine runs it: built with the plan's
    ``data_loader`` settings as ``SiteData(data_path=..., run_config=..., network=..., model_shape=...)``;
    ``data_path`` is None when ``fx plan initialize`` builds it (then only the data's shape is needed,
    read from the plan's data schema when it has one: the operator needs no data).

    It is the first fedcontrast object a collaborator builds, so it enforces the site's own
    policy (:func:`enforce_site_policy`) before reading any data. A site's data: ``train`` (what it
    trains on), ``test`` (its own held-out split, evaluated every round), ``public`` (the plan's
    public set, if any). Any problem raises :class:`SiteRefusal` in one sentence, which the engine
    reports its own way."""

    def __init__(self, data_path: str | None = None, run_config: dict[str, Any] | None = None,
                 network: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 check_plan: Callable[[Any, Any, Any], None] | None = None,
                 policy_path: str | Path | None = None) -> None:
        """``check_plan(run_config, network, model_shape)``: the engine's check that these are the
        settings the running plan gives every component (before the policy is checked against them);
        ``policy_path``: the site's policy file, when the engine was given one (else the default of
        :func:`enforce_site_policy`)."""
        self.data_path = data_path
        self.site_index: int | None = None  # the shard's index for ``shard:N`` lines
        self.train: ArrayDataset | None = None
        self.validation: ArrayDataset | None = None  # the part of its training data it holds out (tuning)
        self.test: ArrayDataset | None = None
        self.site_policy = None  # this site's policy, if it has one (it also says what may leave the site)
        self.reported_train_size: float | None = None  # the count as released (set by the runner; noised under DP)
        # What the site's policy is checked against, kept as given (OpenFL later writes into its own copy).
        self.network = dict(network) if isinstance(network, dict) else None
        try:
            self.config = RunConfig.from_dict(run_config or {})
            if data_path is not None:  # a collaborator (not `fx plan initialize`)
                if check_plan is not None:
                    check_plan(run_config, network, model_shape)
                self.site_policy = enforce_site_policy(self.config, network, model_shape, data_path,
                                                       policy_path=policy_path)
            self._load(data_path)
        except SiteRefusal:
            raise
        except FedContrastError as exc:
            raise SiteRefusal(str(exc)) from None

    def _load(self, data_path: str | None) -> None:
        config = self.config
        if data_path is None:  # `fx plan initialize`: shapes (and the public set) only
            self.shape = data_shape(config)
            self.public = load_public(config)
        elif data_path.startswith(SHARD_PREFIX):  # the embedded demo: shard N of the configured partition
            splits = load_splits(config)
            self.site_index = shard_index(data_path, config.clients)
            shard = splits.train.subset(partition(config, splits)[self.site_index])
            self.test = site_test_of(config, splits, self.site_index, shard.y)
            self.train, self.validation = split_site_data(config, shard, self.site_index)
            self.public = splits.public
            self.shape = data_shape(config) if config.data_schema else {
                "in_channels": splits.in_channels, "image_size": splits.image_size, "num_classes": splits.num_classes}
        else:  # an institution's own folder, read under the plan's data schema
            if config.data_schema is None:
                raise ConfigError(f"this site reads its own folder {data_path}, but the plan has no data_schema to "
                                  "check it against; ask the operator for a plan made with `fedcontrast workspace "
                                  "create --input-shape C×H×W --classes ...`")
            if not os.path.isdir(data_path):
                raise DataError(f"this collaborator's data folder {data_path} (from plan/data.yaml) does not exist")
            from ..data.schema import load_site_splits

            own = load_site_splits(data_path, config.data_schema, test_fraction=config.test_fraction,
                                   split_seed=config.split_seed, public=load_public(config))
            self.test, self.public = own.test, own.public
            # its own folder: the draw needs only be the same every time this site reads it
            self.train, self.validation = split_site_data(config, own.train, 0)
            self.shape = data_shape(config)
