"""Contrastive losses as pure functions of tensors.

The shared piece is :func:`info_nce`: cross-entropy over similarity logits where one column is the
positive. MOON's model-contrastive loss is InfoNCE with one positive (the global model's
representation) and one negative (the previous local model's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def check_temperature(temperature: float) -> None:
    """Raise ``ValueError`` unless ``temperature`` is a finite number > 0."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def info_nce(similarities: torch.Tensor, positive: torch.Tensor | int = 0, *,
             temperature: float) -> torch.Tensor:
    """Mean InfoNCE loss ``−log( e^{s_pos/τ} / Σ_j e^{s_j/τ} )`` over the rows.

    Shape: ``similarities (B, M)``; ``positive`` is the column of each row's positive, an int or a
    ``(B,)`` integer tensor. Returns a scalar.
    """
    check_temperature(temperature)
    if similarities.dim() != 2:
        raise ValueError(f"similarities must have shape (B, M), got {tuple(similarities.shape)}")
    if isinstance(positive, int):
        positive = torch.full((similarities.shape[0],), positive, dtype=torch.long,
                              device=similarities.device)
    return F.cross_entropy(similarities / temperature, positive)


def moon_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, *,
                          temperature: float = 0.5) -> torch.Tensor:
    """MOON's model-contrastive loss (Li et al. 2021, eq. 3), averaged over the batch.

    ``l_con = −log( e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ}) )`` with
    ``sim`` the cosine similarity. ``z_glob`` and ``z_prev`` come from frozen models and should carry
    no gradient.
    Shape: ``z, z_glob, z_prev (B, d)`` → scalar.
    """
    if not (z.shape == z_glob.shape == z_prev.shape) or z.dim() != 2:
        raise ValueError("z, z_glob and z_prev must all have the same shape (B, d), got "
                         f"{tuple(z.shape)}, {tuple(z_glob.shape)}, {tuple(z_prev.shape)}")
    positive = F.cosine_similarity(z, z_glob, dim=1)  # (B,)
    negative = F.cosine_similarity(z, z_prev, dim=1)  # (B,)
    return info_nce(torch.stack([positive, negative], dim=1), 0, temperature=temperature)
