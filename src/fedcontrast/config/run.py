"""The run configuration as a whole (:class:`RunConfig`): every section, the federation's sites, and
(de)serialisation from YAML and dictionaries, unknown keys refused by name."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..yamlio import load_yaml_file
from .checks import MAX_IMAGE_SIZE, MAX_PROJECTION_DIM, _check, _check_types, _finite, _tuple, _typed_section
from .datasets import NATURAL, PARTITIONED, dataset_key, dataset_settings
from .sections import (
    MIN_ROBUST_SITES,
    DataSchema,
    ExecutorConfig,
    PrivacyConfig,
    PublicDataConfig,
    RobustnessConfig,
    SecureAggregationConfig,
    TrainingConfig,
    default_threshold,
    minimum_threshold,
)

SHIFTS = ("none", "scanner")  # feature_shift (fedcontrast.data.shift; kept here: the config imports no torch)

# The engine's own collaborator task, first in every round and alone in a final extra round: the
# site evaluates what it received on its own held-out data (metrics only; nothing else leaves).
EVALUATE_TASK = "evaluate"
# A site's name is its certificate's common name: OpenFL lower-cases it and uses it in file names.
SITE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; saved as ``config.yaml`` beside its results."""

    algorithm: str = "moon"
    dataset: str = "digits"
    data_root: str | None = None
    image_size: int | None = None
    test_fraction: float = 0.2
    public_fraction: float = 0.1
    # each site holds out this stratified part of its own training data as its validation split: what
    # tuning and the best round look at (construction.site_validation); never trained on
    validation_fraction: float = 0.1
    split_seed: int = 0
    partition: str = "dirichlet"
    # feature shift among the sites: none, or scanner (each site's images through a device of its own:
    # contrast, brightness, blur, noise; data/shift.py); the labels are split by ``partition`` as usual
    feature_shift: str = "none"
    clients: int = 10
    beta: float = 0.5
    shards_per_client: int = 2
    min_samples: int = 10
    model: str = "simple_cnn"
    projection_dim: int = 256
    rounds: int = 50
    sample_fraction: float = 1.0
    seed: int = 0
    target_accuracy: float | None = None
    device: str = "auto"
    training: TrainingConfig = field(default_factory=TrainingConfig)
    hyperparameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    privacy: PrivacyConfig | None = None  # differential privacy of the uploads; None: off
    # A deployment: the sites' names in order (a site's index is its position; default site_0 …),
    # the sites' data schema (the plan then needs no data) and a public folder every party holds.
    sites: tuple[str, ...] = ()
    data_schema: DataSchema | None = None
    public_data: PublicDataConfig | None = None
    # What the aggregator accepts from a site and how model weights are combined (hostile sites).
    robustness: RobustnessConfig = field(default_factory=RobustnessConfig)
    # How the simulator runs a round's sites (sequential or on Ray); not part of an OpenFL plan.
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    # The aggregator learns only the sum of the uploads (privacy/secagg.py); None: off.
    secure_aggregation: SecureAggregationConfig | None = None
    # the data set's own settings (config/datasets.py: fedprox_synthetic's alpha, beta, …); left out when none
    dataset_settings: dict[str, Any] = field(default_factory=dict)
    # modules every process of the run imports before it builds the algorithm, so that their
    # @register_algorithm takes effect (docs/plugins.md): module names, or (simulator only) paths to .py
    # files; left out when none
    plugins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "privacy", _typed_section(PrivacyConfig, self.privacy, "privacy"))
        object.__setattr__(self, "data_schema", _typed_section(DataSchema, self.data_schema, "data_schema"))
        object.__setattr__(self, "public_data", _typed_section(PublicDataConfig, self.public_data, "public_data"))
        object.__setattr__(self, "robustness",
                           _typed_section(RobustnessConfig, self.robustness, "robustness") or RobustnessConfig())
        object.__setattr__(self, "executor",
                           _typed_section(ExecutorConfig, self.executor, "executor") or ExecutorConfig())
        object.__setattr__(self, "secure_aggregation", _typed_section(SecureAggregationConfig, self.secure_aggregation,
                                                                      "secure_aggregation"))
        object.__setattr__(self, "sites", _tuple(self.sites))
        object.__setattr__(self, "plugins", _tuple(self.plugins))
        _check_types(self)
        for plugin in self.plugins:
            problem = plugin_problem(plugin)
            _check(problem is None, f"plugins: {problem}")
        _check(isinstance(self.sites, tuple) and all(isinstance(n, str) and SITE_NAME.match(n) for n in self.sites),
               f"sites must be lower-case names (letters, digits, '_', '.', '-'), got {list(self.sites)!r}")
        _check(len(set(self.sites)) == len(self.sites), f"sites names a site twice: {list(self.sites)}")
        _check(not self.sites or len(self.sites) == self.clients,
               f"clients ({self.clients}) must equal the number of sites named ({len(self.sites)})")
        _check(self.data_schema is None or self.dataset == "imagefolder",
               f"data_schema describes image folders: set dataset to imagefolder (got {self.dataset!r})")
        dataset_settings(self.dataset, self.dataset_settings)  # unknown keys and values out of range: one sentence
        if dataset_key(self.dataset) in PARTITIONED:
            _check(self.partition == NATURAL,
                   f"{self.dataset} comes split among its sites (each site's samples are its own, from the generator): "
                   f"partition {self.partition} does not apply; set partition: {NATURAL}, or leave it out")
        else:
            _check(self.partition != NATURAL,
                   f"partition {NATURAL} is the split of a data set with sites of its own "
                   f"({', '.join(sorted(PARTITIONED))}); {self.dataset} is split by dirichlet, iid or shards")
        _check(self.feature_shift in SHIFTS, f"feature_shift must be one of {', '.join(SHIFTS)}, "
                                             f"got {self.feature_shift!r}")
        owned = ("the sites own their images (a data schema)" if self.data_schema is not None
                 else f"{self.dataset} has sites of its own" if dataset_key(self.dataset) in PARTITIONED else None)
        _check(self.feature_shift == "none" or owned is None,
               f"feature_shift {self.feature_shift} simulates the sites' devices on a data set the simulator splits, "
               f"but {owned}: leave it out")
        _check(self.public_data is None or self.data_schema is not None,
               "public_data needs a data_schema (the images' shape and classes)")
        if isinstance(self.training, dict):  # RunConfig(training={...}) as well as from_dict
            try:
                object.__setattr__(self, "training", TrainingConfig(**self.training))
            except TypeError as exc:
                raise ConfigError(f"invalid training settings: {exc}") from None
        _check(isinstance(self.training, TrainingConfig), "training must be a mapping of settings")
        _check(isinstance(self.clients, int) and self.clients >= 1,
               f"clients must be an integer >= 1, got {self.clients!r}")
        _check(isinstance(self.rounds, int) and self.rounds >= 1,
               f"rounds must be an integer >= 1, got {self.rounds!r}")
        _check(_finite(self.beta) and self.beta > 0, f"beta must be a number > 0, got {self.beta!r}")
        _check(_finite(self.validation_fraction) and 0 <= self.validation_fraction <= 0.5,
               f"validation_fraction must be from 0 (no validation split) to 0.5, got {self.validation_fraction!r}")
        _check(_finite(self.sample_fraction) and 0 < self.sample_fraction <= 1,
               f"sample_fraction must be in (0, 1], got {self.sample_fraction!r}")
        _check(isinstance(self.seed, int) and self.seed >= 0, f"seed must be an integer >= 0, got {self.seed!r}")
        _check(self.image_size is None or 8 <= self.image_size <= MAX_IMAGE_SIZE,
               f"image_size must be from 8 to {MAX_IMAGE_SIZE} pixels (or left out), got {self.image_size!r}")
        _check(1 <= self.projection_dim <= MAX_PROJECTION_DIM,
               f"projection_dim must be from 1 to {MAX_PROJECTION_DIM}, got {self.projection_dim!r}")
        _check(self.target_accuracy is None or (_finite(self.target_accuracy) and 0 < self.target_accuracy <= 1),
               f"target_accuracy must be in (0, 1], got {self.target_accuracy!r}")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        _check(isinstance(self.hyperparameters, dict) and
               all(isinstance(v, dict) for v in self.hyperparameters.values()),
               "hyperparameters must map an algorithm name to a mapping of its settings")
        needs = self.robustness.cross_site_settings()
        per_round = max(1, int(round(self.sample_fraction * self.clients)))  # as the simulator selects them
        sampled = (f" ({self.clients} sites, sample_fraction {self.sample_fraction:g})"
                   if per_round != self.clients else "")
        _check(not needs or per_round >= MIN_ROBUST_SITES,
               f"robustness {' and '.join(needs)} need{'s' if len(needs) == 1 else ''} at least {MIN_ROBUST_SITES} "
               f"sites per round to tolerate one hostile site; this plan has {per_round}{sampled}")
        if self.secure_aggregation is not None:
            _check(self.robustness.rule == "mean" and not needs and self.robustness.clip_update_norm is None,
                   f"secure aggregation hides each site's upload from the aggregator, so it cannot apply "
                   f"robustness rule {self.robustness.rule!r} or checks across sites (max_update_spread, "
                   "min_update_cosine, clip_update_norm): use rule mean without them, or turn secure aggregation off")
            needed = self.secure_aggregation.sites_needed(per_round)
            _check(needed <= per_round,
                   f"secure_aggregation.threshold {needed} exceeds the {per_round} sites of a round")
            floor = minimum_threshold(per_round)
            _check(needed >= floor, f"secure_aggregation.threshold {needed} of {per_round} sites is too low: "
                                    "an operator that lies to the sites could unmask one site's upload with no site "
                                    f"colluding; use at least {floor} (a majority), or leave it out for "
                                    f"{default_threshold(per_round)}")
        if isinstance(self.robustness.max_samples, dict):
            strangers = sorted(set(self.robustness.max_samples) - set(site_names(self)))
            _check(not strangers, f"robustness.max_samples names {', '.join(strangers)}, which the plan does not "
                                  f"name as a site ({', '.join(site_names(self))})")
            missing = [n for n in site_names(self) if n not in self.robustness.max_samples]
            _check(not missing, f"robustness.max_samples gives no bound for {', '.join(missing)}, a site of the plan "
                                f"({', '.join(site_names(self))}): a site left out of the mapping would be unbounded; "
                                "give every site its declared count, or one number for all")

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = _plain(dataclasses.asdict(self))
        if self.executor == ExecutorConfig():  # the simulator's default: left out (plans, config.yaml as before)
            data.pop("executor")
        if self.secure_aggregation is None:  # off: left out too
            data.pop("secure_aggregation")
        if not self.dataset_settings:  # none: left out (plans and config.yaml as before)
            data.pop("dataset_settings")
        if not self.plugins:  # none: left out too
            data.pop("plugins")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if not isinstance(data, dict):
            raise ConfigError("a run configuration must be a mapping of settings")
        data = dict(data)
        if data.get("sites") and "clients" not in data:  # the sites named define how many there are
            data["clients"] = len(data["sites"])
        if dataset_key(data.get("dataset")) in PARTITIONED and "partition" not in data:
            data["partition"] = NATURAL  # the only partition such a data set takes
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _check(not unknown, f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        training = data.pop("training", None) or {}
        if isinstance(training, TrainingConfig):
            training = dataclasses.asdict(training)
        _check(isinstance(training, dict), "training must be a mapping of settings")
        tknown = {f.name for f in dataclasses.fields(TrainingConfig)}
        tunknown = sorted(set(training) - tknown)
        _check(not tunknown, f"unknown training setting(s) {', '.join(tunknown)}; known: {', '.join(sorted(tknown))}")
        try:
            return cls(training=TrainingConfig(**training), **data)
        except TypeError as exc:  # e.g. a list where a number belongs
            raise ConfigError(f"invalid configuration: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(load_yaml(path))

    def replace(self, **changes: Any) -> RunConfig:
        data = self.to_dict()
        if changes.get("sites") and "clients" not in changes:
            changes = {**changes, "clients": len(changes["sites"])}
        if "dataset" in changes:  # another data set: its own partition and settings unless given
            own = dataset_key(changes["dataset"]) in PARTITIONED
            if "partition" not in changes and (data["partition"] == NATURAL) != own:
                data.pop("partition")
            if "dataset_settings" not in changes and dataset_key(changes["dataset"]) != dataset_key(self.dataset):
                data.pop("dataset_settings", None)
        for key, value in changes.items():
            if key == "training":
                data["training"] = {**data["training"], **value}
            elif key in ("privacy", "data_schema", "public_data", "robustness", "executor") and \
                    dataclasses.is_dataclass(value) and not isinstance(value, type):
                data[key] = _plain(dataclasses.asdict(value))
            else:
                data[key] = value
        return RunConfig.from_dict(data)

    def training_at(self, round_num: int) -> TrainingConfig:
        """The local training settings of round ``round_num`` (the learning rate as ``training.lr_schedule``
        sets it for that round of ``rounds``): what every engine gives a site's tasks."""
        return self.training.at_round(round_num, self.rounds)

    def default_name(self) -> str:
        if self.partition == NATURAL:  # the generator's heterogeneity, not a partition's β
            own = dataset_settings(self.dataset, self.dataset_settings)
            return (f"{self.algorithm}-{self.dataset}-k{self.clients}-a{own.alpha:g}b{own.beta:g}-s{self.seed}"
                    if own is not None and hasattr(own, "alpha") else
                    f"{self.algorithm}-{self.dataset}-k{self.clients}-s{self.seed}")
        return f"{self.algorithm}-{self.dataset}-k{self.clients}-{self.partition}{self.beta:g}-s{self.seed}"


def is_plugin_file(plugin: str) -> bool:
    """A plugin given as a path to a Python file (``my_plugin.py``, ``plugins/mine.py``), not a module name."""
    return plugin.endswith(".py") or "/" in plugin or os.sep in plugin


def plugin_problem(plugin: str) -> str | None:
    """Why ``plugin`` names no plugin module (one sentence), or None: a dotted module name or a path to a
    ``.py`` file, never a module of Python's standard library nor a program's ``__main__``."""
    if not isinstance(plugin, str) or not plugin.strip():
        return f"a plugin is a module name (my_plugin, mypkg.algorithms) or a .py file, got {plugin!r}"
    name = Path(plugin).stem if is_plugin_file(plugin) else plugin
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        rule = "letters, digits and '_', not starting with a digit"
        return (f"the plugin file {plugin!r} is not named as a Python module ({rule}): rename it"
                if is_plugin_file(plugin) else
                f"{plugin!r} is not a Python module name ({rule}, dot-separated; e.g. my_plugin)")
    if "__main__" in parts:
        return f"{plugin!r} is a program's entry point (__main__), not a plugin module"
    if parts[0] in sys.stdlib_module_names:
        return (f"the plugin file {plugin!r} would be imported as {name!r}, a module of Python's standard library: "
                "rename the file" if is_plugin_file(plugin) else
                f"{plugin!r} is a module of Python's standard library, not a plugin")
    return None


def site_names(config: RunConfig) -> list[str]:
    """The federation's site names in order: ``config.sites``, or ``site_0`` … ``site_{clients-1}``."""
    return list(config.sites) or [f"site_{i}" for i in range(config.clients)]


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: what YAML and JSON write."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_yaml(path: str | Path, what: str = "configuration file") -> dict[str, Any]:
    """Read a YAML mapping; a missing file, a syntax error or a key given twice is a :class:`ConfigError`."""
    data = load_yaml_file(path, what) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of settings")
    return data
