"""The collaborator's data: its shard of a configured partition, or its own image folder.

``plan/data.yaml`` names each collaborator's data, one ``name,path`` line each:

* ``site_3,shard:3`` — shard 3 of the partition the run configuration defines (the embedded digits
  demo, and parity with the simulator: the same shard the simulator gives ``site_3``);
* ``hospital_a,/data/hospital_a/images`` — an institution's own folder (``imagefolder`` layout),
  read under the plan's data schema; its ``test/`` folder, or a stratified ``test_fraction`` of it,
  is held out and evaluated every round (the site's own measure of what it receives).

A ``shard:N`` site evaluates on the shared test split sub-sampled to its own label distribution.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from openfl.federated.data.loader import DataLoader

from ..config import RunConfig
from ..construction import data_shape, load_public, load_splits, partition, site_test_split
from ..data import ArrayDataset
from ..errors import ConfigError, DataError, FedContrastError
from .plan import OPENFL_NETWORK_KEYS, fx_plan_path, load_plan_file
# defined without OpenFL (site start and the doctor run them before fx): kept importable from here
from .sitecheck import SHARD_PREFIX, _shard_index, enforce_site_policy  # noqa: F401


class SiteDataLoader(DataLoader):
    """Built by OpenFL as ``SiteDataLoader(data_path=..., run_config=..., network=..., model_shape=...)``;
    ``data_path`` is None when ``fx plan initialize`` builds it (then only the data's shape is needed,
    read from the plan's data schema when it has one: the operator needs no data).

    It is the first fedcontrast object ``fx collaborator start`` builds, so it enforces the site's own
    policy (:func:`enforce_site_policy`) before reading any data. A site's data: ``train`` (what it
    trains on), ``test`` (its own held-out split, evaluated every round), ``public`` (the plan's
    public set, if any). Any problem ends the process with one sentence and exit code 1."""

    def __init__(self, data_path: str | None = None, run_config: dict[str, Any] | None = None,
                 network: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from .components import CollaboratorStopped

        self.data_path = data_path
        self.site_index: int | None = None  # the shard's index for ``shard:N`` lines
        self.train: ArrayDataset | None = None
        self.test: ArrayDataset | None = None
        self.site_policy = None  # this site's policy, if it has one (it also says what may leave the site)
        self.reported_train_size: float | None = None  # the count as released (set by the runner; noised under DP)
        # What the site's policy is checked against, kept as given (OpenFL later writes into its own copy).
        self.network = dict(network) if isinstance(network, dict) else None
        try:
            self.config = RunConfig.from_dict(run_config or {})
            if data_path is not None:  # a collaborator (not `fx plan initialize`)
                check_running_plan(run_config, network, model_shape)
                self.site_policy = enforce_site_policy(self.config, network, model_shape, data_path)
            self._load(data_path)
        except FedContrastError as exc:
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {exc}") from None

    def _load(self, data_path: str | None) -> None:
        config = self.config
        if data_path is None:  # `fx plan initialize`: shapes (and the public set) only
            self.shape = data_shape(config)
            self.public = load_public(config)
        elif data_path.startswith(SHARD_PREFIX):  # the embedded demo: shard N of the configured partition
            splits = load_splits(config)
            self.site_index = _shard_index(data_path, config.clients)
            self.train = splits.train.subset(partition(config, splits)[self.site_index])
            self.test = site_test_split(splits.test, self.train.y, seed=config.split_seed + self.site_index)
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
            self.train, self.test, self.public = own.train, own.test, own.public
            self.shape = data_shape(config)

    # --- what OpenFL calls ----------------------------------------------------------------------
    def get_feature_shape(self) -> tuple[int, ...]:
        return (self.shape["in_channels"], self.shape["image_size"], self.shape["image_size"])

    def get_train_data_size(self) -> int:
        """What OpenFL sends as a "train" task's data size (an integer field): the count as this site
        releases it, rounded (post-processing of the release)."""
        if self.reported_train_size is not None:
            return max(1, round(self.reported_train_size))
        return len(self.train) if self.train is not None else 0

    def get_valid_data_size(self) -> int:
        return len(self.test) if self.test is not None else 0


def check_running_plan(run_config: Any, network: Any, model_shape: Any, argv: list[str] | None = None,
                       cwd: str | Path = ".") -> None:
    """The site's policy is checked against this loader's settings, but training, the connection and
    the aggregator read their own copies: check that the plan ``fx collaborator start`` parsed gives
    every component the same (:func:`~.plan.check_plan_consistency`), and that this loader was given
    that plan's settings. Outside ``fx collaborator start`` (a program building its own loader)
    there is no plan file to compare with."""
    path = fx_plan_path("collaborator", argv, cwd)
    if path is None:
        return
    plan = load_plan_file(path)
    settings = plan.get("data_loader", {}).get("settings") or {}
    given = {"run_config": run_config, "network": network, "model_shape": model_shape}
    differ = [key for key, value in given.items() if _resolved(value) != _resolved(settings.get(key), value)]
    if differ:
        raise ConfigError(f"this collaborator's data loader was not given the data_loader settings of {path} "
                          f"(differ: {', '.join(differ)}); start it with that plan: fx collaborator start -p {path}")


def _resolved(value: Any, running: Any = None) -> Any:
    """``value`` without what OpenFL fills in at start-up (certificate paths; ``auto`` address or port)."""
    if not isinstance(value, dict):
        return value
    out = {k: v for k, v in value.items() if k not in OPENFL_NETWORK_KEYS}
    for key in ("agg_addr", "agg_port"):
        if out.get(key) == "auto" and isinstance(running, dict) and key in running:
            out[key] = running[key]
    return out
