"""Aggregation rules as pure functions: site uploads in, aggregated tensors out."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .errors import FedContrastError


class UploadError(FedContrastError):
    """An upload that cannot be aggregated; the message names the site and the tensor."""


def normalised_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """``n_k / Σ_j n_j`` for each site; raises on negative, non-finite or all-zero weights."""
    for site, w in weights.items():
        if not math.isfinite(w) or w < 0:
            raise UploadError(f"site {site!r} reported an invalid aggregation weight {w!r}")
    total = sum(weights.values())
    if total <= 0:
        raise UploadError("every site reported an aggregation weight of 0; nothing to average")
    return {site: w / total for site, w in weights.items()}


def weighted_average(uploads: Mapping[str, Mapping[str, torch.Tensor]],
                     weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """FedAvg: ``w = Σ_k n_k/n · w_k`` for every tensor name (McMahan et al. 2017; MOON §2.1).

    ``uploads`` maps site → {tensor name → tensor}; every site must upload the same names and
    shapes. Sums are accumulated in float64 in a fixed (sorted-site) order, so the result does not
    depend on the order in which uploads arrived, then cast back to each tensor's dtype.
    """
    if not uploads:
        raise UploadError("no site uploaded anything this round")
    sites = sorted(uploads)
    share = normalised_weights({s: weights[s] for s in sites})
    reference = uploads[sites[0]]
    for site in sites[1:]:
        if set(uploads[site]) != set(reference):
            missing = sorted(set(reference) ^ set(uploads[site]))
            raise UploadError(f"site {site!r} uploaded different tensors than {sites[0]!r}: {missing[:3]}")
    result = {}
    for name, ref in reference.items():
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for site in sites:
            t = uploads[site][name]
            if t.shape != ref.shape:
                raise UploadError(f"site {site!r} uploaded {name!r} with shape {tuple(t.shape)}, "
                                  f"expected {tuple(ref.shape)}")
            acc += share[site] * t.to(torch.float64)
        result[name] = acc.to(ref.dtype)
    return result
