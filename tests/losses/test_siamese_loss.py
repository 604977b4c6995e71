"""FedSiam-DA's L_stop and L_hist against explicit per-sample loops and hand-computed cases."""

import math

import pytest
import torch

from fedcontrast.losses.siamese import history_loss, negative_cosine, stop_gradient_loss


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_negative_cosine_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    p, z = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64)
    expected = -sum(_cos(p[b].tolist(), z[b].tolist()) for b in range(7)) / 7
    assert negative_cosine(p, z).item() == pytest.approx(expected, abs=1e-12)


def test_stop_loss_matches_paper_eq7_loop():
    g = torch.Generator().manual_seed(1)
    pg, zg, pl, zl = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(4))
    expected = sum(0.5 * -_cos(pg[b].tolist(), zl[b].tolist()) + 0.5 * -_cos(pl[b].tolist(), zg[b].tolist())
                   for b in range(6)) / 6
    assert stop_gradient_loss(pg, zg, pl, zl).item() == pytest.approx(expected, abs=1e-12)


def test_stop_loss_hand_case_and_gradient_paths():
    # p_global aligned with z_local (D = −1), p_local opposite z_global (D = +1): L = ½(−1) + ½(1) = 0.
    zl = torch.tensor([[1.0, 2.0]], requires_grad=True)
    zg = torch.tensor([[0.0, 3.0]], requires_grad=True)
    pg = torch.tensor([[2.0, 4.0]], requires_grad=True)
    pl = torch.tensor([[0.0, -1.0]], requires_grad=True)
    loss = stop_gradient_loss(pg, zg, pl, zl)
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    # The representations are stop-gradient constants: only each side's prediction gets gradients.
    assert zl.grad is None and zg.grad is None
    assert pg.grad is not None and pl.grad is not None
    assert pl.grad.abs().sum() == 0  # p_local is at the maximum of D (exactly opposite): zero gradient
    assert torch.allclose(pg.grad, torch.zeros_like(pg.grad), atol=1e-7)  # aligned: minimum, zero gradient
    # Off the optimum the gradient is non-zero.
    pg2 = torch.tensor([[1.0, 0.0]], requires_grad=True)
    stop_gradient_loss(pg2, zg, pl, zl).backward()
    assert pg2.grad.abs().sum() > 0


def test_history_loss_closed_forms_and_stop_gradient():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    prev = torch.tensor([[3.0, 0.0], [0.0, -1.0]], requires_grad=True)  # aligned, opposite
    loss = history_loss(prev, z)
    assert loss.item() == pytest.approx((1.0 - 1.0) / 2)
    loss.backward()
    assert prev.grad is None and z.grad is not None
    assert history_loss(z.detach(), z.detach()).item() == pytest.approx(1.0)


def test_history_loss_matches_a_loop_and_rejects_shape_mismatch():
    g = torch.Generator().manual_seed(2)
    prev, z = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)
    expected = sum(_cos(prev[b].tolist(), z[b].tolist()) for b in range(5)) / 5
    assert history_loss(prev, z).item() == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="matching shapes"):
        history_loss(prev, z[:, :2])
