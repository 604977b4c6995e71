"""The algorithm plugin interface.

An algorithm is a pair — what a collaborator does on its own data, and what the aggregator does with
what was uploaded — plus a declaration of every tensor that travels. The simulator and the OpenFL
glue both drive a plugin through exactly these calls:

1. ``initial_downlink(server)`` — what every site receives in round 0.
2. each round, for each selected site and each name in ``tasks``:
   ``run_task(name, site, received) → TaskResult`` (uploads, aggregation weight, metrics; anything the
   site keeps goes into ``site.state``, which the engine persists between rounds).
3. ``aggregate(uploads, weights, server) → Downlink`` (tensors for everyone, and per site).
4. ``evaluate(downlink, server, test)`` — the round's test metrics.

``upload_specs`` / ``download_specs`` declare names, shapes and dtypes; engines validate uploads
against them (:func:`validate_uploads`) and the privacy audit reads them.

Privacy wraps a plugin rather than living in it: a plugin declares which DP mechanisms apply to it
(``dp_kinds``) and what each upload is (``TensorSpec.kind``); it accumulates per-class sums through
``site.class_sums(...)`` and trains through :func:`~.training.train_supervised` with
``private=site.privacy``. The engine supplies those objects (``fedcontrast.privacy``); a plugin
never imports Opacus.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..aggregation import weighted_average
from ..config import TrainingConfig
from ..errors import ConfigError
from ..evaluation import evaluate_classifier
from ..models import ContrastiveNet
from ..robust import robust_average

# What travels, declared and checked (a low-level module, so that evaluation and the aggregator's
# screen can use it without importing this package); re-exported: plugins import these from here.
from ..tensors import (
    TENSOR_KINDS,
    WEIGHT_PREFIX,
    InvalidUploadError,
    TensorSpec,
    load_weights,
    nbytes,
    validate_uploads,
    weight_specs,
    weight_tensors,
)

DP_KINDS = ("dp_sgd", "representations")


# --- per-class sums ----------------------------------------------------------------------------
class ClassSums:
    """Per-class sums of sample representations and per-class counts, each sample counted at most
    once (a repeated index is ignored). The engine may hand a plugin a private subclass instead
    (clipping each sample, noising the release); the plugin code is the same either way.
    Shapes: ``sums (C, d)``, ``counts (C,)``."""

    private: ClassVar[bool] = False

    def __init__(self, num_classes: int, dim: int, num_samples: int, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(num_classes, dim, device=device)
        self.counts = torch.zeros(num_classes, device=device)
        self.seen = torch.zeros(num_samples, dtype=torch.bool, device=device)

    def transform(self, z: torch.Tensor) -> torch.Tensor:
        """Applied to every sample before summing (identity here; clipping in the private version)."""
        return z

    def add(self, z: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> None:
        """Add samples ``index`` (positions in the site's data) with representations ``z (B, d)``."""
        index = index.to(self.seen.device)
        new = ~self.seen[index]
        if not bool(new.all()):
            z, labels, index = z[new], labels[new], index[new]
        self.seen[index] = True
        self.sums.index_add_(0, labels, self.transform(z.detach()).to(self.sums.dtype))
        self.counts.index_add_(0, labels, torch.ones_like(labels, dtype=self.counts.dtype))

    def release(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums, counts)`` as they may leave the site (float counts: noisy in the private version)."""
        return self.sums, self.counts


# --- contexts ----------------------------------------------------------------------------------
@dataclass
class SiteContext:
    """What a collaborator task sees. ``model`` is a scratch network whose weights are unspecified
    on entry: a task loads what it needs from ``received`` and ``state``."""

    name: str
    data: Any  # fedcontrast.data.ArrayDataset: this site's private training shard
    model: ContrastiveNet
    training: TrainingConfig
    round_num: int
    seed: int
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)  # persisted by the engine between rounds
    public: Any = None  # the public data set, when the run has one
    index: int = 0  # the site's position in the federation (site_3 → 3)
    scratch: dict[str, Any] = field(default_factory=dict)  # this task only; never persisted
    privacy: Any = None  # fedcontrast.privacy.SitePrivacy when the plan turns DP on; set by the engine

    def class_sums(self, num_classes: int, dim: int) -> ClassSums:
        """An accumulator of per-class sums of this site's samples: private (clipped, noised on
        release) when representation DP is on."""
        if self.privacy is not None and self.privacy.representations is not None:
            return self.privacy.class_sums(num_classes, dim, len(self.data), self.device)
        return ClassSums(num_classes, dim, len(self.data), self.device)

    def public_representations(self, z: torch.Tensor) -> torch.Tensor:
        """Representations of the *public* set as they may leave the site (FLESD's ``Z_k``): rows
        normalised, plus Gaussian noise under representation DP. ``(N, d) → (N, d)``."""
        if self.privacy is not None and self.privacy.representations is not None:
            return self.privacy.public_representations(z)
        return torch.nn.functional.normalize(z, dim=1)


@dataclass
class ServerContext:
    """What the aggregator task sees: a scratch model, persistent server state, optional public data."""

    model: ContrastiveNet
    round_num: int
    seed: int
    device: torch.device
    num_classes: int
    state: dict[str, Any] = field(default_factory=dict)
    public: Any = None
    sites: list[str] = field(default_factory=list)  # every site of the federation, for per-site downlinks
    previous: dict[str, torch.Tensor] | None = None  # the global downlink this round's sites received
    labelled: Any = None  # labelled data for evaluation (linear probes): the simulator's training split


@dataclass
class TaskResult:
    uploads: dict[str, torch.Tensor]
    weight: float  # aggregation weight, normally the number of local training samples
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Downlink:
    """What the aggregator sends: the same tensors to every site, plus per-site tensors."""

    global_tensors: dict[str, torch.Tensor]
    personal: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def for_site(self, site: str) -> dict[str, torch.Tensor]:
        return {**self.global_tensors, **self.personal.get(site, {})}


# --- the plugin --------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoHyperparameters:
    """For algorithms without settings of their own."""


class Algorithm(ABC):
    """Base class of an algorithm plugin; subclasses set the class attributes and the abstract calls."""

    name: ClassVar[str]
    Hyperparameters: ClassVar[type] = NoHyperparameters
    tasks: ClassVar[tuple[str, ...]] = ("train",)  # collaborator tasks of one round, in order
    # The DP mechanisms that apply (see DP_KINDS): "dp_sgd" when local training goes through
    # train_supervised with private=site.privacy; "representations" when per-class sums go through
    # site.class_sums. A plan turning on another mechanism is rejected.
    dp_kinds: ClassVar[frozenset[str]] = frozenset()
    # Gaussian mechanisms per round under representation DP, for planned accounting: 2 for per-class
    # sums (sums and counts), 1 for public-set representations (site.public_representations).
    representation_releases: ClassVar[int] = 2

    personalized: ClassVar[bool] = False  # evaluated per site (evaluate_site) rather than as one global model
    # Engines also evaluate each site's uploaded local model (``model.*`` weights) on the site's own
    # label distribution each round; the simulator can switch this on for any weight-uploading plugin.
    evaluates_local_models: ClassVar[bool] = False
    # The aggregate is computed from sums over sites alone (FedAvg's sample-weighted mean of every
    # upload; see secure_terms), so secure aggregation gives it exactly. A plugin whose secure-summable
    # form is a variant makes this a property of its settings and names the variant in secure_variant:
    # (the setting to change, what the other setting needs), for the plan's refusal.
    secure_sum: ClassVar[bool] = False
    secure_variant: ClassVar[tuple[str, str] | None] = None
    requires_public: ClassVar[bool] = False  # needs the public data set on every site and the aggregator
    # The numbers each collaborator task reports besides its uploads (they leave the site as OpenFL
    # metrics when the site shares them; the privacy audit lists them): task → metric names. And those
    # of evaluate_at_site. A contract test checks that nothing else is reported.
    task_metrics: ClassVar[dict[str, tuple[str, ...]]] = {}
    evaluation_metrics: ClassVar[tuple[str, ...]] = ("accuracy", "loss")

    def __init__(self, hp: Any | None = None) -> None:
        self.hp = hp if hp is not None else self.Hyperparameters()
        self.num_sites = 1  # the federation's size; engines set it (declarations may depend on it)
        self.public_size = 0  # samples in the public data set; engines set it when the run has one
        self.private_representations = False  # engines set it: uploaded counts are noisy (check_upload adapts)
        self.exact_weights = True  # engines set it: False when sites may send noised sample counts (under DP)
        self.representation_dp: Any = None  # engines set it: the plan's privacy.representations (noise, clip)
        self.count_noise = 0.0  # engines set it: σ of the noise on a site's released sample count (under DP)
        self.robustness: Any = None  # engines set it: the plan's robustness section (the weight rule)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None) -> Algorithm:
        """Build from a plain mapping (YAML, CLI); unknown keys and bad values raise ConfigError."""
        settings = dict(settings or {})
        known = {f.name for f in dataclasses.fields(cls.Hyperparameters)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"{cls.name} has no setting(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known)) or 'none'}")
        try:
            return cls(cls.Hyperparameters(**settings))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid {cls.name} setting: {exc}") from None

    def validate_training(self, training: TrainingConfig) -> None:
        """Raise ConfigError when the hyper-parameters cannot work with ``training``; engines call
        it once before the first round."""

    def validate_privacy(self, privacy: Any) -> None:
        """Raise ConfigError when the hyper-parameters cannot work with the plan's privacy section
        (a :class:`~fedcontrast.config.PrivacyConfig`); called at plan time, after the DP kinds."""

    # collaborator side
    def run_task(self, task: str, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        if task not in self.tasks:
            raise ConfigError(f"{self.name} has no collaborator task {task!r}; tasks: {', '.join(self.tasks)}")
        return getattr(self, f"task_{task}")(site, received)

    # aggregator side
    def check_upload(self, site: str, uploads: Mapping[str, torch.Tensor], weight: float) -> None:
        """Checks of meaning beyond names, shapes, dtypes and finiteness (engines check those with
        :func:`validate_uploads` first); raise :class:`InvalidUploadError` naming ``site``."""

    def average_weights(self, uploads: Mapping[str, Mapping[str, torch.Tensor]],
                        weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """Combine the sites' model weights: FedAvg's ``Σ n_k/n w_k``, or the plan's robust rule
        (``robustness.rule``: coordinate-wise median or trimmed mean). Weight-sharing plugins call this."""
        rule = self.robustness
        if rule is None:
            return weighted_average(uploads, weights)
        return robust_average(uploads, weights, rule=rule.rule, trim_fraction=rule.trim_fraction)

    def count_allowance(self, classes: int) -> float:
        """How far an honest site's uploaded class counts may sum above its claimed sample count: 0
        when both are exact; under DP, 6 standard deviations of the difference of their noises (σ on
        each of ``classes`` counts, ``count_noise`` on the sample count)."""
        sigma = self.representation_dp.noise_multiplier if self.representation_dp is not None else 0.0
        return 6.0 * math.sqrt(classes * sigma ** 2 + self.count_noise ** 2)

    def check_class_counts(self, site: str, counts: torch.Tensor, weight: float) -> None:
        """Uploaded class counts may not sum above the site's claimed samples (+ :meth:`count_allowance`)."""
        if float(counts.sum()) > weight + self.count_allowance(counts.numel()):
            raise InvalidUploadError(f"site {site!r} uploaded class counts summing to {float(counts.sum()):.6g}, "
                                     f"more than its {weight:.6g} samples; rejected")

    def check_mean_norms(self, site: str, means: torch.Tensor, counts: torch.Tensor, *, unit: bool, what: str,
                         bound: str) -> None:
        """Refuse a per-class mean ``(C, d)`` longer than :meth:`mean_norm_allowance` permits."""
        norms = means.to(torch.float64).norm(dim=1)
        allowed = self.mean_norm_allowance(counts, means.shape[1], unit=unit)
        over = (counts > 0) & (norms > allowed)
        if bool(over.any()):
            c = int(over.nonzero()[0, 0])
            raise InvalidUploadError(f"site {site!r} uploaded {what} of norm {float(norms[c]):.4g} for class {c}, "
                                     f"more than {bound} ({float(allowed[c]):.4g}); rejected")

    def mean_norm_allowance(self, counts: torch.Tensor, dim: int, *, unit: bool) -> torch.Tensor:
        """The largest L2 norm an honest per-class mean can have, per class ``(C,)``, given the uploaded
        ``counts``: a mean of vectors of norm ≤ r (r = 1 for unit vectors, else the DP clip bound C; no
        bound — inf — for unclipped representations without DP) is within r; under representation DP
        the released mean is ``(S + N(0, σ²C²I)) / ñ`` with ``ñ`` the noised count, so the allowance adds
        ``r·6σ/ñ`` (count noise) and ``σC(√d + 6)/ñ`` (sum noise), 6 standard deviations each."""
        dp = self.representation_dp
        n = counts.to(torch.float64).clamp_min(1.0)
        if dp is None:
            return torch.full_like(n, 1.0 + 1e-4 if unit else math.inf)
        r = min(1.0, dp.clip) if unit else dp.clip
        sigma, c = dp.noise_multiplier, dp.clip
        return r * (1 + 6 * sigma / n) + sigma * c * (math.sqrt(dim) + 6) / n + 1e-4

    def initial_downlink(self, server: ServerContext) -> Downlink:
        """Round 0: the freshly initialised global weights."""
        return Downlink(weight_tensors(server.model))

    @abstractmethod
    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        """Combine every selected site's uploads (site → name → tensor) into the next downlink."""

    # secure aggregation (fedcontrast.privacy.secagg): the aggregator sees only Σ over sites of these terms
    def secure_terms(self, uploads: Mapping[str, torch.Tensor], weight: float, clip: float) -> dict[str, torch.Tensor]:
        """What one site adds to the round's secure sum (float64 tensors, every element within
        ``[-clip·weight, clip·weight]``: engines scale them into the ring by ``max_samples``).
        Default: ``weight·clip(u)`` for every upload (``sum.NAME``) and ``weight`` (``count``), whose
        sums give the sample-weighted mean :meth:`aggregate_secure` hands :meth:`aggregate`."""
        n = float(weight)
        terms = {f"sum.{k}": v.detach().to(torch.float64).clamp(-clip, clip) * n for k, v in uploads.items()}
        terms["count"] = torch.tensor([n], dtype=torch.float64)
        return terms

    def secure_scale(self, max_samples: float) -> float:
        """What engines divide this plugin's terms by before the ring (and multiply the sums by after):
        ``max_samples`` for terms weighted by a site's count (within ``clip·max_samples``), 1 for terms
        that are not (FLESD's similarities: within ``clip`` already, kept at the ring's full precision)."""
        return max_samples

    def aggregate_secure(self, sums: Mapping[str, torch.Tensor], server: ServerContext,
                         dtypes: Mapping[str, torch.dtype]) -> Downlink:
        """The next downlink from the sums of every site's :meth:`secure_terms` (float64; ``dtypes``:
        each upload's dtype). Default: the weighted mean as one upload of weight 1 to :meth:`aggregate`."""
        return self.aggregate({"secure sum": self.secure_mean(sums, dtypes)}, {"secure sum": 1.0}, server)

    @staticmethod
    def secure_mean(sums: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """The sample-weighted mean of the uploads ``dtypes`` names, from the default terms' sums
        (``sum.NAME / count``, in each upload's dtype; integers rounded)."""
        count = float(sums["count"].reshape(()))
        if not count > 0:
            raise InvalidUploadError("the secure sum of the sites' sample counts is not positive; nothing to average")
        mean = {}
        for name, dtype in dtypes.items():
            value = sums[f"sum.{name}"] / count
            mean[name] = (value if dtype.is_floating_point else value.round()).to(dtype)
        return mean

    def secure_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        """What :meth:`secure_terms` adds to the secure sum, declared (names, shapes, kinds; float64
        before the ring), for the audit. Default: ``sum.NAME`` per upload and ``count``."""
        specs = [TensorSpec(f"sum.{s.name}", s.shape, "float64", "upload", kind=s.kind,
                            description=f"n_k · {s.name}, clipped") for s in self.upload_specs(model, num_classes)]
        return specs + [TensorSpec("count", (1,), "float64", "upload", kind="count", description="n_k")]

    def evaluate(self, downlink: Downlink, server: ServerContext, test: Any) -> dict[str, float]:
        """Test metrics of the global model carried by ``downlink``."""
        load_weights(server.model, downlink.global_tensors)
        return evaluate_classifier(server.model, test, server.device)

    def evaluate_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """Test metrics of one site's personalised model (for ``personalized`` algorithms)."""
        raise NotImplementedError(f"{self.name} has no personalised evaluation")

    def evaluate_at_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """What a site measures, on its own held-out split ``test``, of what it ``received`` this round
        (engines call it before the round's training, and once more after the last round); the
        site's ``state`` is read, never changed. ``accuracy`` is the headline figure. Default: the
        received global model's accuracy and loss."""
        load_weights(site.model, received)
        return evaluate_classifier(site.model, test, site.device)

    # deployment
    @classmethod
    def share_files(cls, settings: dict[str, Any], workspace: Path, *, public: Callable[[], Any], seed: int,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
        """Files every site of a deployment must hold identically (FedPCL's frozen backbones): the
        operator makes or copies them under ``workspace/save/`` (the workspace package ships it) and
        the returned settings pin them (paths relative to the workspace, SHA-256). ``public()`` loads
        the public data set. Default: none, ``settings`` unchanged."""
        return settings

    def check_shared_files(self, workspace: str | Path = ".") -> None:
        """Refuse (:class:`~fedcontrast.errors.DataError`, one sentence) shared files that differ
        from the plan's pins. Default: nothing to check."""

    # declarations
    def upload_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        return weight_specs(model, "upload", "local model weights after training")

    def download_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        return weight_specs(model, "download", "global model weights")

    def shared_class_minimum(self) -> int | None:
        """The fewest local samples behind a shared per-class feature (None: none are shared)."""
        return None


__all__ = ["DP_KINDS", "TENSOR_KINDS", "WEIGHT_PREFIX", "Algorithm", "ClassSums", "Downlink", "InvalidUploadError",
           "NoHyperparameters", "ServerContext", "SiteContext", "TaskResult", "TensorSpec", "load_weights", "nbytes",
           "validate_uploads", "weight_specs", "weight_tensors"]
