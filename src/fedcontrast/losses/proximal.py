"""FedProx's proximal term (Li et al. 2020, as restated in MOON §2.1)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def proximal_term(params: Iterable[torch.Tensor], global_params: Iterable[torch.Tensor], *,
                  mu: float) -> torch.Tensor:
    """``μ/2 · ||w − w_glob||²`` summed over every parameter tensor.

    ``params`` and ``global_params`` are matched pairwise (same order, same shapes); the global ones
    should be detached copies.
    """
    if mu < 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    total = None
    for w, g in zip(params, global_params, strict=True):
        sq = (w - g).pow(2).sum()
        total = sq if total is None else total + sq
    if total is None:
        raise ValueError("proximal_term needs at least one parameter tensor")
    return 0.5 * mu * total
