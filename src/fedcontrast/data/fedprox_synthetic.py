"""FedProx's Synthetic(α, β) (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys
2020, §5.1): a generator of non-IID data with sites of its own, as many as the federation has.

Site ``k`` draws, from a random stream of its own (the seed and ``k``; so site ``k``'s samples are the
same whatever the number of sites, and each could be made alone):

* its size ``n_k = min_site_samples + ⌊exp(Z)⌋``, ``Z ~ N(m, s²)`` (a power law: a few large sites,
  many small ones), at most ``max_site_samples``;
* its model: ``u_k ~ N(0, α²)``, ``W_k ∈ R^{C×d}`` and ``b_k ∈ R^C`` with entries ``~ N(u_k, 1)``;
* its features' mean: ``B_k ~ N(0, β²)``, ``v_k ∈ R^d`` with entries ``~ N(B_k, 1)``;
* its samples: ``x ~ N(v_k, Σ)`` with ``Σ`` diagonal, ``Σ_jj = j^-1.2`` (j = 1 … d), and the label
  ``y = argmax_c (W_k x + b_k)_c`` (the most likely class of the softmax).

α and β are read as standard deviations. Note what α does not do: ``u_k`` is one number per site,
added to every entry of ``W_k`` and ``b_k``, so it adds ``u_k (1 + Σ_j x_j)`` to every class's score
alike, and the largest score stays where it was. The labels (and the features, which never see u_k)
are the same whatever α: α changes the sites' models, not their data. What makes sites differ is
each site's own ``W_k``, ``b_k`` and ``v_k``, and β: the larger β, the farther each site's features
sit from the origin, so the more one or two classes dominate its labels (measured in docs/usage.md).

The ``d`` features of a sample fill a one-channel ``S × S`` image row-major (``S = ⌈√d⌉``, at least
8), the pixels after them zero; :func:`~fedcontrast.data.load_dataset` then resizes it to the run's
image size like any other image. Each site's first samples are its held-out test samples, the next its
share of the public split, the rest its training samples: the samples of a site are independent
draws, so a prefix is as random a split as any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config.datasets import FedProxSyntheticSettings
from ..errors import DataError

_STREAM = 0x5E7  # this generator's random streams, apart from the others a seed starts
_MAX_BYTES = 16 << 30  # the generated images at most (before resizing): a cap a typo cannot pass


@dataclass(frozen=True)
class SiteData:
    """The generated splits as images, with each site's indices into train and test."""

    train: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    public: tuple[np.ndarray, np.ndarray] | None
    site_train: tuple[np.ndarray, ...]
    site_test: tuple[np.ndarray, ...]
    class_names: tuple[str, ...]


def image_side(features: int) -> int:
    """The side of the square image ``features`` values are laid out in (at least 8)."""
    return max(8, math.isqrt(features - 1) + 1)


def site_sizes(settings: FedProxSyntheticSettings, rngs: list[np.random.Generator]) -> np.ndarray:
    """Each site's number of samples, the first draw of its stream."""
    z = np.array([rng.normal(settings.lognormal_mean, settings.lognormal_sigma) for rng in rngs])
    sizes = settings.min_site_samples + np.floor(np.exp(np.minimum(z, 40.0)))  # exp(40): beyond any cap below
    if settings.max_site_samples is not None:
        sizes = np.minimum(sizes, settings.max_site_samples)
    return sizes.astype(np.int64)


def _site_samples(settings: FedProxSyntheticSettings, rng: np.random.Generator, n: int,
                  scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One site's ``n`` feature vectors ``(n, d)`` float32 and labels, drawn from its stream."""
    d, c = settings.features, settings.classes
    u = rng.normal(0.0, settings.alpha)
    w = rng.normal(u, 1.0, size=(c, d))
    b = rng.normal(u, 1.0, size=c)
    v = rng.normal(rng.normal(0.0, settings.beta), 1.0, size=d)
    x = rng.standard_normal((n, d)) * scale + v
    y = np.argmax(x @ w.T + b, axis=1)
    return x.astype(np.float32), y.astype(np.int64)


def split_counts(n: np.ndarray, test_fraction: float, public_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Per site: (held-out test samples, public samples); at least one test and one training sample."""
    test = np.clip(np.rint(test_fraction * n), 1, n - 1).astype(np.int64)
    public = np.minimum(np.rint(public_fraction * (n - test)), n - test - 1).astype(np.int64)
    return test, public


def make_fedprox_synthetic(settings: FedProxSyntheticSettings, *, sites: int, seed: int, test_fraction: float,
                           public_fraction: float) -> SiteData:
    """Generate ``sites`` sites of Synthetic(α, β) (see the module's description), seeded by ``seed``."""
    d = settings.features
    side = image_side(d)
    rngs = [np.random.default_rng([seed, _STREAM, k]) for k in range(sites)]
    n = site_sizes(settings, rngs)
    if int(n.sum()) * side * side * 4 > _MAX_BYTES:
        raise DataError(f"fedprox_synthetic at {sites} sites would hold {int(n.sum()):,} samples, over "
                        f"{_MAX_BYTES >> 30} GiB: set max_site_samples (or a smaller lognormal_mean/sigma)")
    n_test, n_public = split_counts(n, test_fraction, public_fraction)
    n_train = n - n_test - n_public
    scale = np.arange(1, d + 1, dtype=np.float64) ** -0.6  # the square root of Σ's diagonal j^-1.2

    def empty(total: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((total, side * side), np.float32), np.empty(total, np.int64)

    train, test = empty(int(n_train.sum())), empty(int(n_test.sum()))
    public = empty(int(n_public.sum())) if public_fraction > 0 else None
    starts = {name: np.concatenate([[0], np.cumsum(part)]) for name, part in
              (("train", n_train), ("test", n_test), ("public", n_public))}
    for k, rng in enumerate(rngs):
        x, y = _site_samples(settings, rng, int(n[k]), scale)
        cuts = (0, int(n_test[k]), int(n_test[k] + n_public[k]), int(n[k]))
        for (name, target), lo, hi in zip((("test", test), ("public", public), ("train", train)), cuts, cuts[1:]):
            if target is not None and hi > lo:
                at = int(starts[name][k])
                target[0][at:at + hi - lo, :d] = x[lo:hi]
                target[1][at:at + hi - lo] = y[lo:hi]

    def images(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return pair[0].reshape(-1, 1, side, side), pair[1]

    def ranges(name: str) -> tuple[np.ndarray, ...]:
        edges = starts[name]
        return tuple(np.arange(edges[k], edges[k + 1], dtype=np.int64) for k in range(sites))

    return SiteData(train=images(train), test=images(test), public=images(public) if public is not None else None,
                    site_train=ranges("train"), site_test=ranges("test"),
                    class_names=tuple(f"class_{c}" for c in range(settings.classes)))

