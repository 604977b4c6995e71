"""FLESD's ensemble similarity distillation (Shi et al. 2022, "Federated Representation Learning via
Ensemble Similarity Distillation"; docs/algorithms.md#flesd).

Each client answers with the cosine similarity matrix ``M_k`` of its representations of the public
set P (N samples). The server averages them, ``M = (1/|S|) Σ_k M_k / τ_T``, and trains its encoder so
that, for a query ``i`` and the anchors ``j`` of a momentum queue, the student's similarity
distribution ``p_S(j|i) = softmax_j(z_i · z̄_j / τ_S)`` matches ``p_T(j|i) = softmax_j(M_ij)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .contrastive import check_temperature


def similarity_matrix(z: torch.Tensor) -> torch.Tensor:
    """Cosine similarity matrix ``normalize(z) · normalize(z)ᵀ`` of one client's representations.

    Shape: ``z (N, d)`` → ``(N, N)``, in ``z``'s dtype.
    """
    if z.dim() != 2:
        raise ValueError(f"similarity_matrix needs representations of shape (N, d), got {tuple(z.shape)}")
    u = F.normalize(z, dim=1)
    return u @ u.T


def ensemble_similarity(matrices: Sequence[torch.Tensor], *, target_temperature: float) -> torch.Tensor:
    """The ensembled target logits ``M = (1/|S|) Σ_k M_k / τ_T`` over the clients that answered.

    Accumulated in float64 (the uploads may be fp16) and returned as float32 on the first matrix's
    device. Shape: ``|S|`` matrices ``(N, N)`` → ``(N, N)``.
    """
    check_temperature(target_temperature)
    if len(matrices) == 0:
        raise ValueError("ensemble_similarity needs at least one similarity matrix, got none")
    shape = tuple(matrices[0].shape)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"similarity matrices must be square (N, N), got {shape}")
    for k, m in enumerate(matrices):
        if tuple(m.shape) != shape:
            raise ValueError(f"all similarity matrices must have the same shape {shape}, matrix {k} has "
                             f"{tuple(m.shape)}")
    device = matrices[0].device
    total = torch.zeros(shape, dtype=torch.float64, device=device)
    for m in matrices:
        total += m.to(device=device, dtype=torch.float64)
    return (total / (len(matrices) * target_temperature)).to(torch.float32)


def esd_loss(query: torch.Tensor, query_index: torch.Tensor, anchors: torch.Tensor, anchor_index: torch.Tensor,
             target: torch.Tensor, *, student_temperature: float) -> torch.Tensor:
    """Ensemble similarity distillation loss: ``mean_i KL(p_T(·|i) ‖ p_S(·|i))``.

    For query ``i`` (public sample ``query_index[i]``) the anchors are the queue entries ``j`` with
    ``anchor_index[j] ≠ query_index[i]`` (every copy of the query's own sample is left out, also
    duplicates in the queue), and

    - ``p_T(j|i) = softmax_j target[query_index[i], anchor_index[j]]`` (``target`` is already ``M / τ_T``,
      see :func:`ensemble_similarity`),
    - ``p_S(j|i) = softmax_j (q_i · a_j / τ_S)`` with ``q``, ``a`` the L2-normalised query and anchor rows,
    - ``KL = Σ_j p_T (log p_T − log p_S)``.

    The mean is over the queries with at least one anchor left; with none (e.g. an empty queue) the
    loss is a zero that still carries a (zero) gradient to ``query``. ``anchors`` (momentum-encoder
    outputs) and ``target`` are constants: no gradient reaches them. Indices are int64 positions in P
    and must lie in ``[0, N)``.

    Shapes: ``query (B, d)``, ``query_index (B,)``, ``anchors (Q, d)``, ``anchor_index (Q,)``,
    ``target (N, N)`` → scalar in ``query``'s dtype.
    """
    check_temperature(student_temperature)
    if query.dim() != 2 or anchors.dim() != 2 or query.shape[1] != anchors.shape[1]:
        raise ValueError(f"query (B, d) and anchors (Q, d) must be 2-D with the same d, got "
                         f"{tuple(query.shape)} and {tuple(anchors.shape)}")
    if query_index.shape != (query.shape[0],) or anchor_index.shape != (anchors.shape[0],):
        raise ValueError(f"query_index and anchor_index must hold one index per row, got shapes "
                         f"{tuple(query_index.shape)} for {query.shape[0]} queries and "
                         f"{tuple(anchor_index.shape)} for {anchors.shape[0]} anchors")
    if query_index.dtype.is_floating_point or anchor_index.dtype.is_floating_point:
        raise ValueError(f"query_index and anchor_index must be integer tensors, got {query_index.dtype} and "
                         f"{anchor_index.dtype}")
    if target.dim() != 2 or target.shape[0] != target.shape[1]:
        raise ValueError(f"target must be a square (N, N) matrix, got {tuple(target.shape)}")

    query_index = query_index.to(device=query.device, dtype=torch.long)
    anchor_index = anchor_index.to(device=query.device, dtype=torch.long)
    keep = query_index[:, None] != anchor_index[None, :]  # (B, Q) anchors of other public samples
    has_anchor = keep.any(dim=1)  # (B,)
    # A row with no anchor left would be log_softmax of all −inf (NaN): compute it unmasked and drop
    # its term below. No boolean row selection, so no host-device synchronisation on a GPU.
    keep = keep | ~has_anchor[:, None]

    q = F.normalize(query, dim=1)  # (B, d)
    a = F.normalize(anchors.detach().to(query.dtype), dim=1)  # (Q, d) constants
    student = (q @ a.T) / student_temperature  # (B, Q)
    rows, cols = query_index.to(target.device), anchor_index.to(target.device)
    teacher = target.detach()[rows[:, None], cols[None, :]].to(device=query.device, dtype=query.dtype)  # (B, Q)

    log_p_s = F.log_softmax(student.masked_fill(~keep, float("-inf")), dim=1)
    log_p_t = F.log_softmax(teacher.masked_fill(~keep, float("-inf")), dim=1)
    p_t = log_p_t.exp()  # exactly 0 on masked entries
    # Masked entries: p_T = 0 and both logs −inf; zero the logs there so 0 · (−inf + inf) never
    # appears, in the forward or the backward pass.
    log_ratio = (log_p_t - log_p_s).masked_fill(~keep, 0.0)
    kl = (p_t * log_ratio).sum(dim=1) * has_anchor  # (B,), 0 for queries without anchors
    return kl.sum() / has_anchor.sum().clamp_min(1)
