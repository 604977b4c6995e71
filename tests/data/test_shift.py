"""Feature shift among sites (each site's scanner) against explicit references."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.config import RunConfig
from fedcontrast.construction import load_splits, partition
from fedcontrast.data.shift import Scanner, blur, scan, scanner_for
from fedcontrast.errors import ConfigError
from fedcontrast.seeds import derive_seed


def test_each_site_has_its_own_fixed_scanner():
    assert scanner_for(3, 0) == scanner_for(3, 0)
    assert len({scanner_for(k, 0) for k in range(10)}) == 10
    assert scanner_for(3, 0) != scanner_for(3, 1)
    for k in range(50):
        s = scanner_for(k, 7)
        assert 0.4 <= s.contrast <= 1.6 and -0.6 <= s.brightness <= 0.6 and 0 <= s.blur <= 1.5 and 0 <= s.noise <= 0.6


def test_contrast_and_brightness_alone_are_an_affine_map():
    x = torch.randn(5, 1, 9, 9)
    out = scan(x, Scanner(contrast=0.7, brightness=-0.2, blur=0.0, noise=0.0), seed=1)
    assert torch.allclose(out, 0.7 * x - 0.2)


def _explicit_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """A 2-D Gaussian over ±⌈3σ⌉ pixels, edges replicated, summed pixel by pixel."""
    radius = max(1, math.ceil(3 * sigma))
    weights = {(dy, dx): math.exp(-(dy * dy + dx * dx) / (2 * sigma * sigma))
               for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1)}
    total = sum(weights.values())
    h, w = image.shape
    out = np.zeros_like(image)
    for y in range(h):
        for x in range(w):
            out[y, x] = sum(wgt * image[min(max(y + dy, 0), h - 1), min(max(x + dx, 0), w - 1)]
                            for (dy, dx), wgt in weights.items()) / total
    return out


@pytest.mark.parametrize("sigma", [0.5, 1.0, 1.4])
def test_blur_is_the_gaussian_convolution(sigma):
    x = torch.randn(2, 2, 7, 8)
    out = blur(x, sigma)
    assert out.shape == x.shape
    for n in range(2):
        for c in range(2):
            assert np.allclose(out[n, c].numpy(), _explicit_blur(x[n, c].numpy().astype(np.float64), sigma), atol=1e-5)
    flat = torch.full((1, 1, 6, 6), 2.5)
    assert torch.allclose(blur(flat, sigma), flat)  # a normalised kernel leaves a flat image alone
    assert torch.equal(blur(x, 0.1), x)  # below 0.3 px: no blur


def test_the_noise_of_an_image_is_fixed_by_its_seed():
    x = torch.zeros(4, 1, 5, 5)
    s = Scanner(1.0, 0.0, 0.0, 0.5)
    assert torch.equal(scan(x, s, seed=3), scan(x, s, seed=3))
    assert not torch.equal(scan(x, s, seed=3), scan(x, s, seed=4))
    assert abs(float(scan(torch.zeros(200, 1, 10, 10), s, seed=0).std()) - 0.5) < 0.01


def test_each_sites_shard_and_its_part_of_the_test_split_pass_through_its_scanner():
    base = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=3, partition="iid",
                     min_samples=5, public_fraction=0.2)
    plain, shifted = load_splits(base), load_splits(base.replace(feature_shift="scanner"))
    assert torch.equal(plain.train.y, shifted.train.y) and torch.equal(plain.test.y, shifted.test.y)
    assert torch.equal(plain.public.x, shifted.public.x)  # the public set is everybody's, unscanned
    own = shifted.site_test
    assert own is not None and sorted(np.concatenate(own)) == list(range(len(plain.test)))
    for k, shard in enumerate(partition(base, plain)):
        scanner = scanner_for(k, base.split_seed)
        index = torch.as_tensor(shard)
        expected = scan(plain.train.x[index], scanner, seed=derive_seed(base.split_seed, k, 1))
        assert torch.equal(shifted.train.x[index], expected)
        mine = torch.as_tensor(own[k])
        expected_test = scan(plain.test.x[mine], scanner, seed=derive_seed(base.split_seed, k, 2))
        assert torch.equal(shifted.test.x[mine], expected_test)


def test_a_simulated_feature_shift_runs_and_scores_each_site_on_its_own_images(tmp_path):
    from fedcontrast.sim.federation import Federation

    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=3, partition="iid",
                       min_samples=5, public_fraction=0.2, feature_shift="scanner", rounds=1,
                       training={"local_epochs": 1})
    federation = Federation(config)
    splits = load_splits(config)
    assert federation.site_tests is not None
    for site in federation.sites:
        assert torch.equal(federation.site_tests[site.index].x.cpu(), splits.test.x[torch.as_tensor(
            splits.site_test[site.index])])
    rows = federation.run_round(1)
    assert any(r["site"] == "global" for r in rows)


@pytest.mark.parametrize("settings, match", [
    ({"feature_shift": "mri"}, "feature_shift must be one of none, scanner"),
    ({"feature_shift": "scanner", "dataset": "fedprox_synthetic", "partition": "natural"}, "has sites of its own"),
])
def test_bad_feature_shifts_are_one_sentence(settings, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**settings)
