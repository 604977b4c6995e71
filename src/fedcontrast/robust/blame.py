"""Blame: which upload moved the global model abnormally (:func:`abnormal_move`), and how a
rejection or the stop message names it as the likely cause (:func:`all_rejected_hint`; the screen's
:meth:`~fedcontrast.robust.UploadScreen.cause_note`).

An update inside every bound can still wreck the global model, after which the honest sites'
correcting updates are the ones that exceed it: the screen notes each round's abnormal move and names
its mover when a rejection in the next :data:`BLAME_WINDOW` rounds may be explained by it."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..aggregation import site_blocks
from .updates import _shared_weight_names, _weight_names, update_spreads

ABNORMAL_SPREAD = 4.0  # the upload that moved the global model, this × the others' median update norm: abnormal
BLAME_WINDOW = 3  # rounds after an abnormal move in which a rejection the global model may explain names its mover


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
                  spread: float = ABNORMAL_SPREAD, norms_sq: Mapping[str, float] | None = None) -> Move | None:
    """The :class:`Move` when round ``round_num`` moved the global model abnormally, else None.

    ``uploads``: the aggregated uploads; ``shares``: each one's aggregation share ``p_k`` (Σ = 1);
    ``reference``: the model the sites received (``w``); ``new``: the aggregated model. The mover is
    the upload with the largest contribution ``p_k⟨Δ_k, M⟩/‖M‖²`` to the move ``M = new − w`` (the
    contributions sum to 1 for a weighted mean); the move is abnormal when the mover's update norm is
    at least ``spread`` × the median norm of the other uploads' updates (at least two uploads).
    ``norms_sq``: site → ``‖Δ_k‖²`` where already measured over the same tensors (the screen's
    :class:`~.screen.UploadFacts`). The sites' updates are measured together: each site's model tensors
    flattened into one row, a block of sites' rows at a time (:func:`~fedcontrast.aggregation.site_blocks`),
    not one site and tensor at a time."""
    names = [n for n in _shared_weight_names(uploads, reference) if n in new]
    if len(uploads) < 2 or not names:
        return None
    sites = sorted(uploads)
    move_sq = reference_sq = 0.0
    for name in names:
        ref = reference[name].detach().to("cpu", torch.float64)
        move_sq += float(((new[name].detach().to("cpu", torch.float64) - ref) ** 2).sum())
        reference_sq += float((ref ** 2).sum())
    if not move_sq > 0 or not math.isfinite(move_sq) or reference_sq == 0:
        return None
    flat_ref = torch.cat([reference[n].detach().to("cpu", torch.float64).reshape(-1) for n in names])
    squares = dict(norms_sq or {})  # the sites' own measure where given (the one their screen checked)
    unknown = [s for s in sites if s not in squares]
    for block, updates in _update_blocks(uploads, unknown, names, flat_ref):
        squares.update(zip(block, updates.square_().sum(dim=1).tolist()))
    norms = {s: math.sqrt(squares[s]) for s in sites}
    spreads = update_spreads(norms)
    if all(r < spread for r in spreads.values()):
        return None  # no upload's update is large enough to make the move abnormal, whoever moved it most
    move = torch.cat([new[n].detach().to("cpu", torch.float64).reshape(-1) for n in names]) - flat_ref
    dots: dict[str, float] = {}
    for block, updates in _update_blocks(uploads, sites, names, flat_ref):
        dots.update(zip(block, (updates @ move).tolist()))
    contribution = {s: shares[s] * dots[s] / move_sq for s in sites}
    mover = max(sites, key=lambda s: (contribution[s], s))
    ratio = spreads.get(mover)
    if ratio is None or ratio < spread:
        return None
    return Move(round=round_num, site=mover, move_ratio=math.sqrt(move_sq / reference_sq), share=contribution[mover],
                update_ratio=norms[mover] / math.sqrt(reference_sq), spread=ratio)


def _update_blocks(uploads: Mapping[str, Mapping[str, torch.Tensor]], sites: list[str], names: list[str],
                   flat_reference: torch.Tensor) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(block of sites, their updates ``w_k − w`` over ``names`` flattened, one float64 row per site)
    for consecutive blocks of ``sites`` (:func:`~fedcontrast.aggregation.site_blocks`)."""
    for block in site_blocks(sites, flat_reference.numel()):
        updates = torch.cat([uploads[s][n].detach().to("cpu").reshape(-1) for s in block for n in names])
        updates = updates.to(torch.float64).reshape(len(block), -1)
        updates -= flat_reference
        yield block, updates


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
