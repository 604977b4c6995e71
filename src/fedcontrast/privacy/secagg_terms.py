"""What a site masks into the secure sum and what the sum becomes: a plugin's terms laid out as one
vector, scaled into the ring (:func:`term_scale`), checked at the site before masking
(:func:`checked_vector`), agreed by every party before a round (:class:`SumLayout`), and the ring's
precision for those terms, refused at plan time when too coarse (:func:`check_precision`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .secagg import MAX_MEAN_ERROR, Quantizer, SecureAggregationError
from .secagg_reach import bounded_sums


def precision(algorithm: Any, settings: Any, sites: int, min_samples: int) -> tuple[Quantizer, float, float]:
    """The ring of a federation of ``sites`` under ``settings``, the scale of the plugin's terms in it,
    and the worst-case error of the decoded weighted mean per value when every site holds
    ``min_samples`` samples: the ring's step times the scale, over a site's count (terms weighted by
    it) — ``n·step/2`` of error in a sum of ``n`` sites, divided by at least ``n·min_samples``."""
    quantizer = Quantizer.for_sites(float(settings.clip), sites, int(settings.bits))
    scale = float(algorithm.secure_scale(float(settings.max_samples)))
    weighted = scale != 1.0
    error = quantizer.step / 2 * scale / (max(1, min_samples) if weighted else 1)
    return quantizer, scale, error


def check_precision(algorithm: Any, settings: Any, sites: int, min_samples: int) -> None:
    """Refuses settings whose ring is too coarse for the plugin's terms, in one sentence that says what to change."""
    try:
        quantizer, scale, error = precision(algorithm, settings, sites, min_samples)
    except SecureAggregationError as exc:
        raise SecureAggregationError(f"secure_aggregation: {exc}") from None
    if error > MAX_MEAN_ERROR:
        fix = ("set secure_aggregation.bits: 64" if settings.bits == 32 else "lower secure_aggregation.clip")
        raise SecureAggregationError(
            f"secure_aggregation with clip {settings.clip:g}, max_samples {settings.max_samples:g} and a "
            f"{settings.bits}-bit "
            f"ring over {sites} sites leaves {quantizer.frac_bits} fractional bits (step {quantizer.step:.3g}): the "
            f"averaged model could be off by {error:.3g} per value for sites of {min_samples} samples (at most "
            f"{MAX_MEAN_ERROR:g} is allowed); {fix}, lower the clip, or lower max_samples towards the largest "
            "site's sample count")
# --- what a site masks, and what the sum becomes -------------------------------------------------
def flatten_terms(terms: dict[str, Any], scale: float) -> np.ndarray:
    """A site's secure-sum terms (name → tensor) as one float64 vector, divided by ``scale``, in name order."""
    return np.concatenate([np.asarray(terms[k].detach().cpu().double().numpy()).ravel() / scale for k in sorted(terms)])


def unflatten_terms(total: np.ndarray, layout: dict[str, tuple[int, ...]], scale: float) -> dict[str, Any]:
    """The inverse of :func:`flatten_terms` for a sum: name → float64 tensor of ``layout``'s shape, times ``scale``."""
    import torch

    out, offset = {}, 0
    for k in sorted(layout):
        size = math.prod(layout[k])
        out[k] = torch.from_numpy(total[offset:offset + size].reshape(layout[k]) * scale)
        offset += size
    if offset != total.size:
        raise SecureAggregationError(f"the secure sum has {total.size} values where the plugin's terms declare "
                                     f"{offset}")
    return out


@dataclass(frozen=True)
class SumLayout:
    """What every party of a deployment agrees on before a round: the plugin's secure-sum terms
    (name → shape, in the order :func:`flatten_terms` lays them out), the uploads' dtypes and the
    scale of the terms in the ring (:func:`term_scale`); ``settings``, the plan's secure_aggregation:
    what the unmasked sum is checked against (:func:`~.secagg_reach.bounded_sums`; None: a layout
    made for its size alone, whose sums are not checked)."""

    terms: dict[str, tuple[int, ...]]
    dtypes: dict[str, Any]  # upload name → torch dtype
    scale: float
    settings: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, algorithm: Any, specs: list[Any], settings: Any) -> SumLayout:
        """From the plugin's declared uploads (``specs``: name, shape, dtype)."""
        import torch

        zeros = {s.name: torch.zeros(tuple(s.shape), dtype=getattr(torch, s.dtype)) for s in specs}
        terms = algorithm.secure_terms(zeros, 1.0, float(settings.clip))
        return cls({k: tuple(v.shape) for k, v in terms.items()}, {k: v.dtype for k, v in zeros.items()},
                   term_scale(algorithm, settings), settings)

    @property
    def words(self) -> int:
        """The length of the vector each site masks."""
        return sum(math.prod(shape) for shape in self.terms.values())

    def downlink(self, algorithm: Any, total: np.ndarray, server: Any, *, survivors: int | None = None,
                 round_num: int | None = None) -> Any:
        """The plugin's next downlink (:meth:`~fedcontrast.algorithms.Algorithm.aggregate_secure`)
        from the unmasked sum ``total`` of ``survivors`` sites (None: not known, from 2 to every site),
        once a hostile site's reach on it is bounded (:func:`~.secagg_reach.bounded_sums`: a count sum
        the survivors could not have sent is refused, naming ``round_num``, default the server's
        round; every average is clipped to its honest range)."""
        sums = {k: v.to(server.device) for k, v in unflatten_terms(np.asarray(total), self.terms, self.scale).items()}
        if self.settings is not None:
            sites = max(len(server.sites or ()), int(algorithm.facts.num_sites), survivors or 0)
            sums = bounded_sums(algorithm, sums, self.settings, survivors=survivors, sites=sites,
                                round_num=server.round_num if round_num is None else round_num)
        return algorithm.aggregate_secure(sums, server, self.dtypes)


def site_terms(algorithm: Any, uploads: dict[str, Any], weight: float, settings: Any) -> dict[str, Any]:
    """A site's secure-sum terms, its count clipped to ``max_samples``."""
    return algorithm.secure_terms(uploads, min(float(weight), float(settings.max_samples)), float(settings.clip))


def secure_vector(algorithm: Any, uploads: dict[str, Any], weight: float, settings: Any) -> np.ndarray:
    """What a site masks: its :func:`site_terms`, scaled by :func:`term_scale` into the ring's range."""
    return flatten_terms(site_terms(algorithm, uploads, weight, settings), term_scale(algorithm, settings))


def checked_vector(site: str, algorithm: Any, uploads: dict[str, Any], weight: float, settings: Any,
                   specs: list[Any]) -> np.ndarray:
    """What a deployed site masks, once its own input passed the checks the aggregator can no longer
    make: the declared names, shapes and dtypes, finite values, the plugin's own checks
    (:meth:`~fedcontrast.algorithms.Algorithm.check_upload`), a finite count, and the terms clipped
    and finite. Raises :class:`~fedcontrast.tensors.InvalidUploadError` in one sentence; the site then
    withdraws from the round (:func:`~.secagg_protocol.withdrawal`)."""
    from ..algorithms.capabilities import check_upload
    from ..tensors import InvalidUploadError, validate_uploads

    validate_uploads(site, uploads, specs)
    if not (math.isfinite(float(weight)) and float(weight) > 0):
        raise InvalidUploadError(f"site {site!r}'s sample count {weight!r} is not a finite positive number; rejected")
    check_upload(algorithm, site, uploads, float(weight))
    vector = secure_vector(algorithm, uploads, weight, settings)
    if not np.isfinite(vector).all():
        raise InvalidUploadError(f"site {site!r}'s secure-sum terms hold NaN or infinite values; rejected")
    return vector


def term_scale(algorithm: Any, settings: Any) -> float:
    """What a plugin's terms are divided by before the ring (``max_samples`` for count-weighted terms,
    :meth:`~fedcontrast.algorithms.Algorithm.secure_scale`), and the sums multiplied by after."""
    return float(algorithm.secure_scale(float(settings.max_samples)))
