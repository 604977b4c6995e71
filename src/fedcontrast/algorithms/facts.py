"""What a plugin knows about the run it is part of, handed over once, when it is built.

A plugin's declarations and checks may depend on the run around it — how many sites there are,
how large the public data set is, whether sample counts arrive noised under differential privacy,
which robust rule combines weights. Engines gather these facts once
(:func:`fedcontrast.construction.run_facts`) and pass them to the plugin's constructor; nothing
sets them afterwards, and a built plugin refuses any new attribute (see
:class:`~fedcontrast.algorithms.base.Algorithm`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RepresentationDPConfig, RobustnessConfig


@dataclass(frozen=True)
class RunFacts:
    """The facts of one run, as a plugin sees them. The defaults describe a lone site without a public
    set, robust rules or DP — what a plugin built in a unit test (``FedAvg()``) gets."""

    num_sites: int = 1  # sites in the federation (RunConfig.clients)
    public_size: int = 0  # samples in the public data set; 0 when the run has none (or the caller holds none)
    robustness: RobustnessConfig | None = None  # the plan's robustness section (Algorithm.average_weights' rule)
    representation_dp: RepresentationDPConfig | None = None  # privacy.representations: clip and noise
    count_noise: float = 0.0  # σ of the noise on a site's released sample count (under DP)
    under_dp: bool = False  # the plan has a privacy section: a site's sample count may arrive noised

    def __post_init__(self) -> None:
        if not (isinstance(self.num_sites, int) and self.num_sites >= 1):
            raise ValueError(f"num_sites must be an integer >= 1, got {self.num_sites!r}")
        if not (isinstance(self.public_size, int) and self.public_size >= 0):
            raise ValueError(f"public_size must be an integer >= 0, got {self.public_size!r}")
        if not self.count_noise >= 0:
            raise ValueError(f"count_noise must be >= 0, got {self.count_noise!r}")

    @property
    def private_representations(self) -> bool:
        """Per-class sums and counts leave the sites noised (representation DP is on)."""
        return self.representation_dp is not None

    @property
    def exact_weights(self) -> bool:
        """A site's aggregation weight (its sample count) arrives exact; False under DP."""
        return not self.under_dp


__all__ = ["RunFacts"]
