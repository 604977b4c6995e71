"""The collaborator's data: its shard of a configured partition, or its own image folder.

``plan/data.yaml`` names each collaborator's data, one ``name,path`` line each:

* ``site_3,shard:3`` — shard 3 of the partition the run configuration defines (the embedded digits
  demo, and parity with the simulator: the same shard the simulator gives ``site_3``);
* ``hospital_a,/data/hospital_a/images`` — an institution's own folder (``imagefolder`` layout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from openfl.federated.data.loader import DataLoader

from ..config import RunConfig
from ..construction import load_splits, partition
from ..data import ArrayDataset, load_dataset
from ..errors import ConfigError, DataError, FedContrastError

SHARD_PREFIX = "shard:"


class SiteDataLoader(DataLoader):
    """Built by OpenFL as ``SiteDataLoader(data_path=..., run_config=..., network=..., model_shape=...)``;
    ``data_path`` is None when ``fx plan initialize`` builds it (then only the data's shape is needed).

    It is the first fedcontrast object ``fx collaborator start`` builds, so it enforces the site's own
    policy (:func:`enforce_site_policy`) before reading any data."""

    def __init__(self, data_path: str | None = None, run_config: dict[str, Any] | None = None,
                 network: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = RunConfig.from_dict(run_config or {})
        self.data_path = data_path
        if data_path is not None:  # a collaborator (not `fx plan initialize`)
            enforce_site_policy(self.config, network, model_shape, data_path)
        self.site_index: int | None = None
        if data_path is None or data_path.startswith(SHARD_PREFIX):
            splits = load_splits(self.config)
            self.meta = splits
            self.train: ArrayDataset | None = None
            if data_path is not None:
                self.site_index = _shard_index(data_path, self.config.clients)
                self.train = splits.train.subset(partition(self.config, splits)[self.site_index])
        else:
            if not os.path.isdir(data_path):
                raise DataError(f"this collaborator's data folder {data_path} (from plan/data.yaml) does not exist")
            own = load_dataset("imagefolder", root=data_path, image_size=self.config.image_size,
                               test_fraction=self.config.test_fraction, public_fraction=0.0,
                               split_seed=self.config.split_seed)
            self.meta = own
            self.train = own.train
        self.public = self.meta.public

    # --- what OpenFL calls ----------------------------------------------------------------------
    def get_feature_shape(self) -> tuple[int, ...]:
        return tuple(self.meta.train.x.shape[1:])

    def get_train_data_size(self) -> int:
        return len(self.train) if self.train is not None else 0

    def get_valid_data_size(self) -> int:
        return 0


def enforce_site_policy(config: RunConfig, network: dict[str, Any] | None, model_shape: dict[str, int] | None,
                        data_path: str, cwd: str | Path = ".") -> None:
    """Stop the collaborator (exit 1, one sentence) when the plan violates this site's policy file
    (``$FEDCONTRAST_SITE_POLICY`` or ``site_policy.yaml`` in the workspace); no file, no check."""
    from ..privacy.audit import audit_plan
    from ..privacy.policy import SitePolicy, check_policy, site_policy_path
    from .components import CollaboratorStopped

    path = site_policy_path(cwd)
    if path is None:
        return
    try:
        policy = SitePolicy.from_yaml(path)
        if network is None or model_shape is None:
            raise ConfigError("the plan does not give the data loader its network settings and model shape "
                              "(made by an older fedcontrast); regenerate it with `fedcontrast workspace create`")
        plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": network},
                "aggregator": {"settings": {"model_shape": model_shape, "rounds_to_train": config.rounds}}}
        samples = policy.site_samples or config.min_samples  # known to the site, else the plan's worst case
        report = audit_plan(plan, source="plan", sites=[("this site", data_path)], site_samples={"this site": samples})
        violations = check_policy(report, policy)
    except FedContrastError as exc:
        raise CollaboratorStopped(f"fedcontrast collaborator: error: cannot check this site's policy {path}: {exc}") from None
    if violations:
        raise CollaboratorStopped(f"fedcontrast collaborator: error: this site's policy {path} refuses the plan "
                                  f"before any data is read: {'; '.join(violations)}")


def _shard_index(data_path: str, clients: int) -> int:
    text = data_path[len(SHARD_PREFIX):].strip()
    if not text.isdigit() or not 0 <= int(text) < clients:
        raise DataError(f"data path {data_path!r} in plan/data.yaml must be shard:N with 0 <= N < {clients}")
    return int(text)
