"""FedSiam-DA's local losses (Wang et al., FedSiam-DA, eqs. 6–11; docs/algorithms.md#fedsiam-da).

``D(p, z) = −sim(p, z)`` is SimSiam's negative cosine similarity. Every function returns the mean
over the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def negative_cosine(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``D(p, z) = −mean_b cos(p_b, z_b)``. Shapes: ``(B, d), (B, d) → ()``."""
    if p.shape != z.shape:
        raise ValueError(f"negative_cosine needs matching shapes, got {tuple(p.shape)} and {tuple(z.shape)}")
    return -F.cosine_similarity(p, z, dim=1).mean()


def stop_gradient_loss(p_global: torch.Tensor, z_global: torch.Tensor,
                       p_local: torch.Tensor, z_local: torch.Tensor) -> torch.Tensor:
    """``L_stop = ½ D(h_f'(z_f'), sg(z_k)) + ½ D(h_k(z_k), sg(z_f'))`` (paper eq. 7).

    ``p_global = h_f'(z_f')`` is the global copy's prediction, ``p_local = h_k(z_k)`` the local
    model's. Each copy gets gradients only through its own prediction branch: the other side's
    representation is a constant. Shapes: four ``(B, d)`` tensors → ``()``.
    """
    return 0.5 * negative_cosine(p_global, z_local.detach()) + 0.5 * negative_cosine(p_local, z_global.detach())


def history_loss(z_previous: torch.Tensor, z_local: torch.Tensor) -> torch.Tensor:
    """``L_hist = sim(sg(z_k^prev), z_k)`` (paper eq. 10): minimising it pushes the local model's
    representation away from the one it had at the previous local update (epoch).
    Shapes: ``(B, d), (B, d) → ()``."""
    if z_previous.shape != z_local.shape:
        raise ValueError(f"history_loss needs matching shapes, got {tuple(z_previous.shape)} and "
                         f"{tuple(z_local.shape)}")
    return F.cosine_similarity(z_previous.detach(), z_local, dim=1).mean()
