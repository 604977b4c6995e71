"""Privacy accounting through Opacus's accountants: what a site has spent, and what a plan will spend.

The state is a *history*: a list of ``[noise_multiplier, sample_rate, steps]`` entries, the format of
Opacus's accountants, kept as plain lists of numbers so that it lives in a site's persisted state
(``torch.load(weights_only=True)`` reads it) and survives restarts. The maths stays in Opacus.

Each round a site may run two mechanisms, composed in the same history:

* DP-SGD (local training): ``local_epochs · ⌊1/q⌋`` Poisson-subsampled Gaussian steps with
  ``q = 1/⌈n/B⌉`` — exactly what Opacus's ``DPDataLoader`` samples for a site of ``n`` samples and
  batch size ``B``;
* the representation release: two full-batch Gaussian mechanisms (``sample_rate = 1``) of noise
  multiplier σ, one on the per-class sums and one on the counts (see ``representations.py``).

And once per federation, unless the site's policy declares its sample count public: the count
itself (its aggregation weight), ``n + N(0, σ_n²)`` with sensitivity 1 under add/remove adjacency —
one Gaussian mechanism ``[σ_n, 1, 1]``, released in the first round and reused afterwards
(post-processing).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..config import PrivacyConfig, TrainingConfig

Entry = list  # [noise_multiplier: float, sample_rate: float, steps: int]

# A representation release = the sums mechanism + the counts mechanism, each of multiplier σ.
RELEASE_MECHANISMS = 2


def import_opacus() -> None:
    """Opacus, imported without its side effect on logging: its ``utils.module_utils`` calls
    ``logging.basicConfig`` at import, which gives the root logger a second handler where the program
    sets up its own afterwards (an OpenFL party whose checks computed ε first: every line of its log
    twice). The handlers that import added are removed; call before any other import of Opacus."""
    import logging

    if "opacus.utils.module_utils" in sys.modules:
        return
    root = logging.getLogger()
    before = list(root.handlers)
    import opacus.utils.module_utils  # noqa: F401

    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)


def make_accountant(kind: str):
    """A fresh Opacus accountant of ``kind`` ("rdp" or "prv")."""
    import_opacus()
    from opacus.accountants import PRVAccountant, RDPAccountant

    return {"rdp": RDPAccountant, "prv": PRVAccountant}[kind]()


def compact(history: Iterable[Sequence[float]]) -> list[Entry]:
    """Merge entries of equal (noise multiplier, sample rate): composition is commutative, and a short
    history keeps the PRV accountant fast. Order of first appearance is kept."""
    merged: dict[tuple[float, float], int] = {}
    for sigma, q, steps in history:
        key = (float(sigma), float(q))
        merged[key] = merged.get(key, 0) + int(steps)
    return [[sigma, q, steps] for (sigma, q), steps in merged.items() if steps > 0]


def epsilon(history: Iterable[Sequence[float]], *, delta: float, accountant: str = "rdp") -> float:
    """ε at ``delta`` of the composition of every mechanism in ``history`` (0 for an empty one)."""
    entries = compact(history)
    if not entries:
        return 0.0
    acc = make_accountant(accountant)
    acc.history = [(sigma, q, steps) for sigma, q, steps in entries]
    return float(acc.get_epsilon(delta=delta))


def dp_sgd_sample_rate(n: int, batch_size: int) -> float:
    """Opacus's ``DPDataLoader`` sample rate for ``n`` samples in batches of ``batch_size``."""
    return 1 / math.ceil(n / batch_size)


def dp_sgd_steps_per_epoch(sample_rate: float) -> int:
    """Batches per epoch of Opacus's Poisson sampler (``UniformWithReplacementSampler``)."""
    return int(1 / sample_rate)


def round_history(privacy: PrivacyConfig, training: TrainingConfig, n: int, *,
                  dp_sgd: bool = True, representations: bool = True,
                  representation_releases: int = RELEASE_MECHANISMS) -> list[Entry]:
    """The mechanisms one round adds to a site's history, planned from the configuration alone.

    ``dp_sgd`` / ``representations`` say whether the plugin actually runs the mechanism (a plugin
    that uploads no class sums runs no representation release even when it is configured);
    ``representation_releases``: Gaussian mechanisms per release (the plugin's declaration: 2 for
    per-class sums and counts, 1 for public-set representations)."""
    history: list[Entry] = []
    if privacy.dp_sgd is not None and dp_sgd:
        q = dp_sgd_sample_rate(n, training.batch_size)
        history.append([privacy.dp_sgd.noise_multiplier, q, training.local_epochs * dp_sgd_steps_per_epoch(q)])
    if privacy.representations is not None and representations:
        history.append([privacy.representations.noise_multiplier, 1.0, representation_releases])
    return history


def count_history(privacy: PrivacyConfig) -> list[Entry]:
    """The one-off release of a site's sample count: one Gaussian mechanism of sensitivity 1."""
    return [[privacy.count_noise_multiplier, 1.0, 1]]


@dataclass(frozen=True)
class PlannedEpsilon:
    delta: float
    per_round: float  # ε of one round's mechanisms alone (the one-off count release aside)
    total: float  # ε after ``rounds`` rounds (composed, with the count release when it is noised)
    rounds: int


def planned_epsilon(privacy: PrivacyConfig, training: TrainingConfig, *, n: int, rounds: int,
                    dp_sgd: bool = True, representations: bool = True,
                    representation_releases: int = RELEASE_MECHANISMS, count: bool = True) -> PlannedEpsilon:
    """ε per round and after ``rounds`` rounds for a site of ``n`` samples, from the configuration
    alone; ``count``: the site's sample count is released noised (False: its policy makes it public)."""
    one = round_history(privacy, training, n, dp_sgd=dp_sgd, representations=representations,
                        representation_releases=representation_releases)
    total = [[sigma, q, steps * rounds] for sigma, q, steps in one] + (count_history(privacy) if count else [])
    return PlannedEpsilon(delta=privacy.delta, rounds=rounds,
                          per_round=epsilon(one, delta=privacy.delta, accountant=privacy.accountant),
                          total=epsilon(total, delta=privacy.delta, accountant=privacy.accountant))
