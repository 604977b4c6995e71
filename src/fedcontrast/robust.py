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

Across the sites of a round (at least three), when the plan sets them: an update whose norm exceeds
``max_update_spread`` × the median norm of the other sites' updates (:func:`update_spreads`), and an
update whose direction disagrees with the others' — cosine to the coordinate-wise median of their
update directions below ``min_update_cosine`` (:func:`update_cosines`) — are rejected.

An upload that fails is rejected alone, with the sender, the bound, the measured value and the reason
named; the others are aggregated. Optionally each update is clipped to ``clip_update_norm`` first, and
model weights are combined by a robust rule (coordinate-wise median or trimmed mean,
:func:`robust_average`) in every weight-sharing plugin
(:meth:`~fedcontrast.algorithms.Algorithm.average_weights`). When the combined downlink is not finite,
the site whose upload caused it is found and named (:meth:`UploadScreen.aggregate`): a site is never
blamed for the global model's fault.

Blame. An update inside every bound can still wreck the global model (a hostile site's update at the
bound, pointing away), after which the honest sites' correcting updates are the ones that exceed it.
So each round the screen notes which upload moved the global model (:func:`abnormal_move`): the one
with the largest contribution ``p_k⟨Δ_k, M⟩/‖M‖²`` to the move ``M``, and the move is *abnormal* when
that upload's norm is at least :data:`ABNORMAL_SPREAD` × the median norm of the other uploads (honest
digits sites measured within 2.6×: 2, 3 and 5 sites, seeds 0–2). A rejection in the next
:data:`BLAME_WINDOW` rounds that the global model may explain (an update over ``max_update_ratio``, a
non-finite upload) then names that site as the likely cause, and so does the stop message when every
upload is non-finite; older abnormal moves are stated as history (:meth:`UploadScreen.earlier_moves`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .aggregation import UploadError, normalised_weights, weighted_average
from .algorithms.base import WEIGHT_PREFIX, InvalidUploadError
from .config import MIN_ROBUST_SITES, ROBUST_RULES
from .errors import FedContrastError

logger = logging.getLogger(__name__)

COUNT_NOISE_ALLOWANCE = 6.0  # standard deviations of a noised count's noise allowed above the declared bound
ABNORMAL_SPREAD = 4.0  # the upload that moved the global model, this × the others' median update norm: abnormal
BLAME_WINDOW = 3  # rounds after an abnormal move in which a rejection the global model may explain names its mover


class RejectedUpload(FedContrastError):
    """An upload the aggregator does not take; the message names the site and the reason.
    ``model_may_explain``: the global model the site received may be the cause (its update over the
    bound may be a correction), so an earlier abnormal move of that model is named with it."""

    def __init__(self, message: str, *, model_may_explain: bool = False) -> None:
        super().__init__(message)
        self.model_may_explain = model_may_explain


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


def _column_median(rows: torch.Tensor) -> torch.Tensor:
    """(K, n) → (n,): per column the middle value, the mean of the two middle ones for even K."""
    values, _ = rows.sort(dim=0)
    t = (rows.shape[0] - 1) // 2
    return values[t:rows.shape[0] - t].mean(dim=0)


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


# --- across the sites of a round ------------------------------------------------------------------
def _shared_weight_names(uploads: Mapping[str, Mapping[str, torch.Tensor]],
                         reference: Mapping[str, torch.Tensor]) -> list[str]:
    names = None
    for upload in uploads.values():
        mine = set(_weight_names(upload, reference))
        names = mine if names is None else names & mine
    return sorted(names or ())


def update_spreads(norms: Mapping[str, float]) -> dict[str, float]:
    """Each site's update norm ``‖Δ_k‖`` over the median of the other sites' (for an even number of
    others the mean of the two middle ones). Sites whose others' median is 0 are left out (nothing to
    compare with)."""
    out = {}
    for site, norm in norms.items():
        others = [n for s, n in norms.items() if s != site]
        median = statistics.median(others) if others else 0.0
        if median > 0:
            out[site] = norm / median
    return out


def update_cosines(uploads: Mapping[str, Mapping[str, torch.Tensor]],
                   reference: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """For each site ``k``: ``cos(Δ_k, m_k)``, where ``Δ_k = w_k − w`` over the model tensors every
    upload shares with the reference ``w`` and ``m_k`` is the coordinate-wise median (as
    :func:`coordinate_median`) of the other sites' update directions ``Δ_j/‖Δ_j‖`` — each other site
    counts once whatever its update's size (the size is ``max_update_ratio``'s and
    ``max_update_spread``'s business). A sign-flipped update points against ``m_k``. Sites whose update
    is zero or not finite take no part; with fewer than :data:`MIN_ROBUST_SITES` taking part, or a
    median direction of zero, nothing is returned for them. Computed in float64, one tensor at a time."""
    names = _shared_weight_names(uploads, reference)
    norms = {s: _update_norm(uploads[s], reference, names) for s in sorted(uploads)}
    sites = [s for s, n in norms.items() if math.isfinite(n) and n > 0]
    if len(sites) < MIN_ROBUST_SITES:
        return {}
    dots = dict.fromkeys(sites, 0.0)
    median_sq = dict.fromkeys(sites, 0.0)
    for name in names:
        ref = reference[name].detach().to("cpu", torch.float64).reshape(-1)
        units = torch.stack([(uploads[s][name].detach().to("cpu", torch.float64).reshape(-1) - ref) / norms[s]
                             for s in sites])  # (K, n)
        for i, site in enumerate(sites):
            median = _column_median(torch.cat([units[:i], units[i + 1:]]))  # (n,)
            dots[site] += float(units[i] @ median)
            median_sq[site] += float(median @ median)
    return {s: dots[s] / math.sqrt(median_sq[s]) for s in sites if median_sq[s] > 0}


# --- which upload moved the global model ---------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """A round whose aggregate moved the global model abnormally, and the upload that moved it.

    ``move_ratio``: ``‖M‖/‖w‖``, ``M`` the global model's move, ``w`` the model the sites received;
    ``share``: the site's contribution ``p_k⟨Δ_k, M⟩/‖M‖²`` to it (``p_k`` its aggregation share);
    ``update_ratio``: ``‖Δ_k‖/‖w‖``; ``spread``: ``‖Δ_k‖`` over the median of the others'."""

    round: int
    site: str
    move_ratio: float
    share: float
    update_ratio: float
    spread: float

    def describe(self) -> str:
        return (f"its update {self.update_ratio:.3g}× the global model's norm and {self.spread:.3g}× the median of "
                f"the other sites' updates made {100 * self.share:.0f} % of the model's move of "
                f"{self.move_ratio:.3g}× its norm")


def abnormal_move(round_num: int, uploads: Mapping[str, Mapping[str, torch.Tensor]], shares: Mapping[str, float],
                  reference: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
                  spread: float = ABNORMAL_SPREAD) -> Move | None:
    """The :class:`Move` when round ``round_num`` moved the global model abnormally, else None.

    ``uploads``: the aggregated uploads; ``shares``: each one's aggregation share ``p_k`` (Σ = 1);
    ``reference``: the model the sites received (``w``); ``new``: the aggregated model. The mover is
    the upload with the largest contribution ``p_k⟨Δ_k, M⟩/‖M‖²`` to the move ``M = new − w`` (the
    contributions sum to 1 for a weighted mean); the move is abnormal when the mover's update norm is
    at least ``spread`` × the median norm of the other uploads' updates (at least two uploads)."""
    names = [n for n in _shared_weight_names(uploads, reference) if n in new]
    if len(uploads) < 2 or not names:
        return None
    sites = sorted(uploads)
    dots = dict.fromkeys(sites, 0.0)
    norms_sq = dict.fromkeys(sites, 0.0)
    move_sq = reference_sq = 0.0
    for name in names:
        ref = reference[name].detach().to("cpu", torch.float64)
        move = new[name].detach().to("cpu", torch.float64) - ref
        move_sq += float((move ** 2).sum())
        reference_sq += float((ref ** 2).sum())
        for site in sites:
            update = uploads[site][name].detach().to("cpu", torch.float64) - ref
            dots[site] += float((update * move).sum())
            norms_sq[site] += float((update ** 2).sum())
    if not move_sq > 0 or not math.isfinite(move_sq) or reference_sq == 0:
        return None
    contribution = {s: shares[s] * dots[s] / move_sq for s in sites}
    mover = max(sites, key=lambda s: (contribution[s], s))
    norms = {s: math.sqrt(v) for s, v in norms_sq.items()}
    ratio = update_spreads(norms).get(mover)
    if ratio is None or ratio < spread:
        return None
    return Move(round=round_num, site=mover, move_ratio=math.sqrt(move_sq / reference_sq), share=contribution[mover],
                update_ratio=norms[mover] / math.sqrt(reference_sq), spread=ratio)


def _cosine_to(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
               direction: Mapping[str, torch.Tensor]) -> float | None:
    """``cos(w_k − w, direction)`` over the model tensors both share, or None when undefined."""
    dot = update_sq = direction_sq = 0.0
    for name in _weight_names(upload, reference):
        if name not in direction:
            continue
        update = upload[name].detach().to("cpu", torch.float64) - reference[name].detach().to("cpu", torch.float64)
        d = direction[name].to(torch.float64)
        dot += float((update * d).sum())
        update_sq += float((update ** 2).sum())
        direction_sq += float((d ** 2).sum())
    if not (update_sq > 0 and direction_sq > 0) or not math.isfinite(dot * update_sq):
        return None
    return dot / math.sqrt(update_sq * direction_sq)


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


def _non_finite(reason: str) -> bool:
    return "NaN or infinite" in reason


def _round_spans(rounds: list[int]) -> str:
    """[1, 2, 3, 7] → '1–3, 7'."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in spans)


def all_rejected_hint(rejected: Mapping[str, str], *, max_update_ratio: float | None,
                      cause: Move | None = None, earlier: str = "") -> str:
    """When every site's upload was rejected as non-finite, the cause is what they all started from:
    say so rather than blaming each site, and name the upload that last moved that model abnormally
    (``cause``) when there is one, else the abnormal moves earlier in the run (``earlier``, see
    :meth:`UploadScreen.earlier_moves`). ``max_update_ratio``: the plan's (None: off)."""
    if not (len(rejected) > 1 and all(_non_finite(r) for r in rejected.values())):
        return ""
    hint = ("; every site's upload is non-finite, so the global model they all started from is the likely cause, "
            "not the sites")
    if cause is not None:
        return (hint + f": it was moved abnormally in round {cause.round} by site {cause.site!r}'s upload "
                f"({cause.describe()}), so site {cause.site!r} is the likely cause")
    if max_update_ratio is None:
        hint += " (was a poisoned upload averaged in with max_update_ratio off?)"
    else:
        hint += (f" (an upload inside max_update_ratio {max_update_ratio:g} can still ruin it: see "
                 "max_update_spread and min_update_cosine; or is the learning rate too high?)")
    return hint + (f"; earlier in this run {earlier}" if earlier else "")


# --- the screen --------------------------------------------------------------------------------
class UploadScreen:
    """One per engine, across rounds (it remembers what each site sent, to spot replays, and which
    uploads moved the global model abnormally, to name them; in memory: a restarted aggregator
    forgets the moves).

    ``config``: the plan's :class:`~fedcontrast.config.RobustnessConfig`; ``algorithm``: the plugin
    (its :meth:`check_upload`); ``count_noise``: the standard deviation of the noise on released
    sample counts (DP), 0 when counts are exact."""

    def __init__(self, config: Any, algorithm: Any, *, count_noise: float = 0.0) -> None:
        self.config = config
        self.algorithm = algorithm
        self.count_noise = float(count_noise)
        self.digests: dict[str, dict[str, int]] = {}  # site → digest → round it was first sent
        self.moves: list[Move] = []  # the last abnormal moves of the global model, oldest first
        self.moved: dict[str, list[int]] = {}  # site → every round in which its upload moved the model abnormally
        self.causes: dict[int, dict[str, Move]] = {}  # round → site named as a likely cause → its move
        self._move_vector: tuple[int, dict[str, torch.Tensor]] | None = None  # the last abnormal move's M
        self._reference: Mapping[str, torch.Tensor] | None = None  # the model the current round's sites received
        self._noted: set[tuple[int, str]] = set()  # (round, site) whose rejection screen() explained already

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
                                     f"{bound:g} for it{noise} (by {weight / allowed:.3g}×); rejected")

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
        if not math.isfinite(norm):
            raise RejectedUpload(f"site {site!r} uploaded a model update whose norm is not finite (NaN or infinite), "
                                 f"so not within the plan's max_update_ratio {ratio:g}; rejected",
                                 model_may_explain=True)
        if norm > ratio * ref_norm:
            measured = norm / ref_norm
            raise RejectedUpload(f"site {site!r} uploaded a model update of norm {norm:.4g}, {measured:.3g}× the "
                                 f"global model's norm {ref_norm:.4g}, above the plan's max_update_ratio {ratio:g} "
                                 f"(by {measured / ratio:.3g}×); rejected", model_may_explain=True)
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

    def check_across(self, uploads: Mapping[str, Mapping[str, torch.Tensor]],
                     reference: Mapping[str, torch.Tensor] | None) -> dict[str, str]:
        """The plan's checks of each update against the other sites' (``max_update_spread``,
        ``min_update_cosine``) when at least :data:`MIN_ROBUST_SITES` uploads carry model weights:
        site → why it is rejected. The direction check rejects the lowest cosine first and recomputes
        without it (a hostile site is among every honest site's "others"), while 3 sites remain."""
        spread, cosine = self.config.max_update_spread, self.config.min_update_cosine
        if (spread is None and cosine is None) or not reference:
            return {}
        sites = [s for s in sorted(uploads) if _weight_names(uploads[s], reference)]
        if len(sites) < MIN_ROBUST_SITES:
            return {}
        rejected: dict[str, str] = {}
        if spread is not None:
            names = _shared_weight_names({s: uploads[s] for s in sites}, reference)
            norms = {s: _update_norm(uploads[s], reference, names) for s in sites}
            for site, measured in update_spreads(norms).items():
                if not measured <= spread:
                    rejected[site] = (f"site {site!r} uploaded a model update of norm {norms[site]:.4g}, "
                                      f"{measured:.3g}× the median norm of the other sites' updates, above the plan's "
                                      f"max_update_spread {spread:g}; rejected")
        if cosine is not None:
            active = [s for s in sites if s not in rejected]
            while len(active) >= MIN_ROBUST_SITES:
                cosines = update_cosines({s: uploads[s] for s in active}, reference)
                if not cosines:
                    break
                worst = min(cosines, key=lambda s: (cosines[s], s))
                if cosines[worst] >= cosine:
                    break
                rejected[worst] = (f"site {worst!r}'s model update points away from the other sites' (cosine "
                                   f"{cosines[worst]:.3f} to the coordinate-wise median of their update directions), "
                                   f"below the plan's min_update_cosine {cosine:g}; rejected")
                active.remove(worst)
        return rejected

    # blame
    def likely_cause(self, round_num: int, site: str | None = None) -> Move | None:
        """The most recent abnormal move of the global model in the :data:`BLAME_WINDOW` rounds before
        ``round_num`` whose mover is not ``site``, or None."""
        return next((m for m in reversed(self.moves)
                     if m.site != site and 0 < round_num - m.round <= BLAME_WINDOW), None)

    def earlier_moves(self, site: str | None = None) -> str:
        """Every other site's upload that moved the global model abnormally so far in the run, with
        its rounds ('' when none): stated as a fact where no move is recent enough to be the likely
        cause (a slow attacker's upload dwarfs the honest ones only until the model it wrecks makes
        theirs large too)."""
        named = [f"site {s!r}'s upload (round{'s' if len(r) > 1 else ''} {_round_spans(r)})"
                 for s, r in sorted(self.moved.items()) if s != site]
        return ("the global model was moved abnormally by " + " and ".join(named)) if named else ""

    def cause_note(self, round_num: int, site: str, upload: Mapping[str, torch.Tensor] | None = None,
                   reference: Mapping[str, torch.Tensor] | None = None) -> str:
        """What to add to a rejection of ``site``'s upload that the global model may explain: the
        upload that moved that model abnormally, named as the likely cause ('' when there is none);
        with ``upload`` and ``reference``, whether the update points back against that move."""
        move = self.likely_cause(round_num, site)
        if move is None:
            earlier = self.earlier_moves(site)
            return f" — earlier in this run {earlier}" if earlier else ""
        self.causes.setdefault(round_num, {})[move.site] = move
        back = ""
        if upload is not None and reference and self._move_vector is not None and self._move_vector[0] == move.round:
            cos = _cosine_to(upload, reference, self._move_vector[1])
            if cos is not None and cos < 0:
                back = f"; its update points back against that move (cosine {cos:.2f})"
        return (f" — but the global model it received was moved abnormally in round {move.round} by site "
                f"{move.site!r}'s upload ({move.describe()}), so site {move.site!r} is the likely cause and this "
                f"update may be a correction{back}")

    def explain(self, round_num: int, rejected: Mapping[str, str], accepted: bool) -> tuple[dict[str, str], str]:
        """The round's rejections as the engines report them: a non-finite upload gets the likely cause
        added (:meth:`cause_note`), unless nothing is left to aggregate and every upload is non-finite,
        when the hint (second value) names the global model and its likely cause instead."""
        cause = self.likely_cause(round_num)
        hint = "" if accepted else all_rejected_hint(rejected, max_update_ratio=self.config.max_update_ratio,
                                                     cause=cause, earlier=self.earlier_moves())
        if hint:
            if cause is not None:
                self.causes.setdefault(round_num, {})[cause.site] = cause
            return dict(rejected), hint
        out = {}
        for site, reason in rejected.items():
            if _non_finite(reason) and (round_num, site) not in self._noted:  # not explained by screen() already
                reason += self.cause_note(round_num, site)
            out[site] = reason
        return out, ""

    # the round
    def screen(self, round_num: int, uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, Any],
               reference: Mapping[str, torch.Tensor] | None) -> tuple[dict, dict, dict[str, str]]:
        """``(accepted uploads, their weights, rejected site → reason)``; accepted uploads are clipped
        when the plan says so, and remembered for replay detection. ``round_num``: the round as the
        run's records count it (1 = the round that makes model 1)."""
        self._reference = reference or None
        self.causes = {r: c for r, c in self.causes.items() if r >= round_num}
        self._noted = {(r, s) for r, s in self._noted if r >= round_num}
        passed, rejected = {}, {}
        reference_norms: dict[tuple[str, ...], float] = {}  # ‖w‖, computed once this round
        for site in sorted(uploads):
            try:
                passed[site] = self.check(site, uploads[site], weights.get(site), round_num, reference, reference_norms)
            except RejectedUpload as exc:
                note = self.cause_note(round_num, site, uploads[site], reference) if exc.model_may_explain else ""
                self._noted.add((round_num, site))
                rejected[site] = f"round {round_num}: {exc}{note}"
        for site, reason in self.check_across({s: uploads[s] for s in passed}, reference).items():
            rejected[site] = f"round {round_num}: {reason}"
            del passed[site]
        accepted, kept = {}, {}
        for site, (digest, norm) in passed.items():
            if digest is not None:
                self.digests.setdefault(site, {}).setdefault(digest, round_num)
            upload = uploads[site]
            if self.config.clip_update_norm is not None and reference:
                upload = clip_update(upload, reference, self.config.clip_update_norm, norm=norm)
            accepted[site], kept[site] = upload, float(weights[site])
        if self.config.rule != "mean" and 0 < len(accepted) < MIN_ROBUST_SITES:
            logger.warning("round %d: only %d upload(s) to combine, so rule %s tolerates no hostile site this round",
                           round_num, len(accepted), self.config.rule)
        return accepted, kept, rejected

    def note_move(self, round_num: int, uploads: Mapping[str, Mapping[str, torch.Tensor]],
                  weights: Mapping[str, float], new: Mapping[str, torch.Tensor]) -> Move | None:
        """Remember round ``round_num``'s move of the global model (from the model this round's sites
        received to ``new``) when it was abnormal (:func:`abnormal_move`); returns it."""
        reference = self._reference
        if not reference or not uploads:
            return None
        if self.config.rule == "mean":
            try:
                shares = normalised_weights({s: float(weights[s]) for s in uploads})
            except UploadError:  # every weight 0: the plugin's own fallback, counted equally here
                shares = {s: 1 / len(uploads) for s in uploads}
        else:  # median, trimmed mean: unweighted
            shares = {s: 1 / len(uploads) for s in uploads}
        move = abnormal_move(round_num, uploads, shares, reference, new)
        if move is None:
            return None
        self.moves = [*self.moves[-BLAME_WINDOW:], move]
        self.moved.setdefault(move.site, []).append(round_num)
        self._move_vector = (round_num, {n: (new[n].detach().to("cpu", torch.float64)
                                             - reference[n].detach().to("cpu", torch.float64)).to(torch.float32)
                                         for n in _shared_weight_names(uploads, reference) if n in new})
        logger.warning("round %d: site %r's upload moved the global model abnormally (%s)", round_num, move.site,
                       move.describe())
        return move

    def aggregate(self, aggregate: Callable[[dict, dict], Any], uploads: dict, weights: dict,
                  state: dict | None = None, round_num: int = 0) -> tuple[Any, dict[str, str]]:
        """``aggregate(uploads, weights)`` → the plugin's downlink; when it is not finite, the sites are
        left out one at a time, largest upload first, until it is (``state``, the server state, is
        restored before each attempt). Returns ``(downlink, rejected site → reason)``; the move of the
        global model is noted (:meth:`note_move`)."""
        saved = copy.deepcopy(state) if state is not None else None
        downlink = aggregate(uploads, weights)
        if _finite(downlink.global_tensors) and all(_finite(t) for t in downlink.personal.values()):
            self.note_move(round_num, uploads, weights, downlink.global_tensors)
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
                self.note_move(round_num, rest, weights, candidate.global_tensors)
                return candidate, {site: reason}
        raise FedContrastError(f"round {round_num}: the aggregated global model is not finite and no single site's "
                               "upload explains it; "
                               "nothing was sent to the sites (check the plan's settings, e.g. the learning rate)")
