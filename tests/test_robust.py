"""The aggregator's screen of uploads and the robust rules, against independent references."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.algorithms import Downlink
from fedcontrast.aggregation import weighted_average
from fedcontrast.config import RobustnessConfig
from fedcontrast.errors import FedContrastError
from fedcontrast.robust import (UploadScreen, clip_update, coordinate_median, robust_average, trimmed_count,
                                trimmed_mean, update_norm, upload_digest)


def _uploads(k, seed=0, shape=(3, 4)):
    g = torch.Generator().manual_seed(seed)
    return {f"s{i}": {"model.w": torch.randn(shape, generator=g), "model.b": torch.randn(5, generator=g)}
            for i in range(k)}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_median_matches_numpy(k):
    ups = _uploads(k, seed=k)
    got = coordinate_median(ups)
    for name in ("model.w", "model.b"):
        ref = np.median(np.stack([ups[s][name].numpy().astype(np.float64) for s in sorted(ups)]), axis=0)
        np.testing.assert_allclose(got[name].numpy(), ref, rtol=1e-6)
        assert got[name].dtype == torch.float32


@pytest.mark.parametrize("k,fraction,expected", [(3, 0.2, 1), (10, 0.2, 2), (10, 0.0, 1), (2, 0.4, 0), (1, 0.2, 0),
                                                 (5, 0.45, 2)])
def test_trimmed_count(k, fraction, expected):
    assert trimmed_count(k, fraction) == expected


@pytest.mark.parametrize("k", [3, 4, 7, 10])
def test_trimmed_mean_matches_explicit_loop(k):
    ups = _uploads(k, seed=10 + k, shape=(2, 3))
    got = trimmed_mean(ups, 0.2)
    t = trimmed_count(k, 0.2)
    for name in ("model.w", "model.b"):
        flat = [ups[s][name].reshape(-1).tolist() for s in sorted(ups)]
        expected = []
        for j in range(len(flat[0])):
            column = sorted(row[j] for row in flat)
            kept = column[t:len(column) - t]
            expected.append(sum(kept) / len(kept))
        np.testing.assert_allclose(got[name].reshape(-1).numpy(), expected, rtol=1e-6, atol=1e-7)


def test_robust_rules_ignore_one_poisoned_site_and_mean_does_not():
    ups = {f"s{i}": {"model.w": torch.full((4,), float(i))} for i in range(3)}  # 0, 1, 2
    ups["s2"] = {"model.w": torch.full((4,), 1e6)}
    weights = {"s0": 1.0, "s1": 1.0, "s2": 1.0}
    assert torch.equal(robust_average(ups, weights, rule="median")["model.w"], torch.full((4,), 1.0))
    assert torch.equal(robust_average(ups, weights, rule="trimmed_mean")["model.w"], torch.full((4,), 1.0))
    assert float(robust_average(ups, weights, rule="mean")["model.w"][0]) > 1e5
    assert torch.equal(robust_average(ups, weights, rule="mean")["model.w"], weighted_average(ups, weights)["model.w"])
    with pytest.raises(ValueError):
        robust_average(ups, weights, rule="krum")


def test_update_norm_and_clipping_closed_form():
    ref = {"model.w": torch.tensor([3.0, 0.0]), "model.b": torch.tensor([0.0]), "proto": torch.ones(2)}
    up = {"model.w": torch.tensor([3.0, 4.0]), "model.b": torch.tensor([3.0]), "proto": torch.full((2,), 7.0)}
    norm, ref_norm = update_norm(up, ref)
    assert norm == pytest.approx(5.0) and ref_norm == pytest.approx(3.0)  # ‖(0, 4, 3)‖, ‖(3, 0, 0)‖
    clipped = clip_update(up, ref, 2.5)  # halves the update
    assert torch.allclose(clipped["model.w"], torch.tensor([3.0, 2.0])) and torch.allclose(clipped["model.b"],
                                                                                          torch.tensor([1.5]))
    assert torch.equal(clipped["proto"], up["proto"])  # not a model weight: untouched
    assert update_norm(clipped, ref)[0] == pytest.approx(2.5)
    assert clip_update(up, ref, 20.0)["model.w"] is up["model.w"]  # within the bound: unchanged


class _Plugin:
    def __init__(self):
        self.checked = []

    def check_upload(self, site, uploads, weight):
        self.checked.append(site)


def _screen(**settings):
    return UploadScreen(RobustnessConfig(**settings), _Plugin())


def test_weights_bounds_and_noise_allowance():
    screen = _screen(max_samples={"a": 100, "b": 50})
    screen.check_weight("a", 100.0)
    for bad in (float("nan"), -1.0, float("inf"), "12"):
        with pytest.raises(FedContrastError, match="'a'.*not a finite number >= 0"):
            screen.check_weight("a", bad)
    with pytest.raises(FedContrastError, match="'b' claimed 1e\\+12 samples.*max_samples 50"):
        screen.check_weight("b", 1e12)
    screen.check_weight("c", 1e12)  # no bound declared for c
    noisy = UploadScreen(RobustnessConfig(max_samples=100), _Plugin(), count_noise=10.0)
    noisy.check_weight("a", 100 + 59.0)  # within 6σ of the noise
    with pytest.raises(FedContrastError, match="6σ of count noise"):
        noisy.check_weight("a", 100 + 61.0)


def test_boosted_update_rejected_honest_one_accepted():
    g = torch.Generator().manual_seed(1)
    ref = {"model.w": torch.randn(100, generator=g)}
    honest = {"model.w": ref["model.w"] + 0.05 * torch.randn(100, generator=g)}
    boosted = {"model.w": ref["model.w"] + 20 * (honest["model.w"] - ref["model.w"])}
    ratio = update_norm(honest, ref)[0] / update_norm(honest, ref)[1]
    screen = _screen(max_update_ratio=5 * ratio)
    accepted, weights, rejected = screen.screen(0, {"a": honest, "b": boosted}, {"a": 10.0, "b": 10.0}, ref)
    assert list(accepted) == ["a"] and weights == {"a": 10.0}
    assert "site 'b'" in rejected["b"] and "max_update_ratio" in rejected["b"]
    big = {"model.w": ref["model.w"] * 1e30}
    assert "b" in _screen().screen(0, {"a": honest, "b": big}, {"a": 1, "b": 1}, ref)[2]  # the default bound


def test_replay_of_an_earlier_round_rejected_not_a_resend():
    screen = _screen()
    up = {"model.w": torch.arange(4.0)}
    assert screen.screen(0, {"a": up}, {"a": 1.0}, None)[2] == {}
    assert screen.screen(0, {"a": up}, {"a": 1.0}, None)[2] == {}  # the same round again (a resend): fine
    rejected = screen.screen(3, {"a": up, "b": up}, {"a": 1.0, "b": 1.0}, None)[2]
    assert list(rejected) == ["a"] and "round 3 exactly the upload it sent in round 0" in rejected["a"]
    relaxed = _screen(reject_replays=False)
    relaxed.screen(0, {"a": up}, {"a": 1.0}, None)
    assert relaxed.screen(1, {"a": up}, {"a": 1.0}, None)[2] == {}
    assert upload_digest({"x": torch.zeros(2)}) != upload_digest({"x": torch.zeros(2, dtype=torch.float64)})


def test_screen_clips_accepted_updates_and_calls_the_plugin():
    ref = {"model.w": torch.zeros(2)}
    screen = _screen(clip_update_norm=1.0)
    accepted, _, _ = screen.screen(0, {"a": {"model.w": torch.tensor([3.0, 4.0])}}, {"a": 1.0}, ref)
    assert torch.allclose(accepted["a"]["model.w"], torch.tensor([0.6, 0.8]))
    assert screen.algorithm.checked == ["a"]


def test_non_finite_global_model_names_the_site_that_caused_it():
    def summed(ups, ws):  # an aggregation that overflows float32 on one huge (finite) upload
        return Downlink({"model.w": sum(u["model.w"] * 4 for u in ups.values())})

    ups = {"a": {"model.w": torch.ones(3)}, "b": {"model.w": torch.full((3,), 3e38)}, "c": {"model.w": torch.ones(3)}}
    state = {"calls": 0}
    downlink, rejected = _screen().aggregate(summed, ups, {s: 1.0 for s in ups}, state)
    assert list(rejected) == ["b"] and "non-finite" in rejected["b"]
    assert torch.equal(downlink.global_tensors["model.w"], torch.full((3,), 8.0))
    with pytest.raises(FedContrastError, match="no single site"):
        _screen().aggregate(lambda u, w: Downlink({"x": torch.full((1,), math.inf)}), ups, {s: 1.0 for s in ups})


def test_config_refuses_bad_settings():
    from fedcontrast.config import RunConfig
    from fedcontrast.errors import ConfigError

    for bad in ({"rule": "krum"}, {"trim_fraction": 0.5}, {"clip_update_norm": 0}, {"max_update_ratio": -1},
                {"max_samples": -3}, {"max_samples": {"nobody": 10}}, {"on_rejected": "ignore"}):
        with pytest.raises(ConfigError, match="robustness"):
            RunConfig(clients=2, robustness=bad)
    assert RunConfig(clients=2, robustness={"max_samples": {"site_1": 10}}).robustness.max_samples == {"site_1": 10}
