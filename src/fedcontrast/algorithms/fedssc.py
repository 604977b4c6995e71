"""FedSSC: MOON plus supervised contrast against class representations shared between sites
(Hu, Feng, Yang, Chen 2023; docs/algorithms.md#fedssc)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..aggregation import CLASS_COUNT, CLASS_SUM, class_mean_terms, global_prototypes, pooled_class_means
from ..config import PrivacyConfig
from ..errors import ConfigError
from ..losses import check_temperature, global_class_contrastive_loss
from ..models import ContrastiveNet
from .base import (
    WEIGHT_PREFIX,
    Downlink,
    InvalidUploadError,
    ServerContext,
    SiteContext,
    TensorSpec,
    weight_specs,
    weight_tensors,
)
from .capabilities import UploadChecks
from .moon import Moon, represent_all
from .registry import register_algorithm
from .training import ExtraLoss, ExtraTerm

CLASS_MEANS = "fedssc.class_means"  # upload (C, d): mean z of each class sent, zero rows otherwise
CLASS_COUNTS = "fedssc.class_counts"  # upload (C,): samples behind each mean, 0 = not sent
CLASS_REPS = "fedssc.class_reps"  # download (C, d): the shared s^c
CLASS_PRESENT = "fedssc.class_present"  # download (C,): 1 where s^c exists
SCHEDULES = ("linear", "cosine", "constant")
CLASS_MEAN_SOURCES = ("auto", "last_epoch", "final_model")
CLASS_REP_RULES = ("sampled", "pooled")


@dataclass(frozen=True)
class FedSSCHyperparameters:
    mu_moon: float = 5.0
    temperature: float = 0.5
    mu_glob_start: float = 1.0  # μ_glob decays from start to end over warmup_rounds (paper §V)
    mu_glob_end: float = 0.1
    warmup_rounds: int = 100
    schedule: str = "linear"
    k: int = 3  # uploaded class means averaged per class, chosen at random among the senders
    min_class_samples: int = 10  # classes with fewer local samples are never uploaded
    cache_reference_representations: bool | str = "auto"
    # Where the shared class means come from: the representations of the last local epoch's batches
    # (the specification), or one pass over every sample with the final local model. "auto": the
    # last epoch, except under DP-SGD, where only the final-model pass composes (see
    # fedcontrast.privacy.representations).
    class_means: str = "auto"
    # How s^c is made: the mean of k senders' class means drawn at random (the paper), or "pooled":
    # the count-weighted mean over every sender, Σ_k n_kc·mean_kc / Σ_k n_kc — a function of sums
    # alone, so it runs under secure aggregation (the aggregator never sees one site's class mean).
    class_reps: str = "sampled"

    def __post_init__(self) -> None:
        for name in ("mu_moon", "mu_glob_start", "mu_glob_end"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        check_temperature(self.temperature)
        if not (isinstance(self.warmup_rounds, int) and self.warmup_rounds >= 1):
            raise ValueError(f"warmup_rounds must be an integer >= 1, got {self.warmup_rounds!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")
        if not (isinstance(self.min_class_samples, int) and self.min_class_samples >= 1):
            raise ValueError(f"min_class_samples must be an integer >= 1, got {self.min_class_samples!r}")
        if self.cache_reference_representations not in (True, False, "auto"):
            raise ValueError("cache_reference_representations must be true, false or auto")
        if self.class_means not in CLASS_MEAN_SOURCES:
            raise ValueError(f"class_means must be one of {', '.join(CLASS_MEAN_SOURCES)}, got {self.class_means!r}")
        if self.class_reps not in CLASS_REP_RULES:
            raise ValueError(f"class_reps must be one of {', '.join(CLASS_REP_RULES)}, got {self.class_reps!r}")


def mu_glob_schedule(t: int, *, start: float, end: float, warmup_rounds: int,
                     schedule: str = "linear") -> float:
    """μ_glob(t), t the rounds completed before this one: ``start`` at t = 0 (the first round), ``end`` from
    t = ``warmup_rounds`` on."""
    progress = min(max(t, 0), warmup_rounds) / warmup_rounds
    if schedule == "constant":
        return start
    if schedule == "cosine":
        progress = 0.5 * (1 - math.cos(math.pi * progress))
    return start + (end - start) * progress


def sample_class_representations(means: Mapping[str, torch.Tensor], counts: Mapping[str, torch.Tensor], *,
                                 k: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``s^c`` = plain mean of ``k`` class means drawn at random among the sites that sent class c
    (all of them if fewer than ``k``). Sites are ordered by name before drawing, so the draw depends
    only on the seed. Returns ``(reps (C, d), present (C,))``."""
    sites = sorted(means)
    first = means[sites[0]]
    reps = torch.zeros_like(first)
    present = torch.zeros(first.shape[0], dtype=first.dtype, device=first.device)
    for c in range(first.shape[0]):
        senders = [s for s in sites if counts[s][c] > 0]
        if not senders:
            continue
        chosen = (senders if len(senders) <= k
                  else [senders[i] for i in sorted(rng.choice(len(senders), k, replace=False))])
        reps[c] = torch.stack([means[s][c] for s in chosen]).mean(0)
        present[c] = 1.0
    return reps, present


@register_algorithm
class FedSSC(UploadChecks, Moon):
    """Loss ``CE + μ_moon · l_con + μ_glob(t) · l_glob``; uploads weights and, for each class with at
    least ``min_class_samples`` local samples, its mean projected representation over the last
    local epoch with its count. Aggregator: FedAvg on weights; ``s^c`` from ``k`` random senders, or
    (``class_reps: pooled``) the count-weighted mean over every sender, which secure aggregation gives."""

    name = "fedssc"
    secure_variant = ("fedssc.class_reps: pooled", "draws k sites' own class means at random (class_reps: sampled)")
    task_metrics = {"train": ("loss", "ce", "accuracy", "contrastive", "global_contrastive")}
    Hyperparameters = FedSSCHyperparameters
    hp: FedSSCHyperparameters
    dp_kinds = frozenset({"dp_sgd", "representations"})

    @property
    def moon_weight(self) -> float:
        return self.hp.mu_moon

    @property
    def secure_sum(self) -> bool:  # type: ignore[override]  # decided by the settings, not by the class
        # sampled: s^c comes from individual sites' class means, not from a sum
        return self.hp.class_reps == "pooled"

    def mu_glob(self, round_num: int) -> float:
        """μ_glob in round ``round_num`` (counted from 1): the schedule at t = the rounds before it."""
        hp = self.hp
        return mu_glob_schedule(round_num - 1, start=hp.mu_glob_start, end=hp.mu_glob_end,
                                warmup_rounds=hp.warmup_rounds, schedule=hp.schedule)

    def validate_privacy(self, privacy: PrivacyConfig) -> None:
        if privacy.dp_sgd is not None and self.hp.class_means == "last_epoch":
            raise ConfigError("fedssc.class_means: last_epoch does not compose with DP-SGD (which samples of the "
                              "last epoch entered the sums depends on DP-SGD's hidden Poisson draws); use final_model "
                              "or auto")

    def class_mean_source(self, site: SiteContext) -> str:
        if self.hp.class_means != "auto":
            return self.hp.class_means
        return "final_model" if site.privacy is not None and site.privacy.dp_sgd is not None else "last_epoch"

    # --- collaborator ---------------------------------------------------------------------------
    def local_loss(self, site: SiteContext, received: Mapping[str, torch.Tensor]) -> ExtraLoss:
        moon = super().local_loss(site, received)
        reps, present = received[CLASS_REPS], received[CLASS_PRESENT]
        mu_glob, tau = self.mu_glob(site.round_num), self.hp.temperature
        use_glob = mu_glob > 0 and bool(present.any())
        num_classes, dim = reps.shape
        class_sums = site.scratch["class_sums"] = site.class_sums(num_classes, dim)
        labels_all = site.data.y.to(site.device)
        last_epoch = site.training.local_epochs - 1 if self.class_mean_source(site) == "last_epoch" else None

        def extra(x: torch.Tensor, idx: torch.Tensor, z: torch.Tensor, logits: torch.Tensor, epoch: int) -> ExtraTerm:
            term, parts = moon(x, idx, z, logits, epoch)
            labels = labels_all[idx]
            if use_glob:
                glob = global_class_contrastive_loss(z, labels, reps, present, temperature=tau)
                term = term + mu_glob * glob
                parts["global_contrastive"] = glob.detach()
            if epoch == last_epoch:  # the shared means are over the last local epoch
                class_sums.add(z.detach(), labels, idx)
            return term, parts

        return extra

    def extra_uploads(self, site: SiteContext) -> dict[str, torch.Tensor]:
        class_sums = site.scratch["class_sums"]
        if self.class_mean_source(site) == "final_model":  # every sample once, through the final local model
            was_training = site.model.training
            site.model.eval()
            with torch.no_grad():
                z = represent_all(site.model, site.data.x.to(site.device))
            site.model.train(was_training)
            class_sums.add(z, site.data.y.to(site.device), torch.arange(len(z), device=site.device))
        sums, counts = class_sums.release()  # noisy under representation DP
        counts = counts.round().clamp_min(0)
        # Data minimisation: a class below the threshold leaves the site as a zero row and count 0
        # (decided on the released counts, so the decision itself is post-processing).
        sent = counts >= self.hp.min_class_samples
        means = torch.where(sent[:, None], sums / counts.clamp_min(1)[:, None], torch.zeros_like(sums))
        return {CLASS_MEANS: means.float(), CLASS_COUNTS: torch.where(sent, counts, torch.zeros_like(counts)).long()}

    # --- aggregator -----------------------------------------------------------------------------
    def check_upload(self, site: str, uploads: Mapping[str, torch.Tensor], weight: float) -> None:
        counts, means = uploads[CLASS_COUNTS], uploads[CLASS_MEANS]
        if bool((counts < 0).any()):
            raise InvalidUploadError(f"site {site!r} uploaded negative class counts; rejected")
        if bool(((counts > 0) & (counts < self.hp.min_class_samples)).any()):
            raise InvalidUploadError(f"site {site!r} uploaded a class mean from fewer than "
                                     f"{self.hp.min_class_samples} samples; rejected")
        if bool(((counts == 0) & (means.abs().sum(1) > 0)).any()):
            raise InvalidUploadError(f"site {site!r} uploaded a class mean with a count of 0; rejected")
        self.check_class_counts(site, counts, weight)
        # Under representation DP every representation is clipped to C: a class mean is within C (plus the
        # noise's allowance). Without DP the representations are not normalised: no bound to check.
        self.check_mean_norms(site, means, counts, unit=False, what="a class mean",
                              bound="clipped representations allow")

    def aggregate(self, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float],
                  server: ServerContext) -> Downlink:
        weights_only = {s: {k: v for k, v in u.items() if k.startswith(WEIGHT_PREFIX)} for s, u in uploads.items()}
        means = {s: u[CLASS_MEANS] for s, u in uploads.items()}
        counts = {s: u[CLASS_COUNTS] for s, u in uploads.items()}
        if self.hp.class_reps == "pooled":  # s^c = Σ_k n_kc·mean_kc / Σ_k n_kc over every sender
            reps, present = global_prototypes(means, counts)
        else:
            reps, present = sample_class_representations(means, counts, k=self.hp.k,
                                                         rng=np.random.default_rng(server.seed))
        return self._downlink(self.average_weights(weights_only, weights), reps, present)

    @staticmethod
    def _downlink(weights: dict[str, torch.Tensor], reps: torch.Tensor, present: torch.Tensor) -> Downlink:
        return Downlink({**weights, CLASS_REPS: reps, CLASS_PRESENT: present},
                        metrics={"classes_shared": float(present.sum())})

    # secure aggregation (class_reps: pooled): weights as FedAvg's; n_kc·mean_kc and n_kc per class
    def secure_terms(self, uploads: Mapping[str, torch.Tensor], weight: float, clip: float) -> dict[str, torch.Tensor]:
        terms = super().secure_terms({k: v for k, v in uploads.items() if k.startswith(WEIGHT_PREFIX)}, weight, clip)
        return {**terms, **class_mean_terms(uploads[CLASS_MEANS], uploads[CLASS_COUNTS], weight, clip)}

    def aggregate_secure(self, sums: Mapping[str, torch.Tensor], server: ServerContext,
                         dtypes: Mapping[str, torch.dtype]) -> Downlink:
        weights = self.secure_mean(sums, {k: v for k, v in dtypes.items() if k.startswith(WEIGHT_PREFIX)})
        return self._downlink(weights, *pooled_class_means(sums, dtype=dtypes[CLASS_MEANS]))

    def secure_counts(self, max_samples: float) -> dict[str, tuple[float, float]]:
        # a class a site does not share adds a count of 0; a count is clipped to the site's own, ≤ max_samples
        return {**super().secure_counts(max_samples), CLASS_COUNT: (0.0, float(max_samples))}

    def secure_averages(self, clip: float) -> dict[str, tuple[str, float]]:
        # s^c: a count-weighted mean of class means clipped to [-clip, clip] (no tighter bound without DP)
        return {**super().secure_averages(clip), CLASS_SUM: (CLASS_COUNT, float(clip))}

    def initial_downlink(self, server: ServerContext) -> Downlink:
        dim = server.model.projection_dim
        return Downlink({**weight_tensors(server.model),
                         CLASS_REPS: torch.zeros(server.num_classes, dim, device=server.device),
                         CLASS_PRESENT: torch.zeros(server.num_classes, device=server.device)})

    # --- declarations ---------------------------------------------------------------------------
    def upload_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        d = model.projection_dim
        return weight_specs(model, "upload", "local model weights after training") + [
            TensorSpec(CLASS_MEANS, (num_classes, d), "float32", "upload",
                       description=f"mean projected representation per class with >= {self.hp.min_class_samples} "
                                   "local samples (zero rows for the others)"),
            TensorSpec(CLASS_COUNTS, (num_classes,), "int64", "upload", kind="count",
                       description="local samples behind each class mean (0 = class not shared)")]

    def secure_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        d = model.projection_dim
        weights = [s for s in super().secure_specs(model, num_classes)
                   if s.name.startswith((f"sum.{WEIGHT_PREFIX}", "count"))]
        return weights + [
            TensorSpec(CLASS_SUM, (num_classes, d), "float64", "upload",
                       description="count · class mean, per class (mean clipped to [-clip, clip])"),
            TensorSpec(CLASS_COUNT, (num_classes,), "float64", "upload", kind="count",
                       description="local samples behind each class mean")]

    def shared_class_minimum(self) -> int:
        return self.hp.min_class_samples

    def download_specs(self, model: ContrastiveNet, num_classes: int) -> list[TensorSpec]:
        d = model.projection_dim
        rule = ("count-weighted mean of every site's class means" if self.hp.class_reps == "pooled"
                else f"mean of up to {self.hp.k} sites' class means")
        return weight_specs(model, "download", "global model weights") + [
            TensorSpec(CLASS_REPS, (num_classes, d), "float32", "download",
                       description=f"shared class representations ({rule})"),
            TensorSpec(CLASS_PRESENT, (num_classes,), "float32", "download",
                       description="1 where a class representation is shared")]
