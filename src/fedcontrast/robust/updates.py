"""A site's model update ``w_k − w`` (``w``: the global model it received) measured on its own —
its norm, clipped to a bound — and against the other sites' of the same round: its norm over the
median of theirs (:func:`update_spreads`) and its direction's cosine to the median of theirs
(:func:`update_cosines`). L2 norms in float64 over every floating-point model tensor (``model.*``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..config import MIN_ROBUST_SITES
from ..tensors import WEIGHT_PREFIX
from .rules import _column_median


def _weight_names(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, t in upload.items()
                  if n.startswith(WEIGHT_PREFIX) and t.is_floating_point() and n in reference)


def _update_norm_sq(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                    names: list[str], reference64: Mapping[str, torch.Tensor] | None = None) -> float:
    """``‖w_k − w‖²`` over ``names``: one float64 sum per tensor, added in the order of ``names``.
    ``reference64``: the reference's tensors already in float64 on the CPU (kept across sites)."""
    update = 0.0
    for name in names:
        ref = reference64[name] if reference64 is not None else reference[name].detach().to("cpu", torch.float64)
        update += float(((upload[name].detach().to("cpu", torch.float64) - ref) ** 2).sum())
    return update


def _update_norm(upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], names: list[str]) -> float:
    return math.sqrt(_update_norm_sq(upload, reference, names))


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
    compare with). The norms are sorted once: the others' median is read off the sorted list around the
    site's own place (as :func:`statistics.median` of the others computes it), not sorted again per site."""
    order = sorted(norms.items(), key=lambda item: item[1])
    values = [v for _, v in order]
    others = len(values) - 1
    out = {}
    for i, (site, norm) in enumerate(order):
        if not others:
            continue

        def other(j: int, i: int = i) -> float:  # the j-th smallest of the others
            return values[j] if j < i else values[j + 1]

        half = others // 2
        median = other(half) if others % 2 else (other(half - 1) + other(half)) / 2
        if median > 0:
            out[site] = norm / median
    return {site: out[site] for site in norms if site in out}


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
