"""What an aggregator accepts from a site, and robust ways to combine model weights.

Cross-silo sites hold valid certificates, so a site that misbehaves — by bug or by intent — is
authenticated and its upload arrives. Both engines (the simulator and the OpenFL aggregation
function) pass every round's uploads through one :class:`UploadScreen` before the plugin aggregates
them, configured by the plan's ``robustness`` section (:class:`~fedcontrast.config.RobustnessConfig`):

* the aggregation weight (a site's sample count) must be finite, ≥ 0 and within the plan's
  ``max_samples`` (one cap, or each site's count declared at enrolment; plus the noise allowance
  when counts are released noised under DP);
* the plugin's checks of meaning (:meth:`~fedcontrast.algorithms.Algorithm.check_upload`: prototype
  norms, counts, Gram matrices…);
* for model weights, the update ``w_k − w`` (``w`` the global model the site received) must not be
  larger than ``max_update_ratio · ‖w‖`` (L2 over every floating-point model tensor);
* an upload identical to one the same site sent in an earlier round is a replay.

An upload that fails is rejected alone, with the sender and the reason named; the others are
aggregated. Optionally each update is clipped to ``clip_update_norm`` first, and model weights are
combined by a robust rule (coordinate-wise median or trimmed mean, :func:`robust_average`) in every
weight-sharing plugin (:meth:`~fedcontrast.algorithms.Algorithm.average_weights`). When the combined
downlink is not finite, the site whose upload caused it is found and named
(:meth:`UploadScreen.aggregate`): a site is never blamed for the global model's fault.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .aggregation import UploadError, weighted_average
from .algorithms.base import WEIGHT_PREFIX, InvalidUploadError
from .config import ROBUST_RULES
from .errors import FedContrastError

COUNT_NOISE_ALLOWANCE = 6.0  # standard deviations of a noised count's noise allowed above the declared bound


class RejectedUpload(FedContrastError):
    """An upload the aggregator does not take; the message names the site and the reason."""


# --- robust rules ------------------------------------------------------------------------------
def _stacked(uploads: Mapping[str, Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    sites = sorted(uploads)
    ref = uploads[sites[0]][name]
    for site in sites[1:]:
        if uploads[site][name].shape != ref.shape:
            raise UploadError(f"site {site!r} uploaded {name!r} with shape {tuple(uploads[site][name].shape)}, "
                              f"expected {tuple(ref.shape)}")
    return torch.stack([uploads[s][name].to(torch.float64) for s in sites])  # (K, ...)


def _trimmed(uploads: Mapping[str, Mapping[str, torch.Tensor]], t: int) -> dict[str, torch.Tensor]:
    """Per coordinate, the sites' values sorted, ``t`` dropped at each end, the rest averaged
    (unweighted). Same names, shapes and dtypes as each upload."""
    if not uploads:
        raise UploadError("no site uploaded anything this round")
    first = uploads[sorted(uploads)[0]]
    out = {}
    for name, ref in first.items():
        values, _ = _stacked(uploads, name).sort(dim=0)
        kept = values[t:values.shape[0] - t] if t else values
        out[name] = kept.mean(dim=0).to(ref.dtype)
    return out


def coordinate_median(uploads: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The coordinate-wise median of every tensor over the sites (Yin et al. 2018): for an even
    number of sites the mean of the two middle values. Unweighted: a site's claimed sample count
    cannot move it. Same names, shapes and dtypes as each upload."""
    return _trimmed(uploads, (len(uploads) - 1) // 2)  # odd K: the middle value; even K: the two middle ones


def trimmed_count(sites: int, fraction: float) -> int:
    """How many values a trimmed mean drops at each end: ``⌊fraction·K⌋``, at least one when that
    leaves a value (so that three sites trim one each side), never all of them."""
    return min(max(1, math.floor(fraction * sites)), (sites - 1) // 2)


def trimmed_mean(uploads: Mapping[str, Mapping[str, torch.Tensor]], fraction: float) -> dict[str, torch.Tensor]:
    """The coordinate-wise trimmed mean (Yin et al. 2018): per coordinate, the sites' values sorted,
    :func:`trimmed_count` dropped at each end, the rest averaged (unweighted)."""
    return _trimmed(uploads, trimmed_count(len(uploads), fraction))


def robust_average(uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float], *,
                   rule: str = "mean", trim_fraction: float = 0.2) -> dict[str, torch.Tensor]:
    """Combine the sites' tensors by ``rule``: ``mean`` (FedAvg's ``Σ n_k/n w_k``), ``median`` or
    ``trimmed_mean`` (coordinate-wise, unweighted)."""
    if rule == "mean":
        return weighted_average(uploads, weights)
    if rule == "median":
        return coordinate_median(uploads)
    if rule == "trimmed_mean":
        return trimmed_mean(uploads, trim_fraction)
    raise ValueError(f"rule must be one of {', '.join(ROBUST_RULES)}, got {rule!r}")


# --- updates -----------------------------------------------------------------------------------
def _weight_names(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, t in upload.items()
                  if n.startswith(WEIGHT_PREFIX) and t.is_floating_point() and n in reference)


def _update_norm(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], names: list[str]) -> float:
    update = 0.0
    for name in names:
        ref = reference[name].detach().to("cpu", torch.float64)
        update += float(((upload[name].detach().to("cpu", torch.float64) - ref) ** 2).sum())
    return math.sqrt(update)


def _reference_norm(reference: Mapping[str, torch.Tensor], names: list[str]) -> float:
    reference_sq = 0.0
    for name in names:
        reference_sq += float((reference[name].detach().to("cpu", torch.float64) ** 2).sum())
    return math.sqrt(reference_sq)


def update_norm(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """``(‖w_k − w‖, ‖w‖)``: L2 norms, in float64, over every floating-point model tensor the upload
    shares with the reference (the global model the site received)."""
    names = _weight_names(upload, reference)
    return _update_norm(upload, reference, names), _reference_norm(reference, names)


def clip_update(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                bound: float, *, norm: float | None = None) -> dict[str, torch.Tensor]:
    """The upload with its model update scaled to L2 norm ≤ ``bound``: ``w + (w_k − w)·min(1, bound/‖w_k − w‖)``
    (norm clipping of updates, e.g. Sun et al. 2019); other tensors unchanged. ``norm``: ``‖w_k − w‖``
    when already known (:func:`update_norm`), else computed here."""
    if norm is None:
        norm = _update_norm(upload, reference, _weight_names(upload, reference))
    if norm <= bound:
        return dict(upload)
    scale = bound / norm
    out = dict(upload)
    for name in _weight_names(upload, reference):
        ref = reference[name].to(upload[name].device, torch.float64)
        out[name] = (ref + (upload[name].to(torch.float64) - ref) * scale).to(upload[name].dtype)
    return out


def upload_digest(upload: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of an upload's names and bytes (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(upload):
        t = upload[name].detach().to("cpu").contiguous()
        h.update(name.encode() + b"\0" + str(t.dtype).encode() + b"\0" + str(tuple(t.shape)).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def _magnitude(upload: Mapping[str, torch.Tensor]) -> float:
    values = [float(t.detach().abs().max()) for t in upload.values() if t.is_floating_point() and t.numel()]
    return max(values, default=0.0)


def all_rejected_hint(rejected: Mapping[str, str]) -> str:
    """When every site's upload was rejected as non-finite, the cause is what they all started from:
    say so rather than blaming each site."""
    if len(rejected) > 1 and all("NaN or infinite" in r for r in rejected.values()):
        return ("; every site's upload is non-finite, so the global model they all started from is the likely "
                "cause, not the sites (was a poisoned upload averaged in with max_update_ratio off?)")
    return ""


# --- the screen --------------------------------------------------------------------------------
class UploadScreen:
    """One per engine, across rounds (it remembers what each site sent, to spot replays).

    ``config``: the plan's :class:`~fedcontrast.config.RobustnessConfig`; ``algorithm``: the plugin
    (its :meth:`check_upload`); ``count_noise``: the standard deviation of the noise on released
    sample counts (DP), 0 when counts are exact."""

    def __init__(self, config: Any, algorithm: Any, *, count_noise: float = 0.0) -> None:
        self.config = config
        self.algorithm = algorithm
        self.count_noise = float(count_noise)
        self.digests: dict[str, dict[str, int]] = {}  # site → digest → round it was first sent

    # single checks, each raising RejectedUpload naming the site
    def max_samples(self, site: str) -> float | None:
        bound = self.config.max_samples
        if isinstance(bound, Mapping):
            bound = bound.get(site)
        return None if bound is None else float(bound)

    def check_weight(self, site: str, weight: Any) -> None:
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise RejectedUpload(f"site {site!r} claimed an aggregation weight (sample count) of {weight!r}, which "
                                 "is not a finite number >= 0; rejected")
        bound = self.max_samples(site)
        if bound is not None:
            allowed = bound + COUNT_NOISE_ALLOWANCE * self.count_noise
            if weight > allowed:
                noise = f" plus {COUNT_NOISE_ALLOWANCE:g}σ of count noise" if self.count_noise else ""
                raise RejectedUpload(f"site {site!r} claimed {weight:.6g} samples, more than the plan's max_samples "
                                     f"{bound:g} for it{noise}; rejected")

    def check_update(self, site: str, upload: Mapping[str, torch.Tensor],
                     reference: Mapping[str, torch.Tensor] | None,
                     reference_norms: dict[tuple[str, ...], float] | None = None) -> float | None:
        """Returns the update's norm ``‖w_k − w‖`` when it was computed, else None. ``reference_norms``:
        ``‖w‖`` per set of model tensors, filled and reused across one round's sites."""
        ratio = self.config.max_update_ratio
        if ratio is None or not reference:
            return None
        names = _weight_names(upload, reference)
        if not names:
            return None
        norm = _update_norm(upload, reference, names)
        reference_norms = {} if reference_norms is None else reference_norms
        if tuple(names) not in reference_norms:
            reference_norms[tuple(names)] = _reference_norm(reference, names)
        ref_norm = reference_norms[tuple(names)]
        if ref_norm == 0 and math.isfinite(norm):
            return norm  # an all-zero global model gives no scale to compare with
        if not math.isfinite(norm) or norm > ratio * ref_norm:
            raise RejectedUpload(f"site {site!r} uploaded a model update of norm {norm:.4g}, more than the plan's "
                                 f"max_update_ratio {ratio:g} × the global model's norm {ref_norm:.4g}; rejected")
        return norm

    def check_replay(self, site: str, upload: Mapping[str, torch.Tensor], round_num: int) -> str | None:
        """The upload's digest, or None when the plan does not reject replays (nothing hashed)."""
        if not self.config.reject_replays:
            return None
        digest = upload_digest(upload)
        first = self.digests.get(site, {}).get(digest)
        if first is not None and first != round_num:
            raise RejectedUpload(f"site {site!r} sent in round {round_num} exactly the upload it sent in round "
                                 f"{first} (a replay, not fresh work); rejected")
        return digest

    def check(self, site: str, upload: Mapping[str, torch.Tensor], weight: Any, round_num: int,
              reference: Mapping[str, torch.Tensor] | None,
              reference_norms: dict[tuple[str, ...], float] | None = None) -> tuple[str | None, float | None]:
        """Every check of one site's (already shape-validated) upload; returns its digest (None when
        replays are not checked) and its update's norm (None when not computed)."""
        self.check_weight(site, weight)
        try:
            self.algorithm.check_upload(site, upload, float(weight))
        except InvalidUploadError as exc:
            raise RejectedUpload(str(exc)) from None
        norm = self.check_update(site, upload, reference, reference_norms)
        return self.check_replay(site, upload, round_num), norm

    # the round
    def screen(self, round_num: int, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, Any],
               reference: Mapping[str, torch.Tensor] | None) -> tuple[dict, dict, dict[str, str]]:
        """``(accepted uploads, their weights, rejected site → reason)``; accepted uploads are clipped
        when the plan says so, and remembered for replay detection. ``round_num``: the round as the
        run's records count it (1 = the round that makes model 1)."""
        accepted, kept, rejected = {}, {}, {}
        reference_norms: dict[tuple[str, ...], float] = {}  # ‖w‖, computed once this round
        for site in sorted(uploads):
            try:
                digest, norm = self.check(site, uploads[site], weights.get(site), round_num, reference, reference_norms)
            except RejectedUpload as exc:
                rejected[site] = f"round {round_num}: {exc}"
                continue
            if digest is not None:
                self.digests.setdefault(site, {}).setdefault(digest, round_num)
            upload = uploads[site]
            if self.config.clip_update_norm is not None and reference:
                upload = clip_update(upload, reference, self.config.clip_update_norm, norm=norm)
            accepted[site], kept[site] = upload, float(weights[site])
        return accepted, kept, rejected

    def aggregate(self, aggregate: Callable[[dict, dict], Any], uploads: dict, weights: dict,
                  state: dict | None = None, round_num: int = 0) -> tuple[Any, dict[str, str]]:
        """``aggregate(uploads, weights)`` → the plugin's downlink; when it is not finite, the sites are
        left out one at a time, largest upload first, until it is (``state``, the server state, is
        restored before each attempt). Returns ``(downlink, rejected site → reason)``."""
        saved = copy.deepcopy(state) if state is not None else None
        downlink = aggregate(uploads, weights)
        if _finite(downlink.global_tensors) and all(_finite(t) for t in downlink.personal.values()):
            return downlink, {}
        order = sorted(uploads, key=lambda s: -_magnitude(uploads[s]))
        for site in order:
            rest = {s: u for s, u in uploads.items() if s != site}
            if not rest:
                break
            if state is not None:
                state.clear()
                state.update(copy.deepcopy(saved))
            candidate = aggregate(rest, {s: weights[s] for s in rest})
            if _finite(candidate.global_tensors) and all(_finite(t) for t in candidate.personal.values()):
                reason = (f"round {round_num}: site {site!r}'s upload made the aggregated global model non-finite (NaN or infinite "
                          f"values; its largest value {_magnitude(uploads[site]):.3g}); rejected")
                return candidate, {site: reason}
        raise FedContrastError(f"round {round_num}: the aggregated global model is not finite and no single site's "
                               "upload explains it; "
                               "nothing was sent to the sites (check the plan's settings, e.g. the learning rate)")
