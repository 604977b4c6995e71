"""The Gaussian mechanism on per-class sums and on public-set representations: clipping bounds each
sample's contribution, and the noise really is N(0, σ²C²)."""

import math

import pytest
import torch

from fedcontrast.algorithms.base import ClassSums
from fedcontrast.privacy import GaussianClassSums, clip_rows, gaussian_public_representations
from fedcontrast.privacy.representations import public_release_history, public_sensitivity


def generator(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def private_sums(num_samples, *, sigma=1.0, clip=1.0, seed=0, num_classes=3, dim=4):
    return GaussianClassSums(num_classes, dim, num_samples, "cpu", noise_multiplier=sigma, clip=clip,
                             generator=generator(seed))


def test_clip_rows_scales_long_rows_to_the_bound_and_keeps_short_ones():
    z = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out = clip_rows(z, 1.0)
    assert torch.allclose(out, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    with pytest.raises(ValueError):
        clip_rows(z, 0.0)


@pytest.mark.parametrize("clip", [0.5, 2.0])
def test_one_sample_changes_one_class_sum_by_at_most_c(clip):
    torch.manual_seed(0)
    z, labels = torch.randn(20, 4) * 10, torch.randint(0, 3, (20,))
    # Same noise (same seed) with and without sample 7: the difference is sample 7's clipped contribution.
    with_it, without = private_sums(21, clip=clip), private_sums(21, clip=clip)
    with_it.add(z, labels, torch.arange(20))
    without.add(torch.cat([z[:7], z[8:]]), torch.cat([labels[:7], labels[8:]]),
                torch.cat([torch.arange(7), torch.arange(8, 20)]))
    (s1, n1), (s0, n0) = with_it.release(), without.release()
    diff = s1 - s0
    assert diff.norm(dim=1)[labels[7]] == pytest.approx(clip, rel=1e-4)  # a long row is clipped exactly to C
    assert diff.norm() <= clip * (1 + 1e-5)
    changed = [c for c in range(3) if diff[c].abs().max() > 1e-5]
    assert changed == [int(labels[7])]
    assert (n1 - n0).tolist() == pytest.approx([1.0 if c == labels[7] else 0.0 for c in range(3)], abs=1e-5)


def test_a_sample_seen_twice_is_counted_once():
    sums = ClassSums(2, 2, 3)
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    sums.add(z, torch.tensor([0, 1]), torch.tensor([0, 1]))
    sums.add(z * 5, torch.tensor([0, 1]), torch.tensor([0, 2]))  # index 0 again: ignored
    s, n = sums.release()
    assert n.tolist() == [1.0, 2.0]
    assert s.tolist() == [[1.0, 0.0], [0.0, 6.0]]


def test_noise_on_class_sums_and_counts_has_variance_sigma2_c2():
    sigma, clip, releases = 1.5, 0.8, 4000
    z, labels = torch.full((6, 4), 0.1), torch.tensor([0, 0, 1, 1, 2, 2])
    plain = ClassSums(3, 4, 6)
    plain.add(z, labels, torch.arange(6))
    true_sums, true_counts = plain.release()
    g = generator(1)
    noises_s, noises_n = [], []
    for _ in range(releases):
        m = GaussianClassSums(3, 4, 6, "cpu", noise_multiplier=sigma, clip=clip, generator=g)
        m.add(z, labels, torch.arange(6))
        s, n = m.release()
        noises_s.append(s - true_sums)
        noises_n.append(n - true_counts)
    ns, nn_ = torch.stack(noises_s).double(), torch.stack(noises_n).double()
    # 48 000 draws: the sample variance is within ~2 % of σ²C² (6 standard errors ≈ 4 %)
    assert ns.var().item() == pytest.approx((sigma * clip) ** 2, rel=0.04)
    assert ns.mean().item() == pytest.approx(0.0, abs=0.03)
    assert nn_.var().item() == pytest.approx(sigma ** 2, rel=0.06)


def test_release_is_reported_to_the_accountant_once():
    calls = []
    m = GaussianClassSums(2, 2, 2, "cpu", noise_multiplier=1.0, clip=1.0, generator=generator(0),
                          on_release=lambda: calls.append(1))
    m.add(torch.ones(2, 2), torch.tensor([0, 1]), torch.arange(2))
    m.release()
    assert calls == [1]


def test_public_representations_noise_is_calibrated_to_the_whole_matrix_sensitivity():
    n, d, sigma = 50, 8, 0.5
    z = torch.randn(n, d) * 3
    out, delta = gaussian_public_representations(z, noise_multiplier=sigma, generator=generator(0))
    assert delta == pytest.approx(2 * math.sqrt(n)) == public_sensitivity(n)
    noise = out - torch.nn.functional.normalize(z, dim=1)
    assert noise.double().std().item() == pytest.approx(sigma * delta, rel=0.05)
    # any two encoders' Z (unit rows) differ by at most Δ in Frobenius norm
    other = torch.nn.functional.normalize(-z, dim=1)
    assert (torch.nn.functional.normalize(z, dim=1) - other).norm().item() <= delta + 1e-5
    assert public_release_history(sigma) == [[0.5, 1.0, 1]]
    with pytest.raises(ValueError):
        gaussian_public_representations(z, noise_multiplier=0.0, generator=generator(0))


def test_site_public_representations_are_normalised_without_dp_and_noised_and_recorded_with_it():
    from fedcontrast.algorithms import SiteContext
    from fedcontrast.config import PrivacyConfig, TrainingConfig
    from fedcontrast.privacy import SitePrivacy, history_of

    z = torch.randn(10, 4) * 5
    site = SiteContext(name="s", data=None, model=None, training=TrainingConfig(), round_num=3, seed=0, device="cpu")
    assert torch.allclose(site.public_representations(z), torch.nn.functional.normalize(z, dim=1))
    site.privacy = SitePrivacy(PrivacyConfig(representations={"noise_multiplier": 0.5}), site.state, round_num=3,
                               noise_seed=0)
    noisy = site.public_representations(z)
    assert not torch.allclose(noisy, torch.nn.functional.normalize(z, dim=1))
    assert history_of(site.state) == [[0.5, 1.0, 1]] and history_of(site.state, 3) == [[0.5, 1.0, 1]]
