"""The sections of a run configuration: local training, differential privacy, the sites' data
schema, the public data set, robustness against hostile sites, the executor and secure aggregation
(:mod:`.secure_aggregation`, re-exported here with its thresholds). Each is a frozen dataclass whose
``__post_init__`` refuses a bad value with one :class:`~fedcontrast.errors.ConfigError` sentence."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from .checks import (
    MAX_DELTA,
    MAX_IMAGE_SIZE,
    _check,
    _check_clip,
    _check_noise_multiplier,
    _check_types,
    _finite,
    _tuple,
    _typed_section,
)
from .secure_aggregation import (  # noqa: F401 (re-exported: their home was here)
    FEDERATION_ID,
    SecureAggregationConfig,
    colluders_tolerated,
    default_threshold,
    minimum_threshold,
)

AUGMENTATIONS = ("none", "crop", "crop_flip")
LR_SCHEDULES = ("constant", "cosine")
ACCOUNTANTS = ("rdp", "prv")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class TrainingConfig:
    """Local SGD settings shared by every supervised algorithm: MOON's (§4.1: 10 epochs, batch 64, lr
    0.01, momentum 0.9, weight decay 1e-5) and three that keep a few hundred images per site from
    running local training past what it can learn (docs/results.md, "Why MOON collapsed"):

    - ``augmentation: crop`` — each batch shifted by up to 2 pixels (the padded random crops MOON's
      reference code trains on; no flips, which would change a digit): cross-entropy keeps a gradient
      (2.5× larger at a round's start) after the first epoch, where MOON's contrastive term drove alone;
    - ``lr_schedule: cosine`` — the rate falls across rounds, so what a site still moves shrinks;
    - ``clip_grad_norm: 5`` — no step follows a gradient over 5 in L2 (FedAvg's largest on the README's
      job: 18; MOON's reached 163 in the step that collapsed a site's model).

    ``none``, ``constant`` and ``0`` give the paper's plain settings back."""

    local_epochs: int = 10
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-5
    augmentation: str = "crop"
    # the L2 norm of a step's whole gradient is clipped to this (None or 0: not clipped); under DP-SGD
    # each sample's gradient is clipped instead (privacy.dp_sgd.max_grad_norm) and this is not applied
    clip_grad_norm: float | None = 5.0
    # the learning rate across rounds: constant, or cosine (round r of R trains at
    # lr · ½(1 + cos(π (r − 1) / R)): the full rate first, about none in the last round)
    lr_schedule: str = "cosine"

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
        _check(self.clip_grad_norm is None or (_finite(self.clip_grad_norm) and self.clip_grad_norm >= 0),
               f"training.clip_grad_norm must be a number > 0, or 0 (or null) for no clipping, "
               f"got {self.clip_grad_norm!r}")
        _check(self.lr_schedule in LR_SCHEDULES,
               f"training.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")

    def at_round(self, round_num: int, rounds: int) -> TrainingConfig:
        """The settings a site trains with in round ``round_num`` of ``rounds``: ``lr`` as the schedule
        sets it (a round past the last one, the final evaluation, counts as the last)."""
        if self.lr_schedule == "constant":
            return self
        r = min(max(round_num, 1), rounds)
        return dataclasses.replace(self, lr=self.lr * 0.5 * (1 + math.cos(math.pi * (r - 1) / rounds)))


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


@dataclass(frozen=True)
class DataSchema:
    """What every site's images look like, so that a plan can be made without any data.

    ``input_shape`` is ``(channels, height, width)`` of the model's input (square images; a site's
    images are resized to it), ``classes`` the class folder names in label order (a site may lack
    some classes, but may not hold others). ``mean``/``std``: per-channel normalisation applied by
    every party alike; left out, each party normalises with its own training images' statistics.
    ``window``: for DICOM images, the (center, width) of the linear window applied to the values after
    the file's rescale slope and intercept (e.g. Hounsfield units: (40, 400) for soft tissue); left
    out, each file's own WindowCenter/WindowWidth, else its stored range.
    """

    input_shape: tuple[int, int, int]
    classes: tuple[str, ...]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("input_shape", "classes", "mean", "std", "window"):
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
            _check(all(v > 0 for v in self.std or ()), f"data_schema.std must be > 0, got {self.std!r}")
        window = self.window
        _check(window is None or (isinstance(window, tuple) and len(window) == 2 and all(_finite(v) for v in window)
                                  and window[1] >= 1),
               f"data_schema.window must be a DICOM window [center, width] with width >= 1, got {window!r}")

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
        return (self.mean, self.std) if self.mean is not None and self.std is not None else None  # both or neither


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

    ``max_samples``: the most samples (aggregation weight) a site may claim — one number for every site,
    or a mapping site → the count it declared at enrolment; None: no bound. ``max_update_ratio``: an
    upload whose model update ``‖w_k − w‖`` exceeds this multiple of the global model's norm ``‖w‖`` is
    rejected (the default 10 stops absurd uploads; honest training moved digits models by ≤ 0.04 of
    ``‖w‖`` per round: set it a few times above the honest ratio where sites may be hostile).
    ``clip_update_norm``: each accepted update is scaled to at most this L2 norm. ``rule``: how model
    weights are combined — ``mean`` (each plugin's own weighted average), ``median`` or ``trimmed_mean``
    (coordinate-wise, unweighted, dropping ``⌊trim_fraction·K⌋`` (at least one) of the K sites' values at
    each end). ``reject_replays``: an upload identical to one the same site sent in an earlier round is
    rejected, and so is a stale one: nearer to an earlier one than ``min_progress`` × the global model's
    move between them (None: than 10⁻⁵ of its norm only; :mod:`fedcontrast.robust.replay`). ``on_rejected``:
    ``stop`` — the round is aggregated without the rejected upload(s), then the federation stops naming the
    senders (the operator looks before going on); ``exclude`` — it goes on without them.

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
    min_progress: float | None = 0.1
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
        values: list[Any] = list(bound.values()) if isinstance(bound, dict) else [bound]
        _check(bound is None or all(_finite(v) and v > 0 for v in values),
               "robustness.max_samples must be a number > 0, or a mapping site → number > 0, or left out; "
               f"got {bound!r}")
        _check(self.min_progress is None or (_finite(self.min_progress) and 0 < self.min_progress < 1),
               f"robustness.min_progress must be a number in (0, 1) or left out, got {self.min_progress!r}")
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


EXECUTORS = ("sequential", "ray", "flower")


@dataclass(frozen=True)
class ExecutorConfig:
    """How the simulator runs the sites' work of a round (the simulator's own setting: OpenFL plans
    leave it out). ``kind``: ``sequential`` (one site after another in this process, the reference)
    or ``ray`` (each site's tasks a Ray task; results identical at the same per-site threads) or
    ``flower`` (the round loop in a Flower ServerApp, the sites on Flower's simulation runtime; the
    extra ``[flower]``, in an environment without OpenFL).
    ``site_cpus``: torch threads (and Ray CPUs) per site — None: torch's default in the sequential
    engine, 1 under Ray. ``site_gpus``: the fraction of a GPU a Ray site task asks for, used when CUDA
    is present. ``address``: a Ray cluster to join (``ray start --head`` on its head node), else a
    local Ray is started for the run on ``cpus`` cores (default: every core) and stopped after it.
    ``sites_per_task``: about how many sites one Ray task trains, one after another in one worker
    process (None: automatic, two tasks per site slot of the cluster and round; 1: a task per site)."""

    kind: str = "sequential"
    site_cpus: int | None = None
    site_gpus: float = 0.0
    address: str | None = None
    cpus: int | None = None
    sites_per_task: int | None = None

    def __post_init__(self) -> None:
        _check_types(self, "executor.")
        _check(self.kind in EXECUTORS, f"executor.kind must be one of {', '.join(EXECUTORS)}, got {self.kind!r}")
        _check(self.site_cpus is None or (isinstance(self.site_cpus, int) and self.site_cpus >= 1),
               f"executor.site_cpus must be an integer >= 1, got {self.site_cpus!r}")
        _check(_finite(self.site_gpus) and 0 <= self.site_gpus <= 1,
               f"executor.site_gpus must be a fraction of one GPU in [0, 1], got {self.site_gpus!r}")
        _check(self.cpus is None or (isinstance(self.cpus, int) and self.cpus >= 1),
               f"executor.cpus must be an integer >= 1, got {self.cpus!r}")
        _check(self.address is None or (isinstance(self.address, str) and self.address.strip() != ""),
               f"executor.address must be a Ray address such as 10.0.0.1:6379, got {self.address!r}")
        _check(self.sites_per_task is None or (isinstance(self.sites_per_task, int) and self.sites_per_task >= 1),
               f"executor.sites_per_task must be an integer >= 1, got {self.sites_per_task!r}")
        _check(self.kind == "ray" or (self.address is None and self.cpus is None and not self.site_gpus
                                      and self.sites_per_task is None),
               "executor.address, executor.cpus, executor.site_gpus and executor.sites_per_task are settings of "
               "the ray executor: set executor.kind to ray")

    @property
    def threads(self) -> int | None:
        """torch threads per site: ``site_cpus``, else 1 under Ray, else torch's default (None)."""
        return self.site_cpus if self.site_cpus is not None else (1 if self.kind != "sequential" else None)
