"""Robust ways to combine the sites' tensors: the coordinate-wise median and trimmed mean (Yin et
al. 2018), unweighted, beside FedAvg's weighted mean (:func:`robust_average` picks one by the plan's
``robustness.rule``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..aggregation import UploadError, weighted_average
from ..config import ROBUST_RULES


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
