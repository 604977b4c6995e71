"""The secure-aggregation lines of the privacy audit (:mod:`.report`): what the ring does to the terms,
whom the protocol withstands (its threshold, SecAgg+'s neighbourhoods) and how far one hostile site can
move the averaged model."""

from __future__ import annotations

import math
from typing import Any

from ..config import RunConfig


def _neighbourhoods(n: int, setting: str | int) -> list[str]:
    """SecAgg+'s graph and what it withstands (privacy/secagg_graph.py), when the round uses it."""
    from ..privacy.secagg_graph import failure_bounds, neighbourhood_size, neighbourhood_threshold

    k = neighbourhood_size(n, setting)
    if k >= n - 1:
        return []
    bound = {key: f"2^{math.log2(v):.0f}" if v > 0 else "0" for key, v in failure_bounds(n, k).items()}
    return [f"neighbourhoods (SecAgg+; every engine): each site masks with and shares among {k} of the "
            f"{n} sites, {neighbourhood_threshold(k)} of its {k + 1} holders rebuild a secret; the threshold above "
            f"holds for the full graph only: with 5 % of the sites colluding, an operator that follows the protocol "
            f"unmasks an honest site with probability ≤ {bound['follows']} per round, one that lies about dropouts "
            f"≤ {bound['lies']}, and a round fails with 5 % dropouts ≤ {bound['fails']} (docs/privacy.md); these are "
            "the odds of one round's graph, which every site draws from randomness all of them committed to "
            "before any revealed its own (no party can choose or search it; each round a site or the operator "
            "makes fail in view of every site adds one more draw); neighbours: full for the full graph's "
            "guarantee"]


def _hostile_reach(config: RunConfig, algorithm: Any) -> tuple[float | None, str | None]:
    """One hostile site's reach on the averaged model and the setting that lowers it (None, None: no
    secure aggregation, or a ring the plan cannot have)."""
    from ..privacy.secagg import SecureAggregationError
    from ..privacy.secagg_reach import model_reaches

    if config.secure_aggregation is None:
        return None, None
    try:
        reaches = model_reaches(algorithm, config.secure_aggregation, config.clients)
    except SecureAggregationError:
        return None, None
    worst = max(reaches, key=lambda r: r.reach)
    return worst.reach, worst.setting


def _secure_ring(config: RunConfig, algorithm: Any) -> list[str]:
    """What secure aggregation's ring does to the terms, and whom the protocol withstands, for the privacy officer."""
    from ..config.sections import colluders_tolerated
    from ..privacy.secagg import MAX_MEAN_ERROR, SecureAggregationError
    from ..privacy.secagg_reach import model_reaches
    from ..privacy.secagg_terms import precision

    secure = config.secure_aggregation
    if secure is None:
        return []
    n = config.clients
    t = secure.sites_needed(n)
    try:
        quantizer, scale, error = precision(algorithm, secure, n, config.min_samples)
    except SecureAggregationError as exc:
        return [f"ring: {exc}"]
    lines = [f"ring: {secure.bits}-bit words, {quantizer.frac_bits} fractional bits: step {quantizer.step:.3g} per "
             f"term (terms divided by {scale:g} before the ring); the averaged model is off by at most {error:.3g} per "
             f"value for sites of {config.min_samples} samples (limit {MAX_MEAN_ERROR:g})",
             f"threshold {t} of {n} sites: an operator that lies to the sites learns only sums of at least "
             f"{t - colluders_tolerated(n, t)} honest sites while at most {colluders_tolerated(n, t)} site(s) collude "
             f"with it (Bonawitz et al.'s protocol against an active adversary; 2t > n + colluders)",
             *_neighbourhoods(n, secure.neighbours),
             *[f"averaged model: one hostile site can move each value of {r.what} by up to {r.reach:g} (the honest "
               f"values lie in [−{r.bound:g}, {r.bound:g}]); each summed term by up to ±{r.term_reach:g} — the "
               "aggregator refuses a count sum the survivors could not have sent and clips each average to that range"
               + (f", so lower {r.setting} to lower it" if r.setting else ", whatever the settings")
               for r in model_reaches(algorithm, secure, n)],
             f"a hostile site can move each summed term by up to ±{quantizer.reach:g} (any word of the ring, "
             f"{quantizer.reach / secure.clip:.1f} × the clip {secure.clip:g}), not only within the clip: masked "
             "uploads cannot be checked; robust rules cannot run, so clip and add DP at the site"]
    return lines
