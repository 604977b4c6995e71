"""Secure aggregation's ring: fixed-point values in Z/2^32 or Z/2^64 (:class:`Quantizer`), the
protocol's name every signature and hash is bound to, and its error (:mod:`.secagg` has the rest)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import FedContrastError

PROTOCOL = "fedcontrast secagg v3"  # v3: Shamir over GF(2^130 − 5)
# The decoded weighted mean may be off by at most this much per value (every site at the plan's
# min_samples); coarser settings are refused at plan time (:func:`precision`).
MAX_MEAN_ERROR = 1e-2


class SecureAggregationError(FedContrastError):
    """The protocol cannot go on (a bad signature, too few survivors, a share that does not decrypt);
    the message names the site."""


# --- fixed point in Z/2^64 --------------------------------------------------------------------------
@dataclass(frozen=True)
class Quantizer:
    """Values clipped to ``[-clip, clip]`` and scaled by ``2**frac_bits``, as two's-complement words of
    ``bits`` bits (32 or 64): sums wrap modulo 2^bits exactly like the masks, and decode correctly
    while ``|sum| < 2^(bits-1)``. A 32-bit ring sends as many bytes as float32 uploads."""

    clip: float
    frac_bits: int
    bits: int = 32

    @classmethod
    def for_sites(cls, clip: float, sites: int, bits: int = 32) -> Quantizer:
        """The finest scale at which the sum of ``sites`` clipped values cannot wrap:
        sites·clip·2^f < 2^(bits-2)."""
        if not (clip > 0 and sites >= 1) or bits not in (32, 64):
            raise SecureAggregationError(f"secure aggregation needs clip > 0, at least one site and a 32- or 64-bit "
                                         f"ring, got clip {clip}, {sites} sites, {bits} bits")
        frac_bits = bits - 2 - math.ceil(math.log2(clip * sites + 1))
        if frac_bits < 8:
            raise SecureAggregationError(f"{sites} sites with values up to {clip} leave a {bits}-bit ring under 8 bits "
                                         "of precision: lower the clip or use 64 bits")
        return cls(clip, min(frac_bits, 40), bits)

    @property
    def unsigned(self):
        return np.uint32 if self.bits == 32 else np.uint64

    @property
    def signed(self):
        return np.int32 if self.bits == 32 else np.int64

    @property
    def step(self) -> float:
        """The spacing of the ring's fixed-point values."""
        return 2.0 ** -self.frac_bits

    @property
    def reach(self) -> float:
        """How far one hostile site can move each summed value: a masked word is unverifiable, so it can
        add any word of the ring, i.e. anything in ``[-reach, reach)`` after decoding (``2^(bits-1-f)``,
        two to four times ``sites·clip``), not only values within the clip."""
        return 2.0 ** (self.bits - 1 - self.frac_bits)

    def encode(self, x: np.ndarray) -> np.ndarray:
        scaled = np.rint(np.clip(np.asarray(x, dtype=np.float64), -self.clip, self.clip) * 2.0**self.frac_bits)
        return scaled.astype(self.signed).view(self.unsigned)

    def decode(self, total: np.ndarray) -> np.ndarray:
        return total.view(self.signed).astype(np.float64) / 2.0**self.frac_bits

    def error_bound(self, sites: int) -> float:
        """Largest difference between the decoded sum and the sum of the clipped values: half a step per site."""
        return sites * 0.5 / 2.0**self.frac_bits
