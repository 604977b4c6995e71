"""The core of the algorithm plugin interface, and the objects a plugin's calls receive and return.

An algorithm is a pair — what a collaborator does on its own data, and what the aggregator does with
what was uploaded — plus a declaration of every tensor that travels. Every engine (the simulator,
OpenFL, Flower) drives a plugin through the same calls, in this order:

1. once: ``Algorithm(hp, facts)`` (the run's :class:`~.facts.RunFacts`), then ``initial_downlink(server)``
   — what every site receives first.
2. each round, at each selected site: ``evaluate_at_site(site, received, test)``, then, for each name
   in ``tasks``, ``run_task(name, site, received) → TaskResult`` (uploads, aggregation weight,
   metrics; what the site keeps goes into ``site.state``, which the engine persists between rounds).
3. at the aggregator: the uploads validated against ``upload_specs``, then
   ``aggregate(uploads, weights, server) → Downlink`` (tensors for everyone, and per site), then
   ``evaluate(downlink, server, test)`` where it holds test data.

Optional capabilities (secure sums, upload checks, shared files, personal evaluation) are classes
of their own in :mod:`.capabilities`; docs/plugins.md is the full contract.

Privacy wraps a plugin rather than living in it: a plugin declares which DP mechanisms apply to it
(``dp_kinds``) and what each upload is (``TensorSpec.kind``); it accumulates per-class sums through
``site.class_sums(...)`` and trains through :func:`~.training.train_supervised` with
``private=site.privacy``. The engine supplies those objects (``fedcontrast.privacy``); a plugin
never imports Opacus.
"""
from __future__ import annotations

import dataclasses
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..aggregation import weighted_average
from ..config import PrivacyConfig, TrainingConfig
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
from .facts import RunFacts

if TYPE_CHECKING:
    from ..privacy.site import SitePrivacy

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
    privacy: SitePrivacy | None = None  # when the plan turns DP on; set by the engine

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


class _BuiltOnce(ABCMeta):
    """Marks a plugin built once its whole constructor (the subclass's too) has run: from then on
    :meth:`Algorithm.__setattr__` refuses every assignment."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        plugin = super().__call__(*args, **kwargs)
        object.__setattr__(plugin, "_built", True)
        return plugin


class Algorithm(metaclass=_BuiltOnce):
    """The core of an algorithm plugin: what a site computes (``tasks``, ``task_<name>``), how the
    aggregator combines the uploads (:meth:`aggregate`), how a site and the aggregator evaluate, and
    the declarations of what travels. A plugin must set ``name``, write one ``task_<name>`` per entry
    of ``tasks`` and :meth:`aggregate`; everything else has a default. Optional capabilities (secure
    sums, upload checks, shared files, personal evaluation) are in :mod:`.capabilities`.

    A plugin is built once, with its hyper-parameters and the run's :class:`~.facts.RunFacts`; after
    its constructor returns, assigning an attribute raises (state lives in ``site.state``,
    ``server.state``, or containers the constructor made)."""

    # --- declarations (class attributes) ---
    name: ClassVar[str]
    Hyperparameters: ClassVar[type] = NoHyperparameters
    tasks: ClassVar[tuple[str, ...]] = ("train",)  # collaborator tasks of one round, in order
    # The numbers each collaborator task reports besides its uploads (they leave the site as metrics
    # when the site shares them; the privacy audit lists them): task → metric names. And those of
    # evaluate_at_site. A contract test checks that nothing else is reported.
    task_metrics: ClassVar[dict[str, tuple[str, ...]]] = {}
    evaluation_metrics: ClassVar[tuple[str, ...]] = ("accuracy", "loss")
    # The DP mechanisms that apply (see DP_KINDS): "dp_sgd" when local training goes through
    # train_supervised with private=site.privacy; "representations" when per-class sums go through
    # site.class_sums. A plan turning on another mechanism is rejected.
    dp_kinds: ClassVar[frozenset[str]] = frozenset()
    # Gaussian mechanisms per round under representation DP, for planned accounting: 2 for per-class
    # sums (sums and counts), 1 for public-set representations (site.public_representations).
    representation_releases: ClassVar[int] = 2
    requires_public: ClassVar[bool] = False  # needs the public data set on every site and the aggregator
    # Engines also evaluate each site's uploaded local model (``model.*`` weights) on the site's own
    # label distribution each round; the simulator can switch this on for any weight-uploading plugin.
    evaluates_local_models: ClassVar[bool] = False

    hp: Any  # an instance of Hyperparameters
    facts: RunFacts

    def __init__(self, hp: Any | None = None, facts: RunFacts | None = None) -> None:
        self.hp = hp if hp is not None else self.Hyperparameters()
        self.facts = facts if facts is not None else RunFacts()

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_built"):
            raise AttributeError(f"{type(self).__name__} is built: its attribute {name!r} cannot be set from "
                                 "outside; run facts come in once, at construction (RunFacts)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_built"):
            raise AttributeError(f"{type(self).__name__} is built: its attribute {name!r} cannot be deleted")
        object.__delattr__(self, name)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None, facts: RunFacts | None = None) -> Algorithm:
        """Build from a plain mapping (YAML, CLI) and the run's facts; unknown keys and bad values raise
        ConfigError."""
        settings = dict(settings or {})
        known = {f.name for f in dataclasses.fields(cls.Hyperparameters)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"{cls.name} has no setting(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known)) or 'none'}")
        try:
            hp = cls.Hyperparameters(**settings)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid {cls.name} setting: {exc}") from None
        return cls(hp, facts)

    def validate_training(self, training: TrainingConfig) -> None:
        """Raise ConfigError when the hyper-parameters cannot work with ``training``; engines call
        it once before the first round."""

    def validate_privacy(self, privacy: PrivacyConfig) -> None:
        """Raise ConfigError when the hyper-parameters cannot work with the plan's privacy section;
        called at plan time, after the DP kinds."""

    # --- site side ---
    def run_task(self, task: str, site: SiteContext, received: Mapping[str, torch.Tensor]) -> TaskResult:
        """Run collaborator task ``task`` (one of ``tasks``): calls ``task_<task>(site, received)``."""
        if task not in self.tasks:
            raise ConfigError(f"{self.name} has no collaborator task {task!r}; tasks: {', '.join(self.tasks)}")
        run: Callable[[SiteContext, Mapping[str, torch.Tensor]], TaskResult] = getattr(self, f"task_{task}")
        return run(site, received)

    def evaluate_at_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """What a site measures, on its own held-out split ``test``, of what it ``received`` this round
        (engines call it before the round's training, and once more after the last round); the
        site's ``state`` is read, never changed. ``accuracy`` is the headline figure. Default: the
        received global model's accuracy and loss."""
        load_weights(site.model, received)
        return evaluate_classifier(site.model, test, site.device)

    # --- aggregator side ---
    def initial_downlink(self, server: ServerContext) -> Downlink:
        """Round 0: the freshly initialised global weights."""
        return Downlink(weight_tensors(server.model))

    @abstractmethod
    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        """Combine every selected site's uploads (site → name → tensor) into the next downlink."""

    def evaluate(self, downlink: Downlink, server: ServerContext, test: Any) -> dict[str, float]:
        """Test metrics of the global model carried by ``downlink``."""
        load_weights(server.model, downlink.global_tensors)
        return evaluate_classifier(server.model, test, server.device)

    def average_weights(self, uploads: Mapping[str, Mapping[str, torch.Tensor]],
                        weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """A helper for weight-sharing plugins: FedAvg's ``Σ n_k/n w_k``, or the plan's robust rule
        (``facts.robustness.rule``: coordinate-wise median or trimmed mean)."""
        rule = self.facts.robustness
        if rule is None:
            return weighted_average(uploads, weights)
        return robust_average(uploads, weights, rule=rule.rule, trim_fraction=rule.trim_fraction)

    # --- declarations of what travels ---
    def upload_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        """Every tensor a site uploads (names, shapes, dtypes, kinds). Default: the model's weights."""
        return weight_specs(model, "upload", "local model weights after training")

    def download_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        """Every tensor the aggregator sends (``per_site`` for personal ones). Default: the model's weights."""
        return weight_specs(model, "download", "global model weights")

    def shared_class_minimum(self) -> int | None:
        """The fewest local samples behind a shared per-class feature (None: none are shared)."""
        return None


__all__ = ["DP_KINDS", "TENSOR_KINDS", "WEIGHT_PREFIX", "Algorithm", "ClassSums", "Downlink", "InvalidUploadError",
           "NoHyperparameters", "RunFacts", "ServerContext", "SiteContext", "TaskResult", "TensorSpec", "load_weights",
           "nbytes", "validate_uploads", "weight_specs", "weight_tensors"]
