"""SimCLR's NT-Xent loss (Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual
Representations", eq. 1 and Algorithm 1): FLESD's local self-supervised objective."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contrastive import check_temperature


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = 0.5) -> torch.Tensor:
    """Normalised temperature-scaled cross-entropy, averaged over the ``2B`` anchors.

    With ``u`` the L2-normalised rows of ``[z1; z2]`` and ``s_ij = u_i · u_j``, anchor ``i`` (a view of
    sample ``b``) has as positive ``p(i)``, the other view of ``b``, and as negatives the ``2B − 2``
    views of the other samples:
    ``ℓ_i = −log( e^{s_{i,p(i)}/τ} / Σ_{k ≠ i} e^{s_ik/τ} )`` and the loss is ``mean_i ℓ_i`` (the paper's
    ``1/(2N) Σ_k [ℓ(2k−1, 2k) + ℓ(2k, 2k−1)]``). With ``B = 1`` there are no negatives and the loss is 0.

    Shape: ``z1, z2 (B, d)`` → scalar. Both inputs receive gradients.
    """
    check_temperature(temperature)
    if z1.dim() != 2 or z1.shape != z2.shape:
        raise ValueError(f"nt_xent needs two views of the same shape (B, d), got {tuple(z1.shape)} and "
                         f"{tuple(z2.shape)}")
    batch = z1.shape[0]
    if batch == 0:
        raise ValueError("nt_xent needs a batch of at least one sample, got an empty batch")
    u = F.normalize(torch.cat([z1, z2]), dim=1)  # (2B, d)
    logits = (u @ u.T) / temperature  # (2B, 2B)
    self_mask = torch.eye(2 * batch, dtype=torch.bool, device=u.device)
    logits = logits.masked_fill(self_mask, float("-inf"))  # an anchor is never its own negative
    arange = torch.arange(batch, device=u.device)
    positives = torch.cat([arange + batch, arange])  # (2B,) the other view of the same sample
    return F.cross_entropy(logits, positives)
