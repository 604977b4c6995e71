"""Hostile sites in the simulator (test-only behaviour, patched in here): the aggregator's screen."""

import pytest
import torch

from fedcontrast.robust import RejectedUpload
from fedcontrast.sim import Federation


def hostile(federation, change):
    """Make ``change(site_name, round_num, result)`` act on every task result (test only)."""
    run_task = federation.algorithm.run_task

    def patched(task, site, received):
        result = run_task(task, site, received)
        change(site.name, site.round_num, result)
        return result

    object.__setattr__(federation.algorithm, "run_task", patched)  # test only: past the built plugin's guard


def scale_site_1(factor, at_round=2):
    def change(name, round_num, result):
        if name == "site_1" and round_num == at_round:
            result.uploads = {k: v * factor for k, v in result.uploads.items()}
    return change


def weights_of(federation):
    return {k: v.clone() for k, v in federation.downlink.global_tensors.items()}


@pytest.fixture
def three(tiny_config):
    return tiny_config.replace(clients=3, rounds=3)


def test_finite_poison_stops_the_run_naming_the_sender(three):
    federation = Federation(three)
    hostile(federation, scale_site_1(1e30))
    federation.run_round(1)
    before = weights_of(federation)
    with pytest.raises(RejectedUpload, match=r"round 2: site 'site_1' uploaded a model update of norm "
                                             r".*max_update_ratio.*round 2 was aggregated without them and the "
                                             r"federation stops") as info:
        federation.run_round(2)
    # on_rejected: stop (as documented): the round is aggregated from the honest sites alone, recorded,
    # then the run stops
    after = federation.downlink.global_tensors
    assert max(float(v.abs().max()) for v in after.values()) < 1e3  # the 1e30 upload was not averaged in
    assert any(not torch.equal(before[k], v) for k, v in after.items())  # the honest sites' round was
    assert [r["site"] for r in info.value.rows if r["task"] == "rejected"] == ["site_1"]


def test_excluded_poison_leaves_the_global_model_to_the_honest_sites(three):
    config = three.replace(robustness={"on_rejected": "exclude"})
    federation = Federation(config)
    hostile(federation, scale_site_1(1e30))
    for r in range(3):
        rows = federation.run_round(r + 1)
        assert [row["site"] for row in rows if row["task"] == "rejected"] == (["site_1"] if r == 1 else [])
    assert max(float(v.abs().max()) for v in federation.downlink.global_tensors.values()) < 1e3


def test_replayed_upload_is_rejected(three):
    federation = Federation(three)
    kept = {}

    def replay(name, round_num, result):
        if name == "site_1" and round_num == 1:
            kept.update(result.uploads)
        if name == "site_1" and round_num == 3:
            result.uploads = dict(kept)

    hostile(federation, replay)
    for r in range(2):
        federation.run_round(r + 1)
    with pytest.raises(RejectedUpload, match="site 'site_1' sent in round 3 exactly the upload it sent in round 1"):
        federation.run_round(3)


def boosted_round(config):
    """Round 1 with site_1's update × 20: (the global weights, every site's upload as aggregated)."""
    federation = Federation(config)
    uploads = {}

    def boost(name, round_num, result):
        if round_num == 1:
            if name == "site_1":
                start = federation.downlink.global_tensors
                result.uploads = {k: start[k] + 20 * (v - start[k]) if k in start else v
                                  for k, v in result.uploads.items()}
            uploads[name] = {k: v.clone() for k, v in result.uploads.items()}

    hostile(federation, boost)
    federation.run_round(1)
    return weights_of(federation), uploads


def test_median_keeps_a_boosted_update_out_where_the_mean_lets_it_in(three):
    mean, _ = boosted_round(three.replace(robustness={"rule": "mean", "max_update_ratio": None}))
    median, uploads = boosted_round(three.replace(robustness={"rule": "median", "max_update_ratio": None}))
    for name, value in median.items():  # between the two honest sites' values, coordinate by coordinate
        low = torch.minimum(uploads["site_0"][name], uploads["site_2"][name])
        high = torch.maximum(uploads["site_0"][name], uploads["site_2"][name])
        assert bool(((value >= low - 1e-6) & (value <= high + 1e-6)).all()), name
    outside = sum(int(((v < torch.minimum(uploads["site_0"][k], uploads["site_2"][k]) - 1e-6) |
                       (v > torch.maximum(uploads["site_0"][k], uploads["site_2"][k]) + 1e-6)).sum())
                  for k, v in mean.items())
    assert outside > 0  # the mean is pulled out of the honest range


def test_when_every_upload_is_non_finite_the_global_model_is_named_not_the_sites(three):
    federation = Federation(three)

    def all_nan(name, round_num, result):
        if round_num == 2:
            result.uploads = {k: torch.full_like(v, float("nan")) for k, v in result.uploads.items()}

    hostile(federation, all_nan)
    federation.run_round(1)
    with pytest.raises(RejectedUpload, match="the global model they all started from is the likely cause"):
        federation.run_round(2)
