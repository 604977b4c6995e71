"""Feature shift among sites, as scanners differ: each site's images pass through a device of its own.

A site's scanner is drawn once from ``(split_seed, site index)`` and fixed for the run: a contrast
(the images' values multiplied by it), a brightness offset, a Gaussian blur (its width in pixels)
and sensor noise (its standard deviation). The values act on the normalised images (mean 0, std 1),
so a contrast of 0.6 and noise of 0.3 mean what they say whatever the data set. The noise is
drawn once per image and fixed, as it is part of an acquired image: reading a sample twice gives the
same pixels.

The labels are untouched: a feature-shift federation pairs a scanner per site with any label
partition (``iid`` isolates the shift). The shared test split is divided among the sites, each part
scanned by its site's device, so the global model is scored on every site's kind of image and each
site on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

SCANNER_STREAM = 0x5CA  # a site's scanner draws from a stream of its own

# the ranges a site's scanner is drawn from (uniformly)
CONTRAST = (0.4, 1.6)
BRIGHTNESS = (-0.6, 0.6)
BLUR = (0.0, 1.5)  # Gaussian σ in pixels; below 0.3 no blur is applied
NOISE = (0.0, 0.6)


@dataclass(frozen=True)
class Scanner:
    """One site's device: ``x ↦ contrast · blur_σ(x) + brightness + noise · ε`` on normalised images."""

    contrast: float
    brightness: float
    blur: float
    noise: float

    def describe(self) -> str:
        return (f"contrast {self.contrast:.2f}, brightness {self.brightness:+.2f}, blur σ {self.blur:.2f} px, "
                f"noise {self.noise:.2f}")


def scanner_for(site_index: int, split_seed: int) -> Scanner:
    """Site ``site_index``'s scanner, the same in every process that knows the split seed."""
    rng = np.random.default_rng([split_seed, site_index, SCANNER_STREAM])
    return Scanner(*(float(rng.uniform(lo, hi)) for lo, hi in (CONTRAST, BRIGHTNESS, BLUR, NOISE)))


def gaussian_kernel(sigma: float) -> torch.Tensor:
    """A normalised 1-D Gaussian of standard deviation ``sigma`` over ±3σ (at least ±1 pixel)."""
    radius = max(1, int(np.ceil(3 * sigma)))
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    return kernel / kernel.sum()


def blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of ``(N, C, H, W)`` images, edges replicated. Shape kept."""
    if sigma < 0.3:
        return x
    kernel = gaussian_kernel(sigma).to(x.device)
    k, channels = kernel.numel(), x.shape[1]
    pad = k // 2
    out = F.pad(x, (pad, pad, 0, 0), mode="replicate")
    out = F.conv2d(out, kernel.view(1, 1, 1, k).repeat(channels, 1, 1, 1), groups=channels)
    out = F.pad(out, (0, 0, pad, pad), mode="replicate")
    return F.conv2d(out, kernel.view(1, 1, k, 1).repeat(channels, 1, 1, 1), groups=channels)


def scan(x: torch.Tensor, scanner: Scanner, *, seed: int) -> torch.Tensor:
    """``x`` as ``scanner`` acquires it (a new tensor); ``seed`` fixes the images' noise."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)
    return scanner.contrast * blur(x, scanner.blur) + scanner.brightness + scanner.noise * noise
