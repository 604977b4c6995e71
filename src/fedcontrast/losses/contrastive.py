"""Contrastive losses as pure functions of tensors.

The shared piece is :func:`info_nce`: cross-entropy over similarity logits where one column is the
positive. MOON's model-contrastive loss is InfoNCE with one positive (the global model's
representation) and one negative (the previous local model's).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

MIN_TEMPERATURE = 1e-4  # similarities in [-1, 1] are divided by τ: far below this, float32 logits overflow


def check_temperature(temperature: float) -> None:
    """Raise ``ValueError`` unless ``temperature`` is a finite number ≥ :data:`MIN_TEMPERATURE` (a
    temperature of 1e-320 passed "> 0" and ended every loss in NaN, which was then blamed on a site)."""
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and math.isfinite(temperature)
            and temperature >= MIN_TEMPERATURE):
        raise ValueError(f"temperature must be a finite number ≥ {MIN_TEMPERATURE:g} (similarities are divided by it; "
                         f"smaller ones overflow), got {temperature!r}")


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


def moon_reference_difference(z_glob: torch.Tensor, z_prev: torch.Tensor) -> torch.Tensor:
    """``normalize(z_prev) − normalize(z_glob)``: everything MOON's loss needs from the frozen models.

    Shape: ``(B, d), (B, d) → (B, d)``. Computing it once per round (per sample) is what makes
    cached references cheap.
    """
    return F.normalize(z_prev, dim=1) - F.normalize(z_glob, dim=1)


class _MoonContext(Protocol):
    """What the fused MOON loss keeps on autograd's ``ctx`` between its forward and backward."""

    temperature: float
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class _MoonLossFromDifference(torch.autograd.Function):
    """``mean_i softplus(u_i · d_i / τ)`` with ``u = z/‖z‖``, forward and analytic backward fused.

    Backward: with ``g_i = sigmoid(s_i) / (B τ)``, ``∂L/∂z_i = g_i (d_i − (u_i·d_i) u_i) / ‖z_i‖``.
    A handful of kernels instead of the ~20 that autograd records for the same expression, which
    matters on the CPU where MOON's step is dominated by per-op overhead.
    """

    @staticmethod
    def forward(ctx: _MoonContext, z: torch.Tensor, d: torch.Tensor, temperature: float) -> torch.Tensor:
        norm = z.norm(dim=1, keepdim=True).clamp_min(1e-12)  # (B, 1)
        u = z / norm  # (B, d)
        ud = (u * d).sum(1, keepdim=True)  # (B, 1)
        s = ud / temperature
        ctx.save_for_backward(u, d, ud, norm, s)
        ctx.temperature = temperature
        return F.softplus(s).mean()

    @staticmethod
    def backward(ctx: _MoonContext, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        u, d, ud, norm, s = ctx.saved_tensors
        g = torch.sigmoid(s) * (grad_out / (s.shape[0] * ctx.temperature)) / norm  # (B, 1)
        grad_z = g * (d - ud * u) if ctx.needs_input_grad[0] else None
        return grad_z, None, None


def moon_loss_from_difference(z: torch.Tensor, reference_difference: torch.Tensor, *,
                              temperature: float) -> torch.Tensor:
    """MOON's loss given :func:`moon_reference_difference` of the frozen representations.

    With ``a = sim(z, z_glob)/τ`` and ``b = sim(z, z_prev)/τ``,
    ``−log(e^a / (e^a + e^b)) = softplus(b − a)`` and ``b − a = normalize(z) · (n(z_prev) − n(z_glob)) / τ``:
    one dot product per sample instead of two cosine similarities and a log-softmax.
    ``reference_difference`` carries no gradient (it comes from frozen models).
    Shape: ``z (B, d), reference_difference (B, d)`` → scalar.
    """
    check_temperature(temperature)
    if z.shape != reference_difference.shape or z.dim() != 2:
        raise ValueError(f"z and reference_difference must have the same shape (B, d), got "
                         f"{tuple(z.shape)} and {tuple(reference_difference.shape)}")
    # torch leaves Function.apply unannotated: here it returns the scalar loss
    loss: torch.Tensor = _MoonLossFromDifference.apply(  # type: ignore[no-untyped-call]
        z, reference_difference.detach(), float(temperature))
    return loss


def moon_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, *,
                          temperature: float = 0.5) -> torch.Tensor:
    """MOON's model-contrastive loss (Li et al. 2021, eq. 3), averaged over the batch.

    ``l_con = −log( e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ}) )`` with
    ``sim`` the cosine similarity. ``z_glob`` and ``z_prev`` come from frozen models and should carry
    no gradient. Computed as :func:`moon_loss_from_difference` (an exact rewriting, see there).
    Shape: ``z, z_glob, z_prev (B, d)`` → scalar.
    """
    if not (z.shape == z_glob.shape == z_prev.shape) or z.dim() != 2:
        raise ValueError("z, z_glob and z_prev must all have the same shape (B, d), got "
                         f"{tuple(z.shape)}, {tuple(z_glob.shape)}, {tuple(z_prev.shape)}")
    return moon_loss_from_difference(z, moon_reference_difference(z_glob, z_prev), temperature=temperature)


def global_class_contrastive_loss(z: torch.Tensor, labels: torch.Tensor, class_reps: torch.Tensor,
                                  present: torch.Tensor, *, temperature: float = 0.5) -> torch.Tensor:
    """FedSSC's ``l_glob`` (Hu et al. 2023, eq. 3): supervised contrast against shared class representations.

    ``l_glob(i) = −log( e^{sim(z_i, s^{y_i})/τ} / Σ_{c present} e^{sim(z_i, s^c)/τ} )``, averaged over the
    samples whose own class is present. Classes without a shared representation (``present[c] == 0``)
    are left out of the sum; with none present, or no sample of a present class, the loss is 0.
    Shapes: ``z (B, d)``, ``labels (B,)``, ``class_reps (C, d)``, ``present (C,)`` → scalar.
    """
    check_temperature(temperature)
    if z.dim() != 2 or class_reps.dim() != 2 or z.shape[1] != class_reps.shape[1]:
        raise ValueError(f"z (B, d) and class_reps (C, d) must share d, got {tuple(z.shape)} and "
                         f"{tuple(class_reps.shape)}")
    mask = present.to(device=z.device, dtype=torch.bool)
    labels = labels.to(z.device)
    usable = mask[labels]  # (B,) samples whose class has a representation
    if not bool(usable.any()):
        return z.sum() * 0.0  # keeps the graph: a zero term, zero gradient
    sims = F.normalize(z[usable], dim=1) @ F.normalize(class_reps.to(z.device), dim=1).T / temperature  # (B', C)
    sims = sims.masked_fill(~mask, float("-inf"))
    return F.cross_entropy(sims, labels[usable])
