"""The typed run configuration shared by the simulator (and, later, the OpenFL plans).

Every field is validated in ``__post_init__`` with :class:`ConfigError`; ``RunConfig.from_dict``
rejects unknown keys by name, so a typo in a YAML file is an error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

AUGMENTATIONS = ("none", "crop", "crop_flip")
ACCOUNTANTS = ("rdp", "prv")
# A site's name is its certificate's common name: OpenFL lower-cases it and uses it in file names.
SITE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class TrainingConfig:
    """Local SGD settings shared by every supervised algorithm (MOON §4.1 defaults)."""

    local_epochs: int = 10
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-5
    augmentation: str = "none"

    def __post_init__(self) -> None:
        _check(isinstance(self.local_epochs, int) and self.local_epochs >= 1,
               f"training.local_epochs must be an integer >= 1, got {self.local_epochs!r}")
        _check(isinstance(self.batch_size, int) and self.batch_size >= 2,
               f"training.batch_size must be an integer >= 2, got {self.batch_size!r}")
        _check(_finite(self.lr) and self.lr > 0, f"training.lr must be a number > 0, got {self.lr!r}")
        _check(_finite(self.momentum) and 0 <= self.momentum < 1,
               f"training.momentum must be in [0, 1), got {self.momentum!r}")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0,
               f"training.weight_decay must be >= 0, got {self.weight_decay!r}")
        _check(self.augmentation in AUGMENTATIONS,
               f"training.augmentation must be one of {', '.join(AUGMENTATIONS)}, got {self.augmentation!r}")


def _typed_section(cls: type, value: Any, name: str) -> Any:
    """``value`` as ``cls``: a mapping is checked for unknown keys and converted; None stays None."""
    if value is None or isinstance(value, cls):
        return value
    _check(isinstance(value, dict), f"{name} must be a mapping of settings")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    _check(not unknown, f"unknown {name} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**value)
    except TypeError as exc:
        raise ConfigError(f"invalid {name} settings: {exc}") from None


@dataclass(frozen=True)
class DPSGDConfig:
    """DP-SGD of local training (Opacus): per-sample gradients clipped to ``max_grad_norm``,
    Gaussian noise of standard deviation ``noise_multiplier · max_grad_norm``, Poisson batches."""

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        _check(_finite(self.noise_multiplier) and self.noise_multiplier > 0,
               f"privacy.dp_sgd.noise_multiplier must be a number > 0, got {self.noise_multiplier!r}")
        _check(_finite(self.max_grad_norm) and self.max_grad_norm > 0,
               f"privacy.dp_sgd.max_grad_norm must be a number > 0, got {self.max_grad_norm!r}")


@dataclass(frozen=True)
class RepresentationDPConfig:
    """The Gaussian mechanism on uploaded per-class sums: each sample's representation clipped to
    L2 norm ``clip`` (C), noise N(0, σ²C²) on every class sum and N(0, σ²) on every count."""

    noise_multiplier: float = 1.0  # σ
    clip: float = 1.0  # C

    def __post_init__(self) -> None:
        _check(_finite(self.noise_multiplier) and self.noise_multiplier > 0,
               f"privacy.representations.noise_multiplier must be a number > 0, got {self.noise_multiplier!r}")
        _check(_finite(self.clip) and self.clip > 0,
               f"privacy.representations.clip must be a number > 0, got {self.clip!r}")


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy of what leaves a site; a section left out (None) is off.

    Both mechanisms are composed in one accountant (``rdp`` or ``prv``) and reported at ``delta``."""

    delta: float = 1e-5
    accountant: str = "rdp"
    dp_sgd: DPSGDConfig | None = None
    representations: RepresentationDPConfig | None = None
    # A site's sample count (its aggregation weight) is released once, as n + N(0, σ²) with this σ
    # (sensitivity 1), and reused every round; a site whose policy declares its count public sends it exact.
    count_noise_multiplier: float = 10.0
    # Noise sampled robustly against floating-point attacks (Opacus's secure noise): None = on under
    # OpenFL, off in the simulator (reproducible either way: the simulator's noise is seeded).
    secure_mode: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp_sgd", _typed_section(DPSGDConfig, self.dp_sgd, "privacy.dp_sgd"))
        object.__setattr__(self, "representations", _typed_section(
            RepresentationDPConfig, self.representations, "privacy.representations"))
        _check(_finite(self.delta) and 0 < self.delta < 1, f"privacy.delta must be in (0, 1), got {self.delta!r}")
        _check(self.accountant in ACCOUNTANTS,
               f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        _check(_finite(self.count_noise_multiplier) and self.count_noise_multiplier > 0,
               f"privacy.count_noise_multiplier must be a number > 0, got {self.count_noise_multiplier!r}")
        _check(self.secure_mode in (None, True, False),
               f"privacy.secure_mode must be true, false or left out, got {self.secure_mode!r}")
        _check(self.dp_sgd is not None or self.representations is not None,
               "privacy needs dp_sgd or representations (or both); leave the section out to turn privacy off")

    @property
    def kinds(self) -> frozenset[str]:
        """The mechanisms turned on: a subset of {"dp_sgd", "representations"}."""
        return frozenset(k for k in ("dp_sgd", "representations") if getattr(self, k) is not None)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class DataSchema:
    """What every site's images look like, so that a plan can be made without any data.

    ``input_shape`` is ``(channels, height, width)`` of the model's input (square images; a site's
    images are resized to it), ``classes`` the class folder names in label order (a site may lack
    some classes, but may not hold others). ``mean``/``std``: per-channel normalisation applied by
    every party alike; left out, each party normalises with its own training images' statistics.
    """

    input_shape: tuple[int, int, int]
    classes: tuple[str, ...]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("input_shape", "classes", "mean", "std"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))
        shape = self.input_shape
        _check(isinstance(shape, tuple) and len(shape) == 3 and all(isinstance(v, int) and v >= 1 for v in shape),
               f"data_schema.input_shape must be three positive integers (channels, height, width), got {shape!r}")
        _check(shape[0] in (1, 3), f"data_schema.input_shape must have 1 (grey) or 3 (RGB) channels, got {shape[0]}")
        _check(shape[1] == shape[2] and shape[1] >= 8,
               f"data_schema.input_shape must be square and at least 8×8 pixels, got {shape[1]}×{shape[2]}")
        classes = self.classes
        _check(isinstance(classes, tuple) and len(classes) >= 2 and all(isinstance(c, str) and c for c in classes),
               f"data_schema.classes must name at least two classes (folder names), got {classes!r}")
        _check(len(set(classes)) == len(classes), f"data_schema.classes names a class twice: {list(classes)}")
        _check(all("/" not in c and not c.startswith(".") for c in classes),
               "data_schema.classes must be plain folder names (no '/', not hidden)")
        _check((self.mean is None) == (self.std is None), "data_schema needs both mean and std, or neither")
        if self.mean is not None:
            for name in ("mean", "std"):
                values = getattr(self, name)
                _check(isinstance(values, tuple) and len(values) == shape[0] and all(_finite(v) for v in values),
                       f"data_schema.{name} must give one number per channel ({shape[0]}), got {values!r}")
            _check(all(v > 0 for v in self.std), f"data_schema.std must be > 0, got {self.std!r}")

    @property
    def in_channels(self) -> int:
        return self.input_shape[0]

    @property
    def image_size(self) -> int:
        return self.input_shape[1]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        return (self.mean, self.std) if self.mean is not None else None


@dataclass(frozen=True)
class PublicDataConfig:
    """A public image folder that every party holds (FLESD distils on it; FedPCL's backbones are
    pre-trained on it): ``folder`` (relative paths are relative to each party's workspace) and the
    SHA-256 fingerprint of its files, which every site and the aggregator check at start-up."""

    sha256: str
    folder: str = "public"

    def __post_init__(self) -> None:
        _check(isinstance(self.sha256, str) and SHA256_HEX.match(self.sha256) is not None,
               f"public_data.sha256 must be 64 lower-case hex digits (`fedcontrast public fingerprint FOLDER`), "
               f"got {self.sha256!r}")
        _check(isinstance(self.folder, str) and self.folder.strip() != "", "public_data.folder must be a path")


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run; saved as ``config.yaml`` beside its results."""

    algorithm: str = "moon"
    dataset: str = "digits"
    data_root: str | None = None
    image_size: int | None = None
    test_fraction: float = 0.2
    public_fraction: float = 0.1
    split_seed: int = 0
    partition: str = "dirichlet"
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "privacy", _typed_section(PrivacyConfig, self.privacy, "privacy"))
        object.__setattr__(self, "data_schema", _typed_section(DataSchema, self.data_schema, "data_schema"))
        object.__setattr__(self, "public_data", _typed_section(PublicDataConfig, self.public_data, "public_data"))
        object.__setattr__(self, "sites", _tuple(self.sites))
        _check(isinstance(self.sites, tuple) and all(isinstance(n, str) and SITE_NAME.match(n) for n in self.sites),
               f"sites must be lower-case names (letters, digits, '_', '.', '-'), got {list(self.sites)!r}")
        _check(len(set(self.sites)) == len(self.sites), f"sites names a site twice: {list(self.sites)}")
        _check(not self.sites or len(self.sites) == self.clients,
               f"clients ({self.clients}) must equal the number of sites named ({len(self.sites)})")
        _check(self.data_schema is None or self.dataset == "imagefolder",
               f"data_schema describes image folders: set dataset to imagefolder (got {self.dataset!r})")
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
        _check(_finite(self.sample_fraction) and 0 < self.sample_fraction <= 1,
               f"sample_fraction must be in (0, 1], got {self.sample_fraction!r}")
        _check(isinstance(self.seed, int) and self.seed >= 0, f"seed must be an integer >= 0, got {self.seed!r}")
        _check(self.target_accuracy is None or (_finite(self.target_accuracy) and 0 < self.target_accuracy <= 1),
               f"target_accuracy must be in (0, 1], got {self.target_accuracy!r}")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        _check(isinstance(self.hyperparameters, dict) and
               all(isinstance(v, dict) for v in self.hyperparameters.values()),
               "hyperparameters must map an algorithm name to a mapping of its settings")

    # --- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if not isinstance(data, dict):
            raise ConfigError("a run configuration must be a mapping of settings")
        data = dict(data)
        if data.get("sites") and "clients" not in data:  # the sites named define how many there are
            data["clients"] = len(data["sites"])
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
        for key, value in changes.items():
            if key == "training":
                data["training"] = {**data["training"], **value}
            elif key in ("privacy", "data_schema", "public_data") and dataclasses.is_dataclass(value):
                data[key] = _plain(dataclasses.asdict(value))
            else:
                data[key] = value
        return RunConfig.from_dict(data)

    def default_name(self) -> str:
        return f"{self.algorithm}-{self.dataset}-k{self.clients}-{self.partition}{self.beta:g}-s{self.seed}"


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


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; missing files and syntax errors become :class:`ConfigError`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"configuration file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"configuration file {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {p} must hold a mapping of settings")
    return data
