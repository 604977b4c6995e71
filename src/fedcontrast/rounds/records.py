"""What a round's records make of the sites' numbers, once for every engine: the sites' held-out
scores of a model as the one figure the round's record carries (:func:`weighted_site_mean`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def weighted_site_mean(evaluations: Iterable[Mapping[str, Any]], key: str = "accuracy", samples: str = "samples", *,
                       default: float = 0.0) -> tuple[float, float] | None:
    """The mean of the sites' ``key`` weighted by their ``samples`` (``default`` where an evaluation
    has none; e.g. the size of the held-out split), over the evaluations that have ``key`` and samples
    above 0, and the samples' total; None when no evaluation has both. ``Σ n_k·a_k / Σ n_k``, both
    sums taken in the order of ``evaluations``."""
    total, weighted = 0.0, 0.0
    for measured in evaluations:
        n = float(measured.get(samples, default)) if key in measured else 0.0
        if n > 0:
            total += n
            weighted += n * float(measured[key])
    return (weighted / total, total) if total else None
