"""The aggregator's screen of uploads and the robust rules, against independent references."""

import math

import numpy as np
import pytest
import torch

from fedcontrast.aggregation import weighted_average
from fedcontrast.algorithms import Downlink
from fedcontrast.config import RobustnessConfig
from fedcontrast.errors import FedContrastError
from fedcontrast.robust import (
    Move,
    UploadScreen,
    abnormal_move,
    all_rejected_hint,
    clip_update,
    coordinate_median,
    robust_average,
    trimmed_count,
    trimmed_mean,
    update_cosines,
    update_norm,
    update_spreads,
    upload_digest,
)


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
    with pytest.raises(FedContrastError, match="'c' has no bound in the plan's max_samples mapping"):
        screen.check_weight("c", 1e12)  # a site the mapping leaves out is not unbounded (issue 34)
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
    assert RunConfig(clients=2, robustness={"max_samples": {"site_0": 5, "site_1": 10}}).robustness.max_samples == {
        "site_0": 5, "site_1": 10}


# --- the bound and the value in every rejection ------------------------------------------------
def test_update_bound_rejection_names_the_bound_the_value_and_the_factor():
    ref = {"model.w": torch.tensor([3.0, 4.0])}  # ‖w‖ = 5
    up = {"model.w": torch.tensor([3.0, 4.0 + 12.5])}  # ‖Δ‖ = 12.5 = 2.5 × ‖w‖
    rejected = _screen(max_update_ratio=1.0).screen(2, {"site_2": up}, {"site_2": 1.0}, ref)[2]
    assert rejected["site_2"] == ("round 2: site 'site_2' uploaded a model update of norm 12.5, 2.5× the global "
                                  "model's norm 5, above the plan's max_update_ratio 1 (by 2.5×); rejected")
    with pytest.raises(FedContrastError, match=r"claimed 300 samples, more than the plan's max_samples 100 for it "
                                               r"\(by 3×\)"):
        _screen(max_samples=100).check_weight("a", 300.0)


# --- across the sites: direction and spread ----------------------------------------------------
def _reference_cosines(ups, ref):
    """cos(Δ_k, coordinate-wise median of the others' Δ_j/‖Δ_j‖), by explicit loops over coordinates."""
    flat = {s: [b - a for a, b in zip(torch.cat([ref[n].reshape(-1) for n in sorted(ref)]).tolist(),
                                      torch.cat([ups[s][n].reshape(-1) for n in sorted(ref)]).tolist())]
            for s in ups}
    unit = {s: [x / math.sqrt(sum(y * y for y in v)) for x in v] for s, v in flat.items()}
    out = {}
    for s in sorted(ups):
        others = [unit[o] for o in sorted(ups) if o != s]
        median = []
        for j in range(len(unit[s])):
            column = sorted(o[j] for o in others)
            mid = len(column) // 2
            median.append(column[mid] if len(column) % 2 else (column[mid - 1] + column[mid]) / 2)
        norm = math.sqrt(sum(x * x for x in median))
        out[s] = sum(a * b for a, b in zip(unit[s], median)) / norm
    return out


@pytest.mark.parametrize("k", [3, 4, 5, 6])
def test_update_cosines_match_an_explicit_loop(k):
    g = torch.Generator().manual_seed(100 + k)
    ref = {"model.w": torch.randn(3, 4, generator=g), "model.b": torch.randn(5, generator=g)}
    ups = {f"s{i}": {n: t + torch.randn(t.shape, generator=g) * (i + 1) for n, t in ref.items()} for i in range(k)}
    got = update_cosines(ups, ref)
    expected = _reference_cosines(ups, ref)
    assert sorted(got) == sorted(expected)
    for s in expected:
        assert got[s] == pytest.approx(expected[s], rel=1e-9, abs=1e-12)


def test_update_cosines_closed_form_and_too_few_sites():
    ref = {"model.w": torch.zeros(2)}
    ups = {"a": {"model.w": torch.tensor([1.0, 0.0])}, "b": {"model.w": torch.tensor([2.0, 0.0])},
           "c": {"model.w": torch.tensor([-5.0, 0.0])}}  # c points the other way
    # a's others b, c: the median of (1, 0) and (-1, 0) is 0, no direction (so for b): left out; c's others agree
    assert update_cosines(ups, ref) == {"c": pytest.approx(-1.0)}
    assert update_cosines({s: ups[s] for s in ("a", "b")}, ref) == {}  # two sites: nothing to compare


def _directed(ref, direction, scale, noise, g):
    return {"model.w": ref["model.w"] + scale * direction + noise * torch.randn(direction.shape, generator=g)}


@pytest.mark.parametrize("k", [3, 5])
def test_sign_flipped_update_rejected_by_the_direction_check(k):
    g = torch.Generator().manual_seed(k)
    ref = {"model.w": torch.randn(200, generator=g)}
    common = torch.randn(200, generator=g)
    ups = {f"site_{i}": _directed(ref, common, 0.05, 0.05, g) for i in range(k)}  # honest: a shared direction
    ups["site_1"] = {"model.w": ref["model.w"] - 4 * (ups["site_1"]["model.w"] - ref["model.w"])}  # flipped, boosted
    weights = {s: 10.0 for s in ups}
    assert _screen()._reference is None and list(_screen().screen(1, ups, weights, ref)[2]) == []  # off by default
    accepted, _, rejected = _screen(min_update_cosine=0.0).screen(1, ups, weights, ref)
    assert list(rejected) == ["site_1"] and "site_1" not in accepted and len(accepted) == k - 1
    cos = update_cosines(ups, ref)["site_1"]
    assert cos < -0.5
    assert rejected["site_1"] == (f"round 1: site 'site_1''s model update points away from the other sites' (cosine "
                                  f"{cos:.3f} to the coordinate-wise median of their update directions), below the "
                                  "plan's min_update_cosine 0; rejected")
    honest = {s: u for s, u in ups.items() if s != "site_1"}
    if len(honest) >= 3:
        assert _screen(min_update_cosine=0.0).screen(1, honest, weights, ref)[2] == {}


def test_direction_check_rejects_the_worst_first_and_recomputes():
    # Three sites: the flipped one is among each honest site's two "others", which then cancel out —
    # only the lowest cosine is rejected, and with two sites left nothing more is compared.
    ref = {"model.w": torch.zeros(3)}
    ups = {"a": {"model.w": torch.tensor([1.0, 0.1, 0.0])}, "b": {"model.w": torch.tensor([1.0, -0.1, 0.0])},
           "c": {"model.w": torch.tensor([-1.0, 0.0, 0.2])}}
    cos = update_cosines(ups, ref)
    assert min(cos, key=cos.get) == "c" and cos["a"] < 0.1 and cos["b"] < 0.1
    rejected = _screen(min_update_cosine=0.5).screen(1, ups, {s: 1.0 for s in ups}, ref)[2]
    assert list(rejected) == ["c"]


def test_update_spread_rejection_closed_form():
    ref = {"model.w": torch.zeros(1)}
    ups = {s: {"model.w": torch.tensor([v])} for s, v in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 40.0))}
    assert update_spreads({"a": 1.0, "b": 2.0, "c": 3.0, "d": 40.0}) == {
        "a": pytest.approx(1 / 3), "b": pytest.approx(2 / 3), "c": pytest.approx(3 / 2), "d": pytest.approx(20.0)}
    rejected = _screen(max_update_spread=5.0).screen(1, ups, {s: 1.0 for s in ups}, ref)[2]
    assert rejected == {"d": "round 1: site 'd' uploaded a model update of norm 40, 20× the median norm of the other "
                             "sites' updates, above the plan's max_update_spread 5; rejected"}


# --- blame: the upload that moved the global model ---------------------------------------------
def test_abnormal_move_closed_form():
    ref = {"model.w": torch.tensor([0.0, 3.0])}  # ‖w‖ = 3
    ups = {"h": {"model.w": torch.tensor([1.0, 3.0])}, "x": {"model.w": torch.tensor([-10.0, 3.0])}}
    new = weighted_average(ups, {"h": 1.0, "x": 1.0})  # M = (-4.5, 0)
    move = abnormal_move(4, ups, {"h": 0.5, "x": 0.5}, ref, new)
    # x's contribution 0.5·⟨(-10, 0), M⟩/‖M‖² = 22.5/20.25; h's 0.5·(-4.5)/20.25; they sum to 1
    assert move == Move(round=4, site="x", move_ratio=pytest.approx(1.5), share=pytest.approx(22.5 / 20.25),
                        update_ratio=pytest.approx(10 / 3), spread=pytest.approx(10.0))
    calm = {"h": ups["h"], "x": {"model.w": torch.tensor([-3.0, 3.0])}}  # 3× the other: not abnormal
    assert abnormal_move(4, calm, {"h": 0.5, "x": 0.5}, ref, weighted_average(calm, {"h": 1, "x": 1})) is None


def _round(screen, round_num, ups, ref):
    accepted, weights, rejected = screen.screen(round_num, ups, {s: 1.0 for s in ups}, ref)
    downlink, _ = screen.aggregate(lambda u, w: Downlink(weighted_average(u, w)), accepted, weights, None, round_num)
    return downlink.global_tensors, rejected


def test_in_bound_attacker_is_named_not_the_honest_site_that_corrects():
    # Round 1: x sends an update inside max_update_ratio 1 (0.99‖w‖, 20× h's), which moves the
    # global model; round 2: h's correcting update is over the bound and rejected — x is named.
    screen = _screen(max_update_ratio=1.0)
    ref = {"model.w": torch.tensor([3.0, 4.0])}
    w1, rejected = _round(screen, 1, {"h": {"model.w": torch.tensor([3.0, 4.05])},
                                      "x": {"model.w": torch.tensor([3.0, 4.0 - 4.95])}}, ref)
    assert rejected == {} and [m.site for m in screen.moves] == ["x"]
    back = {"model.w": w1["model.w"] + torch.tensor([0.0, 3.5])}  # h's update back towards w: 1.04 × ‖w1‖
    assert update_norm(back, w1)[0] > update_norm(back, w1)[1]
    _, rejected = _round(screen, 2, {"h": back, "x": {"model.w": w1["model.w"] * 0.99}}, w1)
    assert list(rejected) == ["h"]
    assert "above the plan's max_update_ratio 1" in rejected["h"]
    assert ("moved abnormally in round 1 by site 'x''s upload" in rejected["h"]
            and "so site 'x' is the likely cause" in rejected["h"] and "points back against that move" in rejected["h"])
    assert "site 'h' is the likely cause" not in rejected["h"] and list(screen.causes[2]) == ["x"]
    # three rounds later the move is too old to be named the likely cause: it is stated as history
    assert screen.likely_cause(5, "h") is None and screen.likely_cause(4, "h").site == "x"
    assert screen.cause_note(9, "h") == (" — earlier in this run the global model was moved abnormally by site 'x''s "
                                         "upload (round 1)")
    assert screen.cause_note(9, "x") == ""


def test_all_non_finite_hint_names_the_cause_and_blames_the_ratio_only_when_off():
    rejected = {"a": "round 3: site 'a' uploaded 'model.w' with NaN or infinite values; rejected",
                "b": "round 3: site 'b' uploaded 'model.w' with NaN or infinite values; rejected"}
    assert "max_update_ratio off?" in all_rejected_hint(rejected, max_update_ratio=None)
    on = all_rejected_hint(rejected, max_update_ratio=10.0)
    assert "max_update_ratio off?" not in on and "inside max_update_ratio 10" in on
    cause = Move(round=2, site="b", move_ratio=5.9, share=1.0, update_ratio=9.9, spread=300.0)
    named = all_rejected_hint(rejected, max_update_ratio=10.0, cause=cause)
    assert "moved abnormally in round 2 by site 'b''s upload" in named and "site 'b' is the likely cause" in named
    assert "max_update_ratio" not in named
    assert all_rejected_hint({"a": rejected["a"]}, max_update_ratio=None) == ""  # one site: that site


def test_robust_rules_and_cross_site_checks_refused_with_too_few_sites():
    from fedcontrast.config import RunConfig
    from fedcontrast.errors import ConfigError

    for rule in ("median", "trimmed_mean"):
        with pytest.raises(ConfigError) as info:
            RunConfig(clients=2, robustness={"rule": rule})
        assert str(info.value) == (f"robustness rule {rule} needs at least 3 sites per round to tolerate one hostile "
                                   "site; this plan has 2")
        assert RunConfig(clients=3, robustness={"rule": rule}).robustness.rule == rule
    with pytest.raises(ConfigError, match=r"robustness rule median and min_update_cosine need at least 3 sites per "
                                          r"round .*; this plan has 2 \(10 sites, sample_fraction 0.2\)"):
        RunConfig(clients=10, sample_fraction=0.2, robustness={"rule": "median", "min_update_cosine": 0.0})
    with pytest.raises(ConfigError, match="max_update_spread needs at least 3 sites"):
        RunConfig(clients=2, robustness={"max_update_spread": 5})
    for bad in ({"min_update_cosine": 1.5}, {"max_update_spread": 1.0}):
        with pytest.raises(ConfigError, match="robustness"):
            RunConfig(clients=3, robustness=bad)
