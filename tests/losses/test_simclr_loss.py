"""SimCLR's NT-Xent against an explicit per-anchor loop over the paper's eq. 1 and closed forms."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.losses import nt_xent
from tests.losses.reference import cosine


def reference_nt_xent(z1, z2, tau):
    """Chen et al. 2020 eq. 1 / Algorithm 1, one anchor at a time, in float64 numpy."""
    z = np.concatenate([np.asarray(z1, dtype=np.float64), np.asarray(z2, dtype=np.float64)])
    n = len(z1)
    total = 0.0
    for i in range(2 * n):
        positive = (i + n) % (2 * n)
        denominator = sum(math.exp(cosine(z[i], z[k]) / tau) for k in range(2 * n) if k != i)
        total += -math.log(math.exp(cosine(z[i], z[positive]) / tau) / denominator)
    return total / (2 * n)


@pytest.mark.parametrize("batch", [1, 2, 5, 32])
@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0])
def test_matches_explicit_loop(batch, tau):
    g = torch.Generator().manual_seed(batch)
    z1, z2 = (torch.randn(batch, 8, generator=g, dtype=torch.float64) for _ in range(2))
    assert nt_xent(z1, z2, temperature=tau).item() == pytest.approx(reference_nt_xent(z1, z2, tau), rel=1e-10)


def test_float32_matches_loop():
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    assert nt_xent(z1, z2, temperature=0.2).item() == pytest.approx(reference_nt_xent(z1, z2, 0.2), rel=1e-5)


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_all_samples_identical_gives_log_of_negatives_plus_one(batch):
    # Every cosine is 1: each anchor's softmax is uniform over its 2B − 1 candidates, at any τ.
    z = torch.tensor([[1.0, -2.0, 0.5]]).repeat(batch, 1)
    for tau in (0.1, 0.5, 2.0):
        assert nt_xent(z, 3 * z, temperature=tau).item() == pytest.approx(math.log(2 * batch - 1), rel=1e-6)


@pytest.mark.parametrize("batch", [2, 4])
def test_orthogonal_samples_identical_views_closed_form(batch):
    # Views equal, samples orthonormal: positive cos 1, the 2B − 2 negatives cos 0.
    tau = 0.5
    z = torch.eye(batch, 6)
    expected = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + 2 * batch - 2))
    assert nt_xent(z, z.clone(), temperature=tau).item() == pytest.approx(expected, rel=1e-6)


def test_two_sample_hand_case():
    # B = 2, views of sample 0: e1, e1; of sample 1: e2, −e2. τ = 1.
    # Anchors of sample 0: positive cos 1, negatives e2 (0), −e2 (0) → −log(e/(e+2)), twice.
    # Anchors of sample 1: positive cos −1, negatives e1, e1 (0, 0) → −log(e⁻¹/(e⁻¹+2)), twice.
    z1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z2 = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    e = math.e
    expected = 0.5 * (-math.log(e / (e + 2)) - math.log((1 / e) / (1 / e + 2)))
    assert nt_xent(z1, z2, temperature=1.0).item() == pytest.approx(expected, rel=1e-6)


def test_single_sample_has_no_negatives_and_zero_loss():
    assert nt_xent(torch.randn(1, 4), torch.randn(1, 4), temperature=0.5).item() == pytest.approx(0.0, abs=1e-7)


def test_invariant_to_the_scale_of_the_inputs():
    g = torch.Generator().manual_seed(3)
    z1, z2 = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    assert nt_xent(10 * z1, 0.1 * z2).item() == pytest.approx(nt_xent(z1, z2).item(), rel=1e-5)


def test_default_temperature_is_one_half():
    g = torch.Generator().manual_seed(4)
    z1, z2 = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g, dtype=torch.float64)
    assert nt_xent(z1, z2).item() == pytest.approx(reference_nt_xent(z1, z2, 0.5), rel=1e-10)


def test_lower_temperature_sharpens_well_separated_views():
    # Aligned views, orthogonal samples: the loss −log(e^{1/τ} / (e^{1/τ} + 2B − 2)) falls as τ falls.
    z = torch.eye(4, 8)
    losses = [nt_xent(z, z, temperature=tau).item() for tau in (2.0, 1.0, 0.5, 0.1)]
    assert losses == sorted(losses, reverse=True)
    assert losses[-1] < 1e-3


def test_gradient_reaches_both_views_and_descent_lowers_the_loss():
    g = torch.Generator().manual_seed(5)
    z1 = torch.randn(8, 6, generator=g, requires_grad=True)
    z2 = torch.randn(8, 6, generator=g, requires_grad=True)
    loss = nt_xent(z1, z2, temperature=0.5)
    loss.backward()
    assert z1.grad is not None and z1.grad.abs().sum() > 0
    assert z2.grad is not None and z2.grad.abs().sum() > 0
    with torch.no_grad():
        assert nt_xent(z1 - 0.1 * z1.grad, z2 - 0.1 * z2.grad, temperature=0.5) < loss


def test_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(6)
    z1 = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    z2 = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: nt_xent(a, b, temperature=0.3), (z1, z2))


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), float("inf"), 1.0e-320, 1e-5])
def test_bad_temperature_raises(tau):
    z = torch.randn(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        nt_xent(z, z, temperature=tau)


@pytest.mark.parametrize("shapes", [((2, 3), (3, 3)), ((2, 3), (2, 4)), ((6,), (6,))])
def test_shape_mismatch_raises(shapes):
    with pytest.raises(ValueError, match="same shape"):
        nt_xent(torch.randn(*shapes[0]), torch.randn(*shapes[1]))
