"""The Gaussian mechanism on representations that leave a site (no Opacus needed: plain tensors).

Per-class sums (FedSSC class means, FedPCL prototypes)
------------------------------------------------------
Release ``S_c = Σ_{i: y_i = c} clip(z_i)`` and ``n_c = |{i: y_i = c}|`` for every class c, where
``clip(z) = z · min(1, C/‖z‖₂)``, as ``S̃_c = S_c + N(0, σ²C² I)`` and ``ñ_c = n_c + N(0, σ²)``; the
plugin then divides (``S̃_c / ñ_c``) and thresholds on ``ñ_c`` — post-processing, free of privacy cost.

Sensitivity (add/remove one sample, with the encoder that computed the z's regarded as given):
the sample belongs to one class c, so the sum matrix S changes in one row by ``clip(z_i)``, whose L2
norm is ≤ C; the count vector changes in one entry by exactly 1. Each sample is counted at most once
(repeats of an index are ignored), so this holds however batches are drawn. Hence the sums are a
Gaussian mechanism of noise multiplier σ (std σC / sensitivity C), and so are the counts (std σ /
sensitivity 1): the release is accounted as two Gaussian mechanisms of multiplier σ at sample rate 1.

What "the encoder regarded as given" means: the z's come from a model trained on the same private
data. With DP-SGD on, the composition argument is: (1) DP-SGD's *output* — the final local weights
θ — is a DP release (Poisson-subsampled Gaussian steps, accounted); (2) the class sums are a
function of θ and of the data only — one pass over *every* sample with the final model, each
counted once (FedSSC's ``class_means: final_model``, FedPCL's prototype pass) — released through the
Gaussian mechanism above, whose sensitivity holds for any fixed θ; so (3) by adaptive composition the
pair (θ, noisy sums) is accounted by one accountant holding both histories: an end-to-end guarantee.
Step (2) fails if the sums depend on DP-SGD's *internal* randomness rather than on its output — for
example sums over the last epoch's Poisson batches, whose membership is DP-SGD's hidden draw (in a
run only 61 % of the samples entered them): then the sums are not a function of the released θ and
the data, and the argument does not hold. FedSSC therefore refuses ``class_means: last_epoch`` under
DP-SGD. Without DP-SGD the guarantee covers the sample's direct contribution to the uploaded tensors
only, not its influence through the model's weights (which FedSSC uploads raw anyway).

Public-set representations (FLESD)
----------------------------------
See :func:`gaussian_public_representations`.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from ..algorithms.base import ClassSums


def clip_rows(z: torch.Tensor, clip: float) -> torch.Tensor:
    """Each row scaled to L2 norm ≤ ``clip`` (rows already within it are unchanged). ``(N, d) → (N, d)``."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
    norms = z.norm(dim=1, keepdim=True)
    return z * (clip / norms.clamp_min(1e-12)).clamp(max=1.0)


def gaussian_noise(shape: tuple[int, ...], std: float, generator: torch.Generator, *,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   secure: bool = False) -> torch.Tensor:
    """N(0, std²) samples drawn on the CPU from ``generator`` (reproducible on any device).

    ``secure``: the sampling Opacus's ``secure_mode`` uses against floating-point attacks on the
    Gaussian mechanism (Holohan & Braghin 2021, §5.1, n = 2): one draw discarded, then the sum of 4
    draws of N(0, std²) halved — still exactly N(0, std²), but its low-order bits no longer reveal the
    value the noise was added to."""
    if not secure:
        return (torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu") * std).to(device=device,
                                                                                                      dtype=dtype)
    torch.randn((1,), generator=generator, dtype=torch.float64, device="cpu")  # discarded, as Opacus does
    total = cast(torch.Tensor, sum(torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu") * std
                                   for _ in range(4)))
    return (total / 2).to(device=device, dtype=dtype)


class GaussianClassSums(ClassSums):
    """:class:`ClassSums` whose samples are clipped to ``clip`` and whose release adds Gaussian noise
    (the mechanism of this module's docstring). ``on_release`` is called once per release, for the
    accountant."""

    def __init__(self, num_classes: int, dim: int, num_samples: int, device: torch.device, *,
                 noise_multiplier: float, clip: float, generator: torch.Generator, on_release=None,
                 secure: bool = False) -> None:
        super().__init__(num_classes, dim, num_samples, device)
        self.noise_multiplier, self.clip = float(noise_multiplier), float(clip)
        self.generator = generator
        self.on_release = on_release
        self.secure = secure

    def transform(self, z: torch.Tensor) -> torch.Tensor:
        return clip_rows(z, self.clip)

    def release(self) -> tuple[torch.Tensor, torch.Tensor]:
        sums, counts = super().release()
        sigma, c = self.noise_multiplier, self.clip
        noisy_sums = sums + gaussian_noise(tuple(sums.shape), sigma * c, self.generator, secure=self.secure,
                                           device=sums.device, dtype=sums.dtype)  # sensitivity C (one row)
        noisy_counts = counts + gaussian_noise(tuple(counts.shape), sigma, self.generator, secure=self.secure,
                                               device=counts.device, dtype=counts.dtype)  # sensitivity 1
        if self.on_release is not None:
            self.on_release()
        return noisy_sums, noisy_counts


def public_sensitivity(num_public: int, row_norm: float = 1.0) -> float:
    """L2 sensitivity of ``Z`` (``num_public`` rows of norm ≤ ``row_norm``) to *any* change of the encoder:
    each row moves by at most ``2·row_norm``, so the matrix moves by at most ``2·row_norm·√N``."""
    return 2.0 * row_norm * math.sqrt(num_public)


def gaussian_public_representations(z: torch.Tensor, *, noise_multiplier: float, generator: torch.Generator,
                                    secure: bool = False) -> tuple[torch.Tensor, float]:
    """FLESD's ``Z_k = normalize(f_k(P))`` (N, d) released with Gaussian noise; returns ``(Z̃, Δ)``.

    Sensitivity argument. P is public and the same on every site; the site's private data reaches
    ``Z_k`` only through the encoder weights. Nothing bounds how much one private sample moves the
    weights of an encoder trained without DP, so no per-sample sensitivity exists for ``Z`` itself.
    What is bounded is the change under *any* change of the encoder: every row is unit-norm (rows are
    re-normalised here, so this holds for any input), hence ``‖Z − Z'‖_F ≤ Δ = 2√N``. Adding
    ``N(0, σ²Δ²)`` to every entry is therefore a Gaussian mechanism of multiplier σ with respect to
    replacing the site's *whole* private data set (site-level DP), which implies the same guarantee
    for one sample. It is accounted as one mechanism ``[σ, 1.0, 1]`` per release. The noise is large
    (std ``2σ√N`` per entry against entries of size ~``1/√d``): for a useful sample-level guarantee,
    train the encoder with DP-SGD instead — ``Z`` is then post-processing of the DP weights and needs
    no noise of its own (σ here can stay off). ``M_k = Z̃ Z̃ᵀ`` is post-processing of ``Z̃``.
    Shape: ``(N, d) → (N, d)``.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    if z.dim() != 2:
        raise ValueError(f"z must have shape (N, d), got {tuple(z.shape)}")
    unit = torch.nn.functional.normalize(z, dim=1)
    delta = public_sensitivity(z.shape[0])
    noise = gaussian_noise(tuple(z.shape), noise_multiplier * delta, generator, device=z.device, dtype=z.dtype,
                           secure=secure)
    return unit + noise, delta


def public_release_history(noise_multiplier: float) -> list[list[float]]:
    """The accountant entry of one :func:`gaussian_public_representations` release."""
    return [[float(noise_multiplier), 1.0, 1]]
