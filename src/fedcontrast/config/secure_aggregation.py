"""The run configuration's secure-aggregation section (:class:`SecureAggregationConfig`) and its
thresholds: the smallest a lying operator cannot defeat, the default, and the colluders a threshold
tolerates. Re-exported by :mod:`fedcontrast.config.sections`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .checks import _check, _check_types, _finite

FEDERATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a federation's name, as its sites pin it


@dataclass(frozen=True)
class SecureAggregationConfig:
    """Secure aggregation (:mod:`fedcontrast.privacy.secagg`): the aggregator learns only the sum of
    the sites' uploads. ``threshold``: the sites needed to unmask a round (Shamir t of n; default
    ``⌊2n/3⌋ + 1``, Bonawitz et al.'s choice against a lying operator, :func:`default_threshold`;
    at least ``⌊n/2⌋ + 1``, :func:`minimum_threshold`); a round with fewer survivors ends without a sum. ``clip``: every
    weight a site uploads is clipped to ``[-clip, clip]`` before masking (the bound the aggregator can
    no longer check itself). ``max_samples``: a site's count is clipped to it and uploads are scaled by
    it (``n_k·w_k / max_samples`` and ``n_k / max_samples`` are what is summed). ``bits``: the ring, 32
    (bytes as float32 uploads) or 64. ``neighbours``: whom a site masks with and shares its secrets
    among (:mod:`fedcontrast.privacy.secagg_graph`): ``auto`` (SecAgg+'s random graph of degree
    ``2·⌈3·log2 n⌉`` once that is under half the sites, else every site), ``full`` (every site,
    Bonawitz et al.'s protocol) or an even degree. ``federation``: the federation's name, as the sites
    pinned it with their roster (a site policy's ``federation:``, :mod:`fedcontrast.site.roster`)."""

    threshold: int | None = None
    clip: float = 10.0
    max_samples: float = 100000.0
    bits: int = 32
    neighbours: str | int = "auto"
    federation: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "secure_aggregation.")
        _check(self.threshold is None or (isinstance(self.threshold, int) and self.threshold >= 2),
               f"secure_aggregation.threshold must be an integer >= 2 (or left out), got {self.threshold!r}")
        _check(_finite(self.clip) and self.clip >= 1,
               f"secure_aggregation.clip must be a number >= 1, got {self.clip!r}")
        _check(_finite(self.max_samples) and self.max_samples >= 1,
               f"secure_aggregation.max_samples must be a number >= 1, got {self.max_samples!r}")
        _check(self.bits in (32, 64), f"secure_aggregation.bits must be 32 or 64, got {self.bits!r}")
        _check(self.neighbours in ("auto", "full") or (isinstance(self.neighbours, int) and not isinstance(
            self.neighbours, bool) and self.neighbours >= 4 and self.neighbours % 2 == 0),
               f"secure_aggregation.neighbours must be auto, full or an even number >= 4, got {self.neighbours!r}")
        _check(self.federation is None or bool(FEDERATION_ID.fullmatch(self.federation)),
               f"secure_aggregation.federation must be a name of letters, digits, '.', '_' and '-' (at most 100), "
               f"got {self.federation!r}")

    def sites_needed(self, sites: int) -> int:
        """The threshold for a round of ``sites`` sites."""
        return self.threshold if self.threshold is not None else default_threshold(sites)


def minimum_threshold(sites: int) -> int:
    """The smallest secure-aggregation threshold at which an operator that lies, with no site
    colluding, cannot unmask one site: two survivor sets that each gather ``t`` consistency
    signatures must share a signer (``2t > n``), and an honest site signs one set per round."""
    return sites // 2 + 1


def default_threshold(sites: int) -> int:
    """Bonawitz et al.'s threshold against an active adversary, ``⌊2n/3⌋ + 1``: it withstands a
    lying operator together with up to ``colluders_tolerated`` sites (about a third)."""
    return (2 * sites) // 3 + 1


def colluders_tolerated(sites: int, threshold: int) -> int:
    """How many sites may collude with a lying operator while it still learns only sums of at least
    two honest sites: fewer than ``2t − n`` (no two survivor sets can both gather ``t`` signatures)
    and at most ``t − 2`` (a sum of ``t`` sites minus the colluders' own inputs must still hold two
    honest ones)."""
    return max(0, min(2 * threshold - sites - 1, threshold - 2))
