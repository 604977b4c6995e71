"""FedPCL's prototype-contrastive loss (Tan et al., NeurIPS 2022, eqs. 8–10; docs/algorithms.md#fedpcl)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contrastive import check_temperature


def prototype_contrastive_loss(z: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor,
                               present: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """``−log softmax_c(z·P^c/τ)[y]``, the softmax over the classes that have a prototype.

    Similarity is the inner product (the paper's choice; ``z`` is normalised, prototypes are means
    of normalised vectors). Samples whose class has no prototype are left out; none left gives 0.
    Shapes: ``z (B, d)``, ``labels (B,)``, ``prototypes (C, d)``, ``present (C,)`` → scalar.
    """
    check_temperature(temperature)
    mask = present.to(device=z.device, dtype=torch.bool)
    labels = labels.to(z.device)
    usable = mask[labels]
    if not bool(usable.any()):
        return z.sum() * 0.0
    logits = (z[usable] @ prototypes.to(z.device).T / temperature).masked_fill(~mask, float("-inf"))  # (B', C)
    return F.cross_entropy(logits, labels[usable])


def fedpcl_loss(z: torch.Tensor, labels: torch.Tensor, global_prototypes: torch.Tensor, present: torch.Tensor,
                local_sets: torch.Tensor, *, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L_g, L_p)``: the loss against the global prototypes, and its mean over the received local
    prototype sets ``local_sets (K', C, d)`` (every site's set, filled with global prototypes)."""
    l_g = prototype_contrastive_loss(z, labels, global_prototypes, present, temperature=temperature)
    l_p = torch.stack([prototype_contrastive_loss(z, labels, p, present, temperature=temperature)
                       for p in local_sets]).mean() if len(local_sets) else z.sum() * 0.0
    return l_g, l_p
