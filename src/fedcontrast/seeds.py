"""Seeds derived from integers: the same parts give the same seed in any process (NumPy's
``SeedSequence``, a hash designed for this)."""

from __future__ import annotations

import numpy as np


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers: the same parts always give the same seed, in any process."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)
