"""MOON's model-contrastive loss against an explicit loop over the paper's eq. 3 and closed forms."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.losses import info_nce, moon_contrastive_loss
from tests.losses.reference import cosine


def reference_moon_loss(z, z_glob, z_prev, tau):
    """Li et al. 2021 eq. 3, one sample at a time, in float64 numpy."""
    z, z_glob, z_prev = (np.asarray(a, dtype=np.float64) for a in (z, z_glob, z_prev))
    total = 0.0
    for i in range(len(z)):
        pos = math.exp(cosine(z[i], z_glob[i]) / tau)
        neg = math.exp(cosine(z[i], z_prev[i]) / tau)
        total += -math.log(pos / (pos + neg))
    return total / len(z)


@pytest.mark.parametrize("batch", [1, 3, 16, 64])
@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0])
def test_matches_explicit_loop(batch, tau):
    g = torch.Generator().manual_seed(batch)
    z, zg, zp = (torch.randn(batch, 8, generator=g, dtype=torch.float64) for _ in range(3))
    got = moon_contrastive_loss(z, zg, zp, temperature=tau).item()
    assert got == pytest.approx(reference_moon_loss(z, zg, zp, tau), rel=1e-10)


def test_equal_references_give_log_two():
    # sim(z, z_glob) == sim(z, z_prev): both terms equal, the softmax is 1/2 (MOON's first round).
    z = torch.randn(5, 4)
    zg = torch.randn(5, 4)
    assert moon_contrastive_loss(z, zg, zg.clone(), temperature=0.5).item() == pytest.approx(math.log(2), abs=1e-6)


def test_closed_form_aligned_and_opposite():
    # z = z_glob (cos 1) and z_prev = -z (cos -1): loss = -log(e^{1/τ} / (e^{1/τ} + e^{-1/τ})).
    tau = 0.5
    z = torch.tensor([[1.0, 2.0, -1.0]])
    expected = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(-1 / tau)))
    assert moon_contrastive_loss(z, 3 * z, -z, temperature=tau).item() == pytest.approx(expected, rel=1e-5)  # float32


def test_gradient_pulls_toward_global_and_away_from_previous():
    z = torch.randn(4, 6, requires_grad=True)
    zg, zp = torch.randn(4, 6), torch.randn(4, 6)
    before = moon_contrastive_loss(z, zg, zp, temperature=0.5)
    before.backward()
    with torch.no_grad():
        z2 = z - 0.1 * z.grad
    assert moon_contrastive_loss(z2, zg, zp, temperature=0.5) < before


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), float("inf"), 1.0e-320, 1e-5])
def test_bad_temperature_raises(tau):
    z = torch.randn(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        moon_contrastive_loss(z, z, z, temperature=tau)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="same shape"):
        moon_contrastive_loss(torch.randn(2, 3), torch.randn(2, 3), torch.randn(3, 3), temperature=0.5)


def test_info_nce_uniform_similarities_closed_form():
    # Equal similarities over M columns: -log(1/M) whatever the temperature.
    sims = torch.zeros(7, 5)
    assert info_nce(sims, 0, temperature=0.3).item() == pytest.approx(math.log(5), rel=1e-6)


@pytest.mark.parametrize("batch", [2, 33])
def test_precomputed_difference_matches_explicit_loop(batch):
    from fedcontrast.losses import moon_loss_from_difference, moon_reference_difference

    g = torch.Generator().manual_seed(100 + batch)
    z, zg, zp = (torch.randn(batch, 16, generator=g, dtype=torch.float64) for _ in range(3))
    diff = moon_reference_difference(zg, zp)
    got = moon_loss_from_difference(z, diff, temperature=0.5).item()
    assert got == pytest.approx(reference_moon_loss(z, zg, zp, 0.5), rel=1e-10)


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_fused_gradient_matches_autograd_of_the_paper_formula(batch):
    # The fused backward is hand-derived: check it against autograd through eq. 3 written plainly.
    g = torch.Generator().manual_seed(7 + batch)
    z, zg, zp = (torch.randn(batch, 12, generator=g, dtype=torch.float64) for _ in range(3))
    z1 = z.clone().requires_grad_()
    moon_contrastive_loss(z1, zg, zp, temperature=0.3).backward()
    z2 = z.clone().requires_grad_()
    pos = torch.nn.functional.cosine_similarity(z2, zg, dim=1) / 0.3
    neg = torch.nn.functional.cosine_similarity(z2, zp, dim=1) / 0.3
    (-(pos - torch.logsumexp(torch.stack([pos, neg], 1), 1))).mean().backward()
    assert torch.allclose(z1.grad, z2.grad, rtol=1e-9, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda t: moon_contrastive_loss(t, zg, zp, temperature=0.3), (z.clone().requires_grad_(),))
