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

    The floating-point tensors are combined all at once: each site's flattened into one row, a block of
    sites' rows stacked (:func:`site_blocks`), scaled by their shares in float64 and added to the sum one
    row after another — the very products and sums of a loop over sites and tensors, in a few
    operations per site instead of a few per site and tensor.
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
    for name, ref in reference.items():
        for site in sites:
            t = uploads[site][name]
            if t.shape != ref.shape:
                raise UploadError(f"site {site!r} uploaded {name!r} with shape {tuple(t.shape)}, "
                                  f"expected {tuple(ref.shape)}")
    floats = [n for n, t in reference.items() if t.is_floating_point()]
    summed = _weighted_sum(uploads, sites, share, floats) if floats else {}
    result = {}
    for name, ref in reference.items():
        if name in summed:
            result[name] = summed[name].reshape(ref.shape).to(ref.dtype, copy=True)
            continue
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for site in sites:
            acc += share[site] * uploads[site][name].to(device=acc.device, dtype=torch.float64)
        result[name] = acc.to(ref.dtype)
    return result


def _weighted_sum(uploads: Mapping[str, Mapping[str, torch.Tensor]], sites: list[str], share: Mapping[str, float],
                  names: list[str]) -> dict[str, torch.Tensor]:
    """``Σ_k share_k · w_k`` in float64 over the tensors ``names`` (floating point), flattened: name → sum."""
    device = uploads[sites[0]][names[0]].device
    sizes = [uploads[sites[0]][n].numel() for n in names]
    acc = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    row64 = None
    for block in site_blocks(sites, acc.numel()):
        flat = _flat_row(uploads[block[0]], names, acc.numel()) if len(block) == 1 else None
        if flat is not None:  # a site's tensors are one array's consecutive pieces: that array is its row
            row64 = torch.empty_like(acc) if row64 is None else row64
            row64.copy_(flat)  # exact: every floating dtype is a subset of float64
            row64 *= share[block[0]]
            acc += row64
            continue
        rows = torch.cat([uploads[s][n].to(device).reshape(-1) for s in block for n in names])
        rows = rows.to(torch.float64).reshape(len(block), -1)  # exact: every floating dtype is a subset of float64
        rows *= torch.tensor([share[s] for s in block], dtype=torch.float64, device=device).unsqueeze(1)
        for row in rows:  # ((0 + a_1) + a_2) + …: the loop's order, one site after another
            acc += row
    return dict(zip(names, acc.split(sizes)))


def _flat_row(upload: Mapping[str, torch.Tensor], names: list[str], numel: int) -> torch.Tensor | None:
    """The one-dimensional tensor whose consecutive pieces are ``upload``'s tensors ``names`` in that
    order, when they are views of one such tensor of ``numel`` values (an upload that travelled as one
    array arrives so: :func:`fedcontrast.sim.transfer.unpack`); else None. Its values are those of the
    tensors concatenated, without the copy."""
    base = upload[names[0]]._base
    if base is None or base.dim() != 1 or base.numel() != numel:
        return None
    offset = base.storage_offset()
    for name in names:
        t = upload[name]
        if t._base is not base or t.storage_offset() != offset or not t.is_contiguous():
            return None
        offset += t.numel()
    return base


BLOCK_VALUES = 1 << 16  # the most values stacked over a block of sites (512 KiB in float64: in cache)


def site_blocks(sites: list[str], numel: int, budget: int = BLOCK_VALUES) -> list[list[str]]:
    """``sites`` in consecutive blocks of at most ``budget`` values of a tensor of ``numel`` values (at
    least one site a block): the sites' copies of one tensor are stacked a block at a time."""
    size = max(1, budget // max(numel, 1))
    return [sites[i:i + size] for i in range(0, len(sites), size)]


def global_prototypes(prototypes: Mapping[str, torch.Tensor], counts: Mapping[str, torch.Tensor], *,
                      weighting: str = "count") -> tuple[torch.Tensor, torch.Tensor]:
    """FedPCL's global prototypes ``G^c`` and which classes have one.

    ``count``: ``G^c = Σ_{i has c} n_i^c P_i^c / Σ_i n_i^c``. ``paper_eq6``: the paper's eq. 6,
    ``(1/|N_c|) Σ_{i ∈ N_c} (n_i^c / N_c) P_i^c`` — the same average divided by the number of sites
    ``|N_c|`` that have class c. Shapes: ``(C, d)`` and ``(C,)`` per site → ``(C, d)``, ``(C,)``.
    """
    if weighting not in ("count", "paper_eq6"):
        raise ValueError(f"prototype weighting must be count or paper_eq6, got {weighting!r}")
    sites = sorted(prototypes)
    total = torch.zeros_like(prototypes[sites[0]], dtype=torch.float64)
    n = torch.zeros(total.shape[0], dtype=torch.float64, device=total.device)
    holders = torch.zeros_like(n)
    for s in sites:
        c = counts[s].to(device=total.device, dtype=torch.float64)
        total += c[:, None] * prototypes[s].to(device=total.device, dtype=torch.float64)
        n += c
        holders += (c > 0).to(torch.float64)
    present = n > 0
    result = torch.where(present[:, None], total / n.clamp_min(1)[:, None], torch.zeros_like(total))
    if weighting == "paper_eq6":
        result = result / holders.clamp_min(1)[:, None]
    return result.to(prototypes[sites[0]].dtype), present.to(prototypes[sites[0]].dtype)


# Per-class means under secure aggregation: the names of a site's terms (see class_mean_terms).
CLASS_SUM, CLASS_COUNT, CLASS_HOLDERS = "classes.sum", "classes.count", "classes.holders"


def class_mean_terms(means: torch.Tensor, counts: torch.Tensor, weight: float, clip: float, *,
                     holders: bool = False) -> dict[str, torch.Tensor]:
    """One site's part of the secure sum of per-class means (float64): ``count_c · clip(mean_c)``,
    ``count_c`` and, with ``holders``, ``1[count_c > 0]``. Each count is clipped to ``[0, weight]`` and
    each mean to ``[-clip, clip]``, so every element is within ``[-clip·weight, clip·weight]``. The
    sums over sites give :func:`global_prototypes` (:func:`pooled_class_means`).
    Shapes: ``(C, d), (C,) → (C, d), (C,)[, (C,)]``."""
    c = counts.detach().to(torch.float64).clamp(0.0, max(float(weight), 0.0))
    terms = {CLASS_SUM: c[:, None] * means.detach().to(c.device, torch.float64).clamp(-clip, clip), CLASS_COUNT: c}
    if holders:
        terms[CLASS_HOLDERS] = (c > 0).to(torch.float64)
    return terms


def pooled_class_means(sums: Mapping[str, torch.Tensor], *, weighting: str = "count",
                       dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_prototypes` from the sums over sites of :func:`class_mean_terms` (``paper_eq6``
    needs the holders). A class is present where its summed count exceeds 0.5: counts are whole
    numbers, a secure sum's within its quantisation error of them. ``→ (C, d), (C,)``."""
    n = sums[CLASS_COUNT].to(torch.float64)
    present = n > 0.5
    total = sums[CLASS_SUM].to(torch.float64)
    result = torch.where(present[:, None], total / n.clamp_min(1)[:, None], torch.zeros_like(total))
    if weighting == "paper_eq6":
        result = result / sums[CLASS_HOLDERS].to(torch.float64).round().clamp_min(1)[:, None]
    return result.to(dtype), present.to(dtype)


def fill_missing_prototypes(local: torch.Tensor, counts: torch.Tensor, global_protos: torch.Tensor) -> torch.Tensor:
    """A site's local prototype set with ``G^c`` in place of every class it lacks (``count == 0``)."""
    return torch.where((counts > 0).to(local.device)[:, None], local, global_protos.to(local.device))


def dual_aggregation(uploads: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float], *,
                     first_pass: str = "weighted") -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """FedSiam-DA's dual aggregation (paper eqs. 13–16; docs/algorithms.md#fedsiam-da).

    First pass ``w0 = Σ_k n_k/n w_k`` (``first_pass="mean"``: the plain mean). Second pass
    ``ξ_k = cos(flat(w_k), flat(w0)) / Σ_j cos(flat(w_j), flat(w0))`` over each whole flattened model,
    ``w = Σ_k ξ_k w_k``. Negative cosines are clipped to 0; when no cosine is positive the result is
    ``w0``. Returns ``(w, ξ)`` (ξ in sorted-site order, all 0 on the fallback).
    """
    if first_pass not in ("weighted", "mean"):
        raise ValueError(f"first_pass must be weighted or mean, got {first_pass!r}")
    sites = sorted(uploads)
    w0 = weighted_average(uploads, weights if first_pass == "weighted" else {s: 1.0 for s in sites})
    names = sorted(w0)
    flat0 = torch.cat([w0[n].reshape(-1).to(torch.float64) for n in names])
    cosines = {}
    for s in sites:
        flat = torch.cat([uploads[s][n].reshape(-1).to(device=flat0.device, dtype=torch.float64) for n in names])
        denom = flat.norm() * flat0.norm()
        cosines[s] = max(0.0, float(flat @ flat0 / denom)) if denom > 0 else 0.0
    total = sum(cosines.values())
    if total <= 0:
        return w0, {s: 0.0 for s in sites}
    xi = {s: c / total for s, c in cosines.items()}
    return weighted_average(uploads, xi), xi
