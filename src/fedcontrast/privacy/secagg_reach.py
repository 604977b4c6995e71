"""How far one hostile site can move the averaged model under secure aggregation, and the checks the
aggregator makes on the unmasked sum so that this is bounded (:func:`bounded_sums`, :func:`model_reach`).

**The attack.** A masked word cannot be checked, so a hostile site among the survivors can add any
word of the ring to each term it masks: after decoding, every summed term, counts included, can land
anywhere in ``[−R·S, R·S)`` (``R`` = :attr:`~.secagg.Quantizer.reach`, ``S`` the plugin's term scale,
:func:`~.secagg_terms.term_scale`). A plugin's aggregate divides a summed numerator ``T`` by a summed
count ``D``: FedAvg, FedProx and MOON ``Σ n_k·w_k / Σ n_k``; FedSSC's pooled class means and FedPCL's
global prototypes ``Σ n_kc·m_kc / Σ n_kc`` per class; FLESD ``Σ M_k / Σ 1``. Unchecked, a count
summed to about 0 or below it moves the model without bound.

**The checks** (:func:`bounded_sums`, on every engine's path: :meth:`~.secagg_terms.SumLayout.downlink`):

a. a count sum outside what the ``s`` survivors can send, ``[s·c_lo, s·c_hi]`` (one honest site adds
   from ``c_lo`` to ``c_hi``: :meth:`~fedcontrast.algorithms.SecureSum.secure_counts`; widened by
   the ring's rounding), is refused in one sentence naming the round, never divided by;
b. each numerator is clipped to ``[−B·D, B·D]``, so each average ``T/D`` to ``[−B, B]``, the range an
   honest average takes (:meth:`~fedcontrast.algorithms.SecureSum.secure_averages`: a count-weighted
   mean of values clipped to ``±clip`` lies within ``±clip``; FedPCL's prototypes, means of unit
   vectors, and FLESD's cosines within ``±1``). An honest sum is left as it is, bit for bit.

**The reach** (:func:`model_reaches`). Let ``μ ∈ [−B, B]`` be the average of the ``s − 1`` honest
survivors and ``v`` the one the aggregator makes. By (b) ``|v| ≤ B``, and ``|v| ≤ |T|/D ≤ R·S/D_lo``
with ``D_lo = t·c_lo`` the smallest count sum (a) accepts (``t``, the threshold, is the fewest
survivors), so::

    |v − μ| ≤ reach = B + min(B, R·S / (t·c_lo))  =  2·B

The ring term never binds: a ring the plan accepts holds every site's terms without wrapping,
``R > 2·n·clip`` (:meth:`~.secagg.Quantizer.for_sites`), so ``R·S/(t·c_lo) > 2·clip·S/c_lo ≥ 2·B``
(``S = max_samples ≥ c_lo = 1`` for count-weighted terms, ``S = c_lo = 1`` for FLESD's; ``c_lo = 0``,
a class nobody shares, makes it infinite). The bound is attained: with every honest value at ``−B``
the hostile site sets its count so that ``D`` is any sum (a) accepts and its numerator so that
``T ≥ B·D`` (``B·D ≤ B·s·c_hi < R·S``): ``v = +B``, ``2·B`` from ``μ``. Bounding the counts cannot
lower it: only the total can be checked, and the numerator, unverifiable, alone decides where ``v``
lands — so ``max_samples``, ``bits``, the number of sites, the threshold and ``min_samples`` drop out
and only ``B`` (the clip, or the plugin's own ±1) remains. What (a) adds is that ``D`` stays within
the survivors' counts: no division by a count cancelled to about 0, or made negative. A class count
may still be moved to or from 0: one hostile site can make a class present or absent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .secagg import Quantizer, SecureAggregationError


@dataclass(frozen=True)
class Reach:
    """One average a plugin makes from its secure sum (``term``, or every term it starts when it ends
    in ``.``, divided by the count term ``over``), the bound its honest values lie within
    (``[−bound, bound]``) and how far one hostile site can move each of its values (``reach``) and
    each summed term (``term_reach``, in ring units, as :attr:`~.secagg.Quantizer.reach`); ``setting``:
    the plan setting that lowers it (None: the plugin's own range, which no setting lowers)."""

    term: str
    over: str
    bound: float
    reach: float
    term_reach: float
    setting: str | None

    @property
    def what(self) -> str:
        return f"{self.term}* / {self.over}" if self.term.endswith(".") else f"{self.term} / {self.over}"


def _terms(term: str, names: Any) -> list[str]:
    """The summed terms a numerator declaration stands for (a prefix ending in ``.``: every term it starts)."""
    return [n for n in names if n.startswith(term)] if term.endswith(".") else [term] if term in names else []


def model_reaches(algorithm: Any, settings: Any, sites: int) -> list[Reach]:
    """Each of the plugin's averages under the plan's secure-aggregation ``settings`` over ``sites``
    sites (the threshold, ``settings.sites_needed(sites)``, is the fewest survivors): ``B + min(B,
    R·S/(t·c_lo))``, which is ``2·B`` for every ring a plan accepts (see the module's derivation).
    Raises :class:`~.secagg.SecureAggregationError` for a ring too narrow for the sites."""
    clip, max_samples = float(settings.clip), float(settings.max_samples)
    quantizer = Quantizer.for_sites(clip, sites, int(settings.bits))
    ring = quantizer.reach * float(algorithm.secure_scale(max_samples))  # |T| ≤ ring, in the sums' own units
    counts = algorithm.secure_counts(max_samples)
    fewest = settings.sites_needed(sites)
    out = []
    for term, (over, bound) in algorithm.secure_averages(clip).items():
        smallest = fewest * counts[over][0]  # the smallest count sum the aggregator accepts
        far = min(bound, ring / smallest) if smallest > 0 else bound
        out.append(Reach(term, over, bound, bound + far, quantizer.reach,
                         "secure_aggregation.clip" if bound >= clip else None))
    return out


def model_reach(algorithm: Any, settings: Any, sites: int) -> float:
    """How far one hostile site among the survivors can move each value of the averaged model, the
    largest over the plugin's averages (:func:`model_reaches`): twice the bound of the honest values."""
    return max(r.reach for r in model_reaches(algorithm, settings, sites))


def bounded_sums(algorithm: Any, sums: Mapping[str, torch.Tensor], settings: Any, *, round_num: int,
                 survivors: int | None, sites: int) -> dict[str, torch.Tensor]:
    """The unmasked ``sums`` (term → float64 tensor, in the terms' own units) as the plugin may divide
    them: refused, in one sentence naming the round, when a count sum lies outside what ``survivors``
    sites can send (unknown: from 2 to ``sites``), within the ring's rounding; each numerator clipped to
    ``[−B·D, B·D]`` so that its average lies in the honest range ``[−B, B]``. Sums an honest round
    gives are returned unchanged."""
    clip, max_samples = float(settings.clip), float(settings.max_samples)
    fewest, most = (survivors, survivors) if survivors is not None else (2, max(sites, 2))
    ring = Quantizer.for_sites(clip, max(sites, most), int(settings.bits))  # the coarsest ring any engine uses
    slack = most * ring.step * float(algorithm.secure_scale(max_samples))  # a step per site: twice its rounding
    who = f"{survivors} surviving sites" if survivors is not None else f"from 2 to {most} surviving sites"
    for name, (least, largest) in algorithm.secure_counts(max_samples).items():
        if name not in sums:
            continue
        value = sums[name].to(torch.float64)
        low, high = fewest * least - slack, most * largest + slack
        bad = ~((value >= low) & (value <= high))  # NaN too
        if bool(bad.any()):
            worst = float(value[bad].reshape(-1)[0])
            raise SecureAggregationError(
                f"round {round_num}: the secure sum's {name} is {worst:.6g}, outside what {who} can send "
                f"({fewest * least:.6g} to {most * largest:.6g}), so a site masked a count no site holds and the "
                "round is not aggregated (dividing by it could move the model without bound)")
    out = dict(sums)
    for term, (over, bound) in algorithm.secure_averages(clip).items():
        if over not in sums or not math.isfinite(bound):
            continue
        count = sums[over].to(torch.float64).clamp_min(0.0)
        for name in _terms(term, sums):
            value = sums[name]
            limit = bound * (count.reshape(()) if count.numel() == 1
                             else count.reshape(tuple(count.shape) + (1,) * (value.dim() - count.dim())))
            out[name] = torch.minimum(torch.maximum(value, -limit), limit).to(value.dtype)
    return out


__all__ = ["Reach", "bounded_sums", "model_reach", "model_reaches"]
