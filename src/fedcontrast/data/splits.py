"""Seeded stratified hold-outs and the tensor preparation shared by every data set.

These helpers are pure: they take arrays and a generator and return new arrays, so the same seed
always gives the same split.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# Images are converted and resized in chunks so that resizing a large data set never needs a second
# full-size float copy in memory at once.
_CHUNK = 4096


def stratified_holdout(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(len(labels))`` into ``(kept, held)`` sorted int64 index arrays.

    About ``round(fraction * N)`` samples are held out, shared among the classes in proportion to
    their size (largest-remainder rounding, ties broken at random by ``rng``). Every class keeps at
    least one sample on the kept side when it has one to spare, so a class never vanishes from the
    training data because of the hold-out. ``fraction == 0`` holds out nothing.
    """
    labels = np.asarray(labels)
    n = labels.shape[0]
    classes, counts = np.unique(labels, return_counts=True)
    exact = fraction * counts
    cap = np.maximum(counts - 1, 0)
    quota = np.minimum(np.floor(exact).astype(np.int64), cap)

    target = min(int(round(fraction * n)), int(cap.sum()))
    # Hand the rounding remainder to the classes that lost the most to flooring; random tie-breaks
    # keep equally sized classes from always favouring the lowest label.
    order = np.lexsort((rng.random(len(classes)), -(exact - np.floor(exact))))
    missing = target - int(quota.sum())
    while missing > 0:
        progressed = False
        for k in order:
            if missing == 0:
                break
            if quota[k] < cap[k]:
                quota[k] += 1
                missing -= 1
                progressed = True
        if not progressed:  # every class is at its cap; target was clipped to cap.sum() above
            break

    kept_parts, held_parts = [], []
    for cls, q in zip(classes, quota):
        members = rng.permutation(np.flatnonzero(labels == cls))
        held_parts.append(members[:q])
        kept_parts.append(members[q:])
    kept = np.sort(np.concatenate(kept_parts)).astype(np.int64) if kept_parts else np.empty(0, np.int64)
    held = np.sort(np.concatenate(held_parts)).astype(np.int64) if held_parts else np.empty(0, np.int64)
    return kept, held


def to_float_images(images: np.ndarray, image_size: int) -> torch.Tensor:
    """Convert an ``(N, C, H, W)`` image array into a float32 tensor of side ``image_size``.

    ``uint8`` input is scaled to ``[0, 1]``; other dtypes are taken as they are (the values are
    normalised afterwards anyway). Resizing uses bilinear interpolation (``align_corners=False``),
    with anti-aliasing when shrinking so that downsampled images do not alias.
    """
    n, channels, height, width = images.shape
    out = torch.empty((n, channels, image_size, image_size), dtype=torch.float32, device="cpu")
    resize = (height, width) != (image_size, image_size)
    shrinking = image_size < min(height, width)
    for start in range(0, n, _CHUNK):
        chunk = torch.from_numpy(np.ascontiguousarray(images[start : start + _CHUNK])).float()
        if images.dtype == np.uint8:
            chunk.div_(255.0)
        if resize:
            chunk = F.interpolate(
                chunk,
                size=(image_size, image_size),
                mode="bilinear",
                align_corners=False,
                antialias=shrinking,
            )
        out[start : start + chunk.shape[0]] = chunk
    return out


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation of ``(N, C, H, W)`` images, shaped ``(1, C, 1, 1)``.

    Sums are accumulated in float64 over chunks: float32 sums over a whole data set lose precision,
    and converting everything to float64 at once would double the memory. A constant channel gets
    std 1 so that normalising it cannot divide by zero.
    """
    channels = x.shape[1]
    total = torch.zeros(channels, dtype=torch.float64, device=x.device)
    total_sq = torch.zeros(channels, dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], _CHUNK):
        chunk = x[start : start + _CHUNK].double()
        total += chunk.sum(dim=(0, 2, 3))
        total_sq += chunk.square().sum(dim=(0, 2, 3))
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / count
    var = (total_sq / count - mean.square()).clamp_min(0.0)
    std = var.sqrt()
    std = torch.where(std > 1e-8, std, torch.ones_like(std))
    return mean.float().view(1, channels, 1, 1), std.float().view(1, channels, 1, 1)


def normalise_(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Normalise ``x`` in place with per-channel ``mean``/``std`` and return it.

    In place because the inputs are fresh tensors owned by the loader; a copy would double memory.
    """
    return x.sub_(mean).div_(std)


def site_test_indices(test_labels: np.ndarray, site_labels: np.ndarray, num_classes: int, seed: int) -> np.ndarray:
    """Indices of a held-out set with a site's own label distribution, drawn from a shared test
    split: per class ``c`` the site holds, ``⌊share_c · T⌋`` (at least 1) samples, with ``T`` as large
    as the test split allows. Sorted; deterministic given ``seed``."""
    counts = np.bincount(np.asarray(site_labels), minlength=num_classes).astype(np.float64)
    available = np.bincount(np.asarray(test_labels), minlength=num_classes).astype(np.float64)
    shares = counts / max(counts.sum(), 1.0)
    present = (shares > 0) & (available > 0)
    if not present.any():
        return np.arange(len(test_labels))
    total = float((available[present] / shares[present]).min())
    rng = np.random.default_rng(seed)
    picked = [rng.permutation(np.flatnonzero(test_labels == c))[:max(1, int(np.floor(shares[c] * total)))]
              for c in np.flatnonzero(present)]
    return np.sort(np.concatenate(picked))
