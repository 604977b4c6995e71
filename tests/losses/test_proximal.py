"""FedProx's proximal term against a loop over every scalar weight and a hand-computed case."""

import pytest
import torch

from fedcontrast.losses import proximal_term


def test_hand_computed():
    # μ/2 · ((1-0)² + (2-0)² + (3-1)²) = 0.25 · 9 with μ = 0.5
    w = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    g = [torch.tensor([0.0, 0.0]), torch.tensor([1.0])]
    assert proximal_term(w, g, mu=0.5).item() == pytest.approx(2.25)


@pytest.mark.parametrize("mu", [0.0, 0.01, 1.0])
def test_matches_scalar_loop(mu):
    gen = torch.Generator().manual_seed(0)
    w = [torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    g = [torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)]
    expected = 0.0
    for a, b in zip(w, g):
        for x, y in zip(a.flatten().tolist(), b.flatten().tolist()):
            expected += (x - y) ** 2
    assert proximal_term(w, g, mu=mu).item() == pytest.approx(mu / 2 * expected, rel=1e-12)


def test_gradient_is_mu_times_difference():
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    g = torch.tensor([0.5, 0.5])
    proximal_term([w], [g], mu=0.2).backward()
    assert torch.allclose(w.grad, 0.2 * (w.detach() - g))


def test_negative_mu_raises():
    with pytest.raises(ValueError, match="mu"):
        proximal_term([torch.zeros(1)], [torch.zeros(1)], mu=-1)
