"""Opt-in capabilities of a plugin, each a small abstract class a plugin adds to its bases.

The core (:class:`~.base.Algorithm`) is what every plugin has: its tasks, its aggregation, its
evaluation and its declarations. A capability is something only some algorithms need; engines ask
for it with ``isinstance`` (or, for secure sums, :func:`secure_summable`) and skip it otherwise:

* :class:`SecureSum` — the aggregate can be computed from sums over sites alone, so the plan may turn
  secure aggregation on (the aggregator then sees only those sums).
* :class:`UploadChecks` — checks of an upload's meaning beyond its declared shape, dtype and
  finiteness (class counts within the claimed samples, class means within their norm bound).
* :class:`SharedFiles` — files every site of a deployment must hold identically (FedPCL's frozen
  backbones), made or copied by the operator and pinned by hash.
* :class:`PersonalEvaluation` — every site keeps a model of its own; the simulator scores each site's
  model instead of one global model.

Each is a subclass of :class:`~.base.Algorithm`, so a plugin lists it among its bases in any order,
e.g. ``class FedPCL(SecureSum, UploadChecks, SharedFiles, PersonalEvaluation)``.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..models import ContrastiveNet
from ..tensors import InvalidUploadError, TensorSpec
from .base import Algorithm, Downlink, ServerContext, SiteContext


# --- secure sums -------------------------------------------------------------------------------
class SecureSum(Algorithm):
    """Capability: the aggregate follows from sums over the sites (fedcontrast.privacy.secagg), so the
    aggregator may see only ``Σ_k secure_terms(upload_k)``. The defaults give FedAvg's sample-weighted
    mean of every upload: a plugin whose :meth:`aggregate` is that mean needs nothing more."""

    # False where only a variant of the plugin is secure-summable: make it a property of the settings
    # and name the variant in secure_variant — (the setting to change, why the current one cannot) —
    # for the plan's one-sentence refusal.
    secure_sum: ClassVar[bool] = True
    secure_variant: ClassVar[tuple[str, str] | None] = None

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

    def secure_counts(self, max_samples: float) -> dict[str, tuple[float, float]]:
        """The count terms of :meth:`secure_terms` that the aggregate divides by, each with the least
        and the most one honest site adds (after :func:`~fedcontrast.privacy.secagg_terms.site_terms`
        clipped its count to ``max_samples``): the aggregator refuses a sum the survivors could not have
        sent (:func:`~fedcontrast.privacy.secagg_reach.bounded_sums`). Default: the sample count, from 1
        (a weight is at least 1, noised or not) to ``max_samples``."""
        return {"count": (1.0, float(max_samples))}

    def secure_averages(self, clip: float) -> dict[str, tuple[str, float]]:
        """Each average the aggregate makes from the sum: a numerator term (a name, or a prefix ending
        in ``.`` for every term it starts) → the count term it is divided by and the bound ``B`` its
        honest value lies within, ``[−B, B]``; the aggregator clips each average to it. Default: every
        ``sum.NAME`` over ``count``, a count-weighted mean of values clipped to ``[−clip, clip]``."""
        return {"sum.": ("count", float(clip))}

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


def secure_summable(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` as configured can run under secure aggregation."""
    return isinstance(algorithm, SecureSum) and bool(algorithm.secure_sum)


# --- upload checks -----------------------------------------------------------------------------
class UploadChecks(Algorithm):
    """Capability: checks of an upload's meaning, run by the aggregator's screen on every upload (and
    by a site on its own input before it masks it, under secure aggregation). The helpers below bound
    what an honest site can send, given the run facts (counts and representations under DP)."""

    @abstractmethod
    def check_upload(self, site: str, uploads: Mapping[str, torch.Tensor], weight: float) -> None:
        """Checks of meaning beyond names, shapes, dtypes and finiteness (engines check those with
        :func:`~fedcontrast.tensors.validate_uploads` first); raise
        :class:`~fedcontrast.tensors.InvalidUploadError` naming ``site``."""

    def count_allowance(self, classes: int) -> float:
        """How far an honest site's uploaded class counts may sum above its claimed sample count: 0
        when both are exact; under DP, 6 standard deviations of the difference of their noises (σ on
        each of ``classes`` counts, ``count_noise`` on the sample count)."""
        dp = self.facts.representation_dp
        sigma = dp.noise_multiplier if dp is not None else 0.0
        return 6.0 * math.sqrt(classes * sigma ** 2 + self.facts.count_noise ** 2)

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
        dp = self.facts.representation_dp
        n = counts.to(torch.float64).clamp_min(1.0)
        if dp is None:
            return torch.full_like(n, 1.0 + 1e-4 if unit else math.inf)
        r = min(1.0, dp.clip) if unit else dp.clip
        sigma, c = dp.noise_multiplier, dp.clip
        return r * (1 + 6 * sigma / n) + sigma * c * (math.sqrt(dim) + 6) / n + 1e-4


def check_upload(algorithm: Any, site: str, uploads: Mapping[str, torch.Tensor], weight: float) -> None:
    """The plugin's own checks of an upload, where it has the :class:`UploadChecks` capability."""
    if isinstance(algorithm, UploadChecks):
        algorithm.check_upload(site, uploads, weight)


# --- shared files ------------------------------------------------------------------------------
class SharedFiles(Algorithm):
    """Capability: files every site of a deployment must hold identically (FedPCL's frozen backbones).
    The operator makes or copies them once (:meth:`share_files`, when the workspace is created) and the
    plan pins them; each site refuses files that differ (:meth:`check_shared_files`) before training."""

    @classmethod
    @abstractmethod
    def share_files(cls, settings: dict[str, Any], workspace: Path, *, public: Callable[[], Any], seed: int,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
        """Make or copy the files under ``workspace/save/`` (the workspace package ships it) and return
        ``settings`` pinning them (paths relative to the workspace, SHA-256). ``public()`` loads the
        public data set."""

    @abstractmethod
    def check_shared_files(self, workspace: str | Path = ".") -> None:
        """Refuse (:class:`~fedcontrast.errors.DataError`, one sentence) shared files that differ from
        the plan's pins."""


def share_files(cls: type[Algorithm], settings: dict[str, Any], workspace: Path, *, public: Callable[[], Any],
                seed: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """``settings`` pinning the plugin's shared files (unchanged for a plugin without :class:`SharedFiles`)."""
    if issubclass(cls, SharedFiles):
        return cls.share_files(settings, workspace, public=public, seed=seed, log=log)
    return settings


def check_shared_files(algorithm: Algorithm, workspace: str | Path = ".") -> None:
    """The plugin's refusal of shared files that differ from the plan (nothing without :class:`SharedFiles`)."""
    if isinstance(algorithm, SharedFiles):
        algorithm.check_shared_files(workspace)


# --- personal state ----------------------------------------------------------------------------
class PersonalEvaluation(Algorithm):
    """Capability: each site keeps a personalised model in ``site.state`` (what it keeps persists
    anyway — any plugin may use ``site.state``); the simulator's round metrics are then the mean over
    sites of :meth:`evaluate_site` instead of :meth:`evaluate` of one global model."""

    personalized: ClassVar[bool] = True

    @abstractmethod
    def evaluate_site(self, site: SiteContext, received: Mapping[str, torch.Tensor], test: Any) -> dict[str, float]:
        """Test metrics of one site's personalised model (its state and what it ``received``) on ``test``."""


__all__ = ["PersonalEvaluation", "SecureSum", "SharedFiles", "UploadChecks", "check_shared_files", "check_upload",
           "secure_summable", "share_files"]
