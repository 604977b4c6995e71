"""The typed run configuration shared by the simulator (and, later, the OpenFL plans).

Every field is validated in ``__post_init__`` with :class:`ConfigError`; ``RunConfig.from_dict``
rejects unknown keys by name, so a typo in a YAML file is an error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .yamlio import load_yaml_file

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


# Sane bounds, refused at configuration time rather than met as a memory blow-up or a NaN upload later.
MAX_IMAGE_SIZE = 1024  # pixels per side of the model's input
MAX_PROJECTION_DIM = 65536
# Clipping bounds (DP-SGD's max_grad_norm, the representations' clip): far above any useful bound,
# and small enough that σ·C noise stays finite in float32.
MAX_CLIP = 1e4
# Noise multipliers σ: below 0.1 ε is in the hundreds or more (no privacy at all) and Opacus's PRV
# accountant runs out of memory; above 1e6 the noise is all there is.
MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER = 0.1, 1e6
# δ must be well below 1/n for the guarantee to mean anything (δ ≥ 1/n allows releasing a sample).
MAX_DELTA = 0.01


def _in_range(x: Any, low: float, high: float) -> bool:
    return _finite(x) and low <= x <= high


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as YAML gives it) fits the type annotation ``hint``; containers are checked
    on the outside only (the field's own check looks inside)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple or hint is tuple:
        return isinstance(value, (tuple, list))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (hint, dict))  # a mapping is converted by the field's own code
    return True


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if dataclasses.is_dataclass(hint):
        return "a mapping of settings"
    names = {type(None): "left out", bool: "true or false", int: "an integer", float: "a number", str: "a string",
             tuple: "a list", dict: "a mapping"}
    return names.get(typing.get_origin(hint) or hint, str(hint))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(obj: Any, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` checked against its annotation, so that a list where a
    number belongs (``training: [1, 2]``, ``device: 5``) is one sentence, not a traceback later."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        _check(_fits(value, hints[f.name]), f"{prefix}{f.name} must be {_describe(hints[f.name])}, got {value!r}")


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
        _check_types(self, "training.")
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


def _check_noise_multiplier(value: Any, name: str) -> None:
    _check(_in_range(value, MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
           f"{name} must be a number > 0 in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}] (below "
           f"{MIN_NOISE_MULTIPLIER:g} there is no privacy to speak of), got {value!r}")


def _check_clip(value: Any, name: str) -> None:
    _check(_finite(value) and 0 < value <= MAX_CLIP,
           f"{name} must be a number > 0 and at most {MAX_CLIP:g} (a larger bound clips nothing), got {value!r}")


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
        _check_types(self, "privacy.dp_sgd.")
        _check_noise_multiplier(self.noise_multiplier, "privacy.dp_sgd.noise_multiplier")
        _check_clip(self.max_grad_norm, "privacy.dp_sgd.max_grad_norm")


@dataclass(frozen=True)
class RepresentationDPConfig:
    """The Gaussian mechanism on uploaded per-class sums: each sample's representation clipped to
    L2 norm ``clip`` (C), noise N(0, σ²C²) on every class sum and N(0, σ²) on every count."""

    noise_multiplier: float = 1.0  # σ
    clip: float = 1.0  # C

    def __post_init__(self) -> None:
        _check_types(self, "privacy.representations.")
        _check_noise_multiplier(self.noise_multiplier, "privacy.representations.noise_multiplier")
        _check_clip(self.clip, "privacy.representations.clip")


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
        _check_types(self, "privacy.")
        _check(_finite(self.delta) and 0 < self.delta <= MAX_DELTA,
               f"privacy.delta must be in (0, {MAX_DELTA:g}], well below 1/n for the smallest site's n samples "
               f"(e.g. 1e-5), got {self.delta!r}")
        _check(self.accountant in ACCOUNTANTS,
               f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        _check_noise_multiplier(self.count_noise_multiplier, "privacy.count_noise_multiplier")
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
        _check_types(self, "data_schema.")
        shape = self.input_shape
        _check(isinstance(shape, tuple) and len(shape) == 3 and all(isinstance(v, int) and v >= 1 for v in shape),
               f"data_schema.input_shape must be three positive integers (channels, height, width), got {shape!r}")
        _check(shape[0] in (1, 3), f"data_schema.input_shape must have 1 (grey) or 3 (RGB) channels, got {shape[0]}")
        _check(shape[1] == shape[2] and 8 <= shape[1] <= MAX_IMAGE_SIZE,
               f"data_schema.input_shape must be square, from 8×8 to {MAX_IMAGE_SIZE}×{MAX_IMAGE_SIZE} pixels, "
               f"got {shape[1]}×{shape[2]}")
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
        _check_types(self, "public_data.")
        _check(isinstance(self.sha256, str) and SHA256_HEX.match(self.sha256) is not None,
               f"public_data.sha256 must be 64 lower-case hex digits (`fedcontrast public fingerprint FOLDER`), "
               f"got {self.sha256!r}")
        _check(isinstance(self.folder, str) and self.folder.strip() != "", "public_data.folder must be a path")


ROBUST_RULES = ("mean", "median", "trimmed_mean")
# A coordinate-wise median or trimmed mean tolerates f hostile sites of 2f + 1; with 2 it is the plain
# mean. The cross-site checks likewise need two others to compare a site with.
MIN_ROBUST_SITES = 3
ON_REJECTED = ("stop", "exclude")


@dataclass(frozen=True)
class RobustnessConfig:
    """What the aggregator accepts from a site and how it combines model weights (every engine
    applies it before the plugin aggregates: :mod:`fedcontrast.robust`).

    ``max_samples``: the most samples (aggregation weight) a site may claim — one number for every
    site, or a mapping site → the count it declared at enrolment; None: no bound. ``max_update_ratio``:
    an upload whose model update ``‖w_k − w‖`` exceeds this multiple of the global model's norm ``‖w‖``
    is rejected (the default 10 stops absurd uploads; honest training moved digits models by ≤ 0.04 of
    ``‖w‖`` per round: set it a few times above the honest ratio where sites may be hostile). ``clip_update_norm``: each accepted update is
    scaled to at most this L2 norm. ``rule``: how model weights are combined — ``mean`` (each plugin's
    own weighted average), ``median`` or ``trimmed_mean`` (coordinate-wise, unweighted, dropping
    ``⌊trim_fraction·K⌋`` (at least one) of the K sites' values at each end). ``reject_replays``:
    an upload identical to one the same site sent in an earlier round is rejected. ``on_rejected``:
    ``stop`` — the round is aggregated without the rejected upload(s), then the federation stops
    naming the senders (the operator looks before going on); ``exclude`` — it goes on without them.

    Across the sites of a round (at least 3 with model weights; unweighted): ``max_update_spread``
    rejects an update whose norm exceeds this multiple of the median norm of the other sites'
    updates; ``min_update_cosine`` rejects an update whose cosine to the coordinate-wise median of
    the other sites' update directions is below it (lowest first, recomputed without it, while 3
    remain). Both off by default: on non-IID sites honest updates point against each other (digits,
    Dir(0.5): cosines down to −0.94 with 3 sites, −0.83 with 5; norms within 2.6× of the others'
    median: benchmarks/RESULTS.md).
    """

    rule: str = "mean"
    trim_fraction: float = 0.2
    clip_update_norm: float | None = None
    max_update_ratio: float | None = 10.0
    max_samples: float | dict[str, float] | None = None
    reject_replays: bool = True
    on_rejected: str = "stop"
    max_update_spread: float | None = None
    min_update_cosine: float | None = None

    def __post_init__(self) -> None:
        _check_types(self, "robustness.")
        _check(self.rule in ROBUST_RULES,
               f"robustness.rule must be one of {', '.join(ROBUST_RULES)}, got {self.rule!r}")
        _check(_finite(self.trim_fraction) and 0 <= self.trim_fraction < 0.5,
               f"robustness.trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        for name in ("clip_update_norm", "max_update_ratio"):
            value = getattr(self, name)
            _check(value is None or (_finite(value) and value > 0),
                   f"robustness.{name} must be a number > 0 or left out, got {value!r}")
        bound = self.max_samples
        values = list(bound.values()) if isinstance(bound, dict) else [bound]
        _check(bound is None or all(_finite(v) and v > 0 for v in values),
               "robustness.max_samples must be a number > 0, or a mapping site → number > 0, or left out; "
               f"got {bound!r}")
        _check(self.on_rejected in ON_REJECTED,
               f"robustness.on_rejected must be one of {', '.join(ON_REJECTED)}, got {self.on_rejected!r}")
        _check(self.max_update_spread is None or (_finite(self.max_update_spread) and self.max_update_spread > 1),
               f"robustness.max_update_spread must be a number > 1 or left out, got {self.max_update_spread!r}")
        cosine = self.min_update_cosine
        _check(cosine is None or (_finite(cosine) and -1 <= cosine <= 1),
               f"robustness.min_update_cosine must be in [-1, 1] or left out, got {cosine!r}")

    def cross_site_settings(self) -> list[str]:
        """The settings that compare the sites of a round with each other: each needs at least
        :data:`MIN_ROBUST_SITES` sites in a round to tolerate one hostile site."""
        needs = [f"rule {self.rule}"] if self.rule != "mean" else []
        return needs + [name for name in ("max_update_spread", "min_update_cosine") if getattr(self, name) is not None]


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
    # What the aggregator accepts from a site and how model weights are combined (hostile sites).
    robustness: RobustnessConfig = field(default_factory=RobustnessConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "privacy", _typed_section(PrivacyConfig, self.privacy, "privacy"))
        object.__setattr__(self, "data_schema", _typed_section(DataSchema, self.data_schema, "data_schema"))
        object.__setattr__(self, "public_data", _typed_section(PublicDataConfig, self.public_data, "public_data"))
        object.__setattr__(self, "robustness",
                           _typed_section(RobustnessConfig, self.robustness, "robustness") or RobustnessConfig())
        object.__setattr__(self, "sites", _tuple(self.sites))
        _check_types(self)
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
        if isinstance(self.robustness.max_samples, dict):
            strangers = sorted(set(self.robustness.max_samples) - set(site_names(self)))
            _check(not strangers, f"robustness.max_samples names {', '.join(strangers)}, which the plan does not "
                                  f"name as a site ({', '.join(site_names(self))})")

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


def load_yaml(path: str | Path, what: str = "configuration file") -> dict[str, Any]:
    """Read a YAML mapping; a missing file, a syntax error or a key given twice is a :class:`ConfigError`."""
    data = load_yaml_file(path, what) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of settings")
    return data
