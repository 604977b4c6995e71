"""SimCLR views: reproducible, per-sample random, and geometrically what the settings say."""

import math
import time

import pytest
import torch

from fedcontrast.data.views import ViewConfig, simclr_views

IDENTITY = dict(crop_scale=(1.0, 1.0), max_shift=0.0, jitter=0.0, noise_std=0.0)


def _batch(seed=0, shape=(8, 3, 16, 16), dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _ramps(batch, size):
    """Channel 0 holds each pixel centre's x in affine_grid's [−1, 1] coordinates, channel 1 its y."""
    centres = (2 * torch.arange(size, dtype=torch.float64) + 1) / size - 1  # (S,)
    x = centres.view(1, 1, 1, size).expand(batch, 1, size, size)
    y = centres.view(1, 1, size, 1).expand(batch, 1, size, size)
    return torch.cat([x, y], dim=1).contiguous(), centres


def _crop_geometry(view, centres, inner=None):
    """Per sample: the crop's half-width w, half-height h and centre (cx, cy) read off sampled ramps.

    Bilinear sampling reproduces a linear ramp exactly away from the image border, so the interior
    output pixels hold ``w·x_o + cx`` (channel 0) and ``h·y_o + cy`` (channel 1).
    """
    inner = inner or slice(1, len(centres) - 1)  # pixels whose samples stay inside the image
    xs = view[:, 0, len(centres) // 2, inner]  # (B, S-2) along a row
    ys = view[:, 1, inner, len(centres) // 2]  # (B, S-2) along a column
    c = centres[inner]
    w = (xs[:, -1] - xs[:, 0]) / (c[-1] - c[0])
    h = (ys[:, -1] - ys[:, 0]) / (c[-1] - c[0])
    cx = (xs - w[:, None] * c).mean(1)
    cy = (ys - h[:, None] * c).mean(1)
    return w, h, cx, cy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shapes_and_dtype_preserved(dtype):
    x = _batch(dtype=dtype)
    v1, v2 = simclr_views(x, _gen(0))
    assert v1.shape == v2.shape == x.shape
    assert v1.dtype == v2.dtype == dtype
    assert torch.isfinite(v1).all() and torch.isfinite(v2).all()


def test_same_seed_same_views_other_seed_other_views():
    x = _batch()
    a1, a2 = simclr_views(x, _gen(1), noise_std=0.1, flip=True)
    b1, b2 = simclr_views(x, _gen(1), noise_std=0.1, flip=True)
    c1, _ = simclr_views(x, _gen(2), noise_std=0.1, flip=True)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert not torch.allclose(a1, c1)


def test_generator_state_advances_between_calls():
    x, g = _batch(), _gen(3)
    first, _ = simclr_views(x, g)
    second, _ = simclr_views(x, g)
    assert not torch.allclose(first, second)


def test_the_two_views_differ():
    x = _batch()
    v1, v2 = simclr_views(x, _gen(4))
    assert (v1 - v2).abs().amax(dim=(1, 2, 3)).min() > 1e-3  # every sample, not just some


def test_identity_settings_reproduce_the_input():
    x = _batch(5)
    v1, v2 = simclr_views(x, _gen(5), **IDENTITY)
    assert torch.allclose(v1, x, atol=1e-5) and torch.allclose(v2, x, atol=1e-5)


def test_identity_with_flip_gives_the_image_or_its_mirror_both_occurring():
    x = _batch(6, shape=(64, 1, 8, 8))
    v, _ = simclr_views(x, _gen(6), flip=True, **IDENTITY)
    same = (v - x).abs().amax(dim=(1, 2, 3)) < 1e-5
    mirrored = (v - x.flip(-1)).abs().amax(dim=(1, 2, 3)) < 1e-5
    assert bool((same | mirrored).all())
    assert 10 < int(mirrored.sum()) < 54  # about half of 64


def test_crop_area_ratio_and_position_follow_the_settings_per_sample():
    x, centres = _ramps(64, 32)
    v, _ = simclr_views(x, _gen(7), crop_scale=(0.4, 0.9), max_shift=0.0, jitter=0.0)
    w, h, cx, cy = _crop_geometry(v, centres)
    area, ratio = w * h, w / h
    assert bool(((area > 0.4 - 1e-9) & (area < 0.9 + 1e-9)).all())
    assert bool(((ratio > 3 / 4 - 1e-9) & (ratio < 4 / 3 + 1e-9)).all())
    assert bool((cx.abs() + w <= 1 + 1e-9).all()) and bool((cy.abs() + h <= 1 + 1e-9).all())  # crop inside
    # Per-sample parameters: the 64 crops are all different, and spread over the range.
    assert len(torch.unique(area.round(decimals=6))) == 64
    assert area.max() - area.min() > 0.3


def test_shift_moves_the_crop_by_at_most_max_shift():
    x, centres = _ramps(64, 32)
    v, _ = simclr_views(x, _gen(8), crop_scale=(1.0, 1.0), max_shift=0.1, jitter=0.0)
    w, h, cx, cy = _crop_geometry(v, centres, inner=slice(8, 24))  # the shifted border repeats: look inside
    assert torch.allclose(w, torch.ones_like(w)) and torch.allclose(h, torch.ones_like(h))
    # A shift of s of the side is 2s in [−1, 1] coordinates.
    assert bool((cx.abs() <= 0.2 + 1e-9).all()) and bool((cy.abs() <= 0.2 + 1e-9).all())
    assert cx.abs().max() > 0.1 and cy.abs().max() > 0.1


def test_flip_reverses_the_x_ramp():
    x, centres = _ramps(64, 16)
    v, _ = simclr_views(x, _gen(9), crop_scale=(0.5, 0.5), ratio=(1.0, 1.0), max_shift=0.0, jitter=0.0, flip=True)
    w, h, _, _ = _crop_geometry(v, centres)
    expected = math.sqrt(0.5)
    assert torch.allclose(w.abs(), torch.full_like(w, expected)) and torch.allclose(h, torch.full_like(h, expected))
    assert bool((w < 0).any()) and bool((w > 0).any())


def test_jitter_is_a_per_sample_affine_map_within_its_strength():
    # Geometry off: each view is (x − m)·c + m + b with c in [1 − j, 1 + j] and b in [−j, j].
    x = _batch(10, shape=(32, 2, 8, 8), dtype=torch.float64)
    j = 0.3
    v, _ = simclr_views(x, _gen(10), crop_scale=(1.0, 1.0), max_shift=0.0, jitter=j)
    xc = x - x.mean(dim=(1, 2, 3), keepdim=True)
    vc = v - v.mean(dim=(1, 2, 3), keepdim=True)
    c = (vc * xc).sum(dim=(1, 2, 3)) / (xc * xc).sum(dim=(1, 2, 3))
    b = v.mean(dim=(1, 2, 3)) - x.mean(dim=(1, 2, 3))
    assert torch.allclose(vc, c.view(-1, 1, 1, 1) * xc, atol=1e-6)  # exactly affine
    assert bool(((c >= 1 - j) & (c <= 1 + j)).all()) and bool((b.abs() <= j).all())
    assert len(torch.unique(c.round(decimals=8))) == 32  # per-sample strengths


def test_noise_has_the_requested_standard_deviation():
    x = torch.zeros(16, 1, 32, 32)
    v, _ = simclr_views(x, _gen(11), crop_scale=(1.0, 1.0), max_shift=0.0, jitter=0.0, noise_std=0.5)
    assert v.std().item() == pytest.approx(0.5, rel=0.05)
    assert v.mean().abs().item() < 0.05


def test_constant_images_stay_constant_under_geometry():
    x = torch.full((8, 3, 16, 16), 2.5)
    v, _ = simclr_views(x, _gen(12), crop_scale=(0.3, 0.5), max_shift=0.3, flip=True, jitter=0.0)
    assert torch.allclose(v, x, atol=1e-5)


def test_view_config_views_match_simclr_views():
    x = _batch(13)
    cfg = ViewConfig(crop_scale=[0.5, 0.8], flip=True, jitter=0.2, noise_std=0.05)
    assert cfg.crop_scale == (0.5, 0.8)  # a list from a plan file becomes a tuple
    a = cfg.views(x, _gen(13))
    b = simclr_views(x, _gen(13), crop_scale=(0.5, 0.8), flip=True, jitter=0.2, noise_std=0.05)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_default_view_config_values():
    cfg = ViewConfig()
    assert (cfg.crop_scale, cfg.ratio, cfg.max_shift, cfg.flip, cfg.jitter, cfg.noise_std) == (
        (0.6, 1.0), (3 / 4, 4 / 3), 0.1, False, 0.4, 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(crop_scale=(0.0, 1.0)), "crop_scale"),
    (dict(crop_scale=(0.8, 0.5)), "crop_scale"),
    (dict(crop_scale=(0.5, 1.2)), "crop_scale"),
    (dict(crop_scale=0.5), "crop_scale"),
    (dict(ratio=(1.2, 1.5)), "ratio"),
    (dict(ratio=(0.0, 1.0)), "ratio"),
    (dict(max_shift=-0.1), "max_shift"),
    (dict(max_shift=float("nan")), "max_shift"),
    (dict(flip="yes"), "flip"),
    (dict(jitter=1.5), "jitter"),
    (dict(noise_std=-1.0), "noise_std"),
])
def test_bad_settings_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ViewConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        simclr_views(_batch(), _gen(0), **kwargs)


@pytest.mark.parametrize("x", [torch.randn(3, 16, 16), torch.zeros(2, 1, 4, 4, dtype=torch.int64)])
def test_bad_batch_raises(x):
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        simclr_views(x, _gen(0))


@pytest.fixture
def one_thread():
    # On a busy shared machine, intra-op threads on so small a batch only wait for each other.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_a_digits_sized_batch_is_fast(one_thread):
    x = _batch(14, shape=(64, 1, 32, 32))
    g = _gen(14)
    simclr_views(x, g)  # warm-up
    start = time.perf_counter()
    for _ in range(10):
        v1, v2 = simclr_views(x, g)
    per_call_ms = (time.perf_counter() - start) * 100
    print(f"simclr_views on (64, 1, 32, 32): {per_call_ms:.2f} ms per call")  # informative, no assertion on time
    assert v1.shape == v2.shape == (64, 1, 32, 32)
