"""The aggregator's round (:class:`fedcontrast.rounds.AggregatorRound`) on FedAvg over 3 sites of a
tiny model, against sentences and weighted means written out by hand. Every upload holds multiples
of 1/4 and every count share is a multiple of 1/8, so the means are exact in float32 and compared
bit for bit."""

import io

import numpy as np
import pytest
import torch

from fedcontrast.robust import RejectedUpload
from fedcontrast.robust.screen import UploadFacts
from fedcontrast.rounds import AggregatorRound
from tests.plans import small_config

SHAPE = {"in_channels": 1, "image_size": 16, "num_classes": 3}  # SimpleCNN's smallest images: 22k weights
CLASSIFIER_BIAS = "model.classifier.bias"


def aggregator(**changes) -> AggregatorRound:
    """FedAvg's aggregator of sites site_0, site_1 and site_2, under the plan's ``changes``."""
    return AggregatorRound(small_config(algorithm="fedavg", clients=3, projection_dim=8, **changes), SHAPE)


def upload(core: AggregatorRound, seed: int) -> dict[str, torch.Tensor]:
    """Every declared upload of ``core``'s plugin, filled with multiples of 1/4 in [-2, 2]."""
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randint(-8, 9, s.shape, generator=g).to(torch.float32) / 4 for s in core.specs}


def mean_by_hand(uploads: dict[str, dict[str, torch.Tensor]], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """FedAvg's ``Σ n_k·w_k / Σ n_k`` for every tensor, summed in float64 site by site."""
    total = sum(weights[s] for s in uploads)
    first = next(iter(uploads.values()))
    out = {}
    for name in first:
        acc = torch.zeros(first[name].shape, dtype=torch.float64)
        for site in uploads:
            acc += weights[site] * uploads[site][name].to(torch.float64)
        out[name] = (acc / total).to(torch.float32)
    return out


def assert_tensors_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert torch.equal(got[name], expected[name]), name


def test_an_invalid_upload_is_rejected_with_its_sentence_and_the_valid_one_aggregated():
    core = aggregator(robustness={"on_rejected": "exclude"})
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    uploads["site_1"][CLASSIFIER_BIAS] = torch.zeros(2)  # declared (3,)
    outcome = core.aggregate(1, uploads, {"site_0": 4.0, "site_1": 4.0}, None)  # site_2 sent no weight
    expected = {"site_1": f"round 1: site 'site_1' uploaded '{CLASSIFIER_BIAS}' with shape (2,), declared (3,); "
                          "rejected",
                "site_2": "round 1: site 'site_2' sent no aggregation weight; rejected"}
    assert outcome.excluded == expected
    assert outcome.note == expected["site_1"] + "; " + expected["site_2"]
    assert outcome.stop is None
    assert list(outcome.accepted) == ["site_0"]
    assert_tensors_equal(outcome.downlink.global_tensors, uploads["site_0"])  # the mean of one site


def test_a_screened_out_upload_is_excluded_and_the_others_averaged_by_their_counts():
    core = aggregator(robustness={"max_samples": 10, "on_rejected": "exclude"})
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    weights = {"site_0": 2.0, "site_1": 6.0, "site_2": 50.0}  # site_2 claims 5 times the plan's bound
    outcome = core.aggregate(1, uploads, weights, None)
    sentence = "round 1: site 'site_2' claimed 50 samples, more than the plan's max_samples 10 for it (by 5×); rejected"
    assert outcome.excluded == {"site_2": sentence}
    assert outcome.note == sentence and outcome.stop is None
    assert sorted(outcome.accepted) == ["site_0", "site_1"]
    expected = {}
    for name in uploads["site_0"]:  # (2·w_0 + 6·w_1) / 8
        expected[name] = ((2 * uploads["site_0"][name].double() + 6 * uploads["site_1"][name].double()) / 8).float()
    assert_tensors_equal(outcome.downlink.global_tensors, expected)
    assert_tensors_equal(outcome.downlink.global_tensors, mean_by_hand({s: uploads[s] for s in ("site_0", "site_1")},
                                                                       weights))
    weights_name = "model.classifier.weight"  # with site_2's upload, the mean would differ
    assert not torch.equal(expected[weights_name], mean_by_hand(uploads, weights)[weights_name])


def test_the_upload_that_made_the_aggregate_non_finite_is_blamed_and_left_out():
    core = aggregator(robustness={"on_rejected": "exclude"})
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    uploads["site_2"][CLASSIFIER_BIAS][1] = float("inf")
    # its site measured it as finite (a simulated site's facts): validation does not look at its values again
    facts = {"site_2": UploadFacts((), None, None, finite=True)}
    weights = {"site_0": 2.0, "site_1": 2.0, "site_2": 4.0}
    outcome = core.aggregate(1, uploads, weights, None, facts=facts)
    sentence = ("round 1: site 'site_2''s upload made the aggregated global model non-finite (NaN or infinite values; "
                "its largest value inf); rejected")
    assert outcome.excluded == {"site_2": sentence}
    assert outcome.note == sentence
    assert sorted(outcome.accepted) == ["site_0", "site_1"]
    expected = {n: ((uploads["site_0"][n].double() + uploads["site_1"][n].double()) / 2).float()
                for n in uploads["site_0"]}
    assert_tensors_equal(outcome.downlink.global_tensors, expected)


def test_on_rejected_stop_aggregates_without_the_sender_then_says_the_federation_stops():
    core = aggregator(robustness={"max_samples": 10})  # on_rejected: stop, the default
    assert core.config.robustness.on_rejected == "stop"
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    outcome = core.aggregate(4, uploads, {"site_0": 12.0, "site_1": 1.0, "site_2": 7.0}, None)
    sentence = ("round 4: site 'site_0' claimed 12 samples, more than the plan's max_samples 10 for it (by 1.2×); "
                "rejected")
    assert outcome.stop == sentence
    assert outcome.note is None
    assert outcome.excluded == {"site_0": sentence}
    assert_tensors_equal(outcome.downlink.global_tensors,
                         {n: ((uploads["site_1"][n].double() + 7 * uploads["site_2"][n].double()) / 8).float()
                          for n in uploads["site_0"]})
    stopped = outcome.stopped(4)
    assert isinstance(stopped, RejectedUpload)
    assert str(stopped) == (f"rejected upload(s): {sentence}; round 4 was aggregated without them and the federation "
                            "stops so that the operator can look at the sender (robustness.on_rejected: stop)")


def test_nothing_left_to_aggregate_raises_with_every_reason():
    core = aggregator(robustness={"max_samples": 10, "on_rejected": "exclude"})
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    with pytest.raises(RejectedUpload) as caught:
        core.aggregate(2, uploads, {"site_0": 50.0, "site_1": 60.0, "site_2": 70.0}, None)
    reasons = [f"round 2: site 'site_{k}' claimed {n} samples, more than the plan's max_samples 10 for it (by {r}×); "
               "rejected" for k, n, r in ((0, 50, 5), (1, 60, 6), (2, 70, 7))]
    assert str(caught.value) == "; ".join(reasons) + "; no upload left to aggregate"


def test_every_upload_non_finite_blames_the_global_model_they_started_from():
    core = aggregator()
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    for site in uploads:
        uploads[site][CLASSIFIER_BIAS][0] = float("nan")
    with pytest.raises(RejectedUpload) as caught:
        core.aggregate(1, uploads, {"site_0": 1.0, "site_1": 1.0, "site_2": 1.0}, None)
    reasons = "; ".join(f"round 1: site 'site_{k}' uploaded '{CLASSIFIER_BIAS}' with NaN or infinite values; rejected"
                        for k in range(3))
    assert str(caught.value).startswith(reasons + "; no upload left to aggregate; every site's upload is non-finite, "
                                        "so the global model they all started from is the likely cause, not the sites")


def secure_total(core: AggregatorRound, uploads: dict[str, dict[str, torch.Tensor]],
                 weights: dict[str, float]) -> np.ndarray:
    """The unmasked secure sum of FedAvg's terms, laid out as the plan's :class:`SumLayout` says: per
    term in name order, ``Σ n_k·clip(w_k)`` (``sum.NAME``) or ``Σ n_k`` (``count``), over the scale."""
    layout, clip = core.sum_layout, core.config.secure_aggregation.clip
    parts = []
    for term in sorted(layout.terms):
        if term == "count":
            summed = np.array([sum(weights[s] for s in uploads)], dtype=np.float64)
        else:
            name = term.removeprefix("sum.")
            summed = np.zeros(layout.terms[term], dtype=np.float64)
            for site in uploads:
                summed += weights[site] * np.clip(uploads[site][name].double().numpy(), -clip, clip)
        parts.append(summed.ravel() / layout.scale)
    return np.concatenate(parts)


def test_the_secure_sum_gives_the_plain_aggregate():
    core = aggregator(secure_aggregation={"clip": 4, "max_samples": 8, "bits": 64})
    uploads = {f"site_{k}": upload(core, k) for k in range(3)}
    weights = {"site_0": 1.0, "site_1": 2.0, "site_2": 5.0}
    secure = core.aggregate_secure(1, secure_total(core, uploads, weights), None, survivors=3)
    plain = core.aggregate(1, uploads, weights, None)
    assert_tensors_equal(secure.downlink.global_tensors, plain.downlink.global_tensors)
    assert_tensors_equal(secure.downlink.global_tensors, mean_by_hand(uploads, weights))
    assert secure.accepted == {} and secure.excluded == {} and secure.stop is None


def test_a_secure_round_reports_the_sites_refused_before_it_and_stops_on_them():
    core = aggregator(secure_aggregation={"clip": 4, "max_samples": 8, "bits": 64})
    uploads = {f"site_{k}": upload(core, k) for k in range(2)}
    weights = {"site_0": 3.0, "site_1": 5.0}
    refused = {"site_2": "round 1: site 'site_2' withdrew"}
    outcome = core.aggregate_secure(1, secure_total(core, uploads, weights), None, rejected=refused,
                                    note=refused["site_2"], survivors=2)
    assert outcome.excluded == refused and outcome.stop == refused["site_2"] and outcome.note is None
    assert_tensors_equal(outcome.downlink.global_tensors, mean_by_hand(uploads, weights))
    with pytest.raises(RejectedUpload, match="secure aggregation is off in this plan"):
        aggregator().aggregate_secure(1, secure_total(core, uploads, weights), None)


def test_the_state_survives_a_checkpoint_and_a_replay_is_still_caught_after_it():
    plan = {"robustness": {"on_rejected": "exclude"}}
    core = aggregator(**plan)
    first = {f"site_{k}": upload(core, k) for k in range(3)}
    weights = {"site_0": 2.0, "site_1": 4.0, "site_2": 4.0}
    outcome = core.aggregate(1, first, weights, None)
    assert outcome.excluded == {}
    core.server.state["plugin.memory"] = torch.arange(4.0)  # what a plugin keeps between rounds
    buffer = io.BytesIO()
    torch.save(core.state_dict(), buffer)
    buffer.seek(0)
    restarted = aggregator(**plan)
    restarted.load_state_dict(torch.load(buffer))
    assert list(restarted.server.state) == ["plugin.memory"]
    assert torch.equal(restarted.server.state["plugin.memory"], torch.arange(4.0))
    assert restarted.screen.digests == core.screen.digests
    assert sorted(restarted.screen.digests) == ["site_0", "site_1", "site_2"]
    assert all(list(d.values()) == [1] for d in restarted.screen.digests.values())  # each first sent in round 1

    second = {"site_0": first["site_0"], "site_1": upload(core, 11), "site_2": upload(core, 12)}
    previous = outcome.downlink.global_tensors
    again = restarted.aggregate(2, second, weights, previous)
    assert again.excluded == {"site_0": "round 2: site 'site_0' sent in round 2 exactly the upload it sent in round 1 "
                                        "(a replay, not fresh work); rejected"}
    assert_tensors_equal(again.downlink.global_tensors,
                         {n: ((second["site_1"][n].double() + second["site_2"][n].double()) / 2).float()
                          for n in previous})
    forgetful = aggregator(**plan)  # without the checkpoint, the replay would pass
    assert forgetful.aggregate(2, second, weights, previous).excluded == {}


def test_a_checkpoint_without_the_screen_digests_loads_as_none_remembered():
    core = aggregator()
    core.screen.digests = {"site_0": {"stale": 1}}
    core.load_state_dict({"server_state": {"x": 1}})
    assert core.server.state == {"x": 1} and core.screen.digests == {}


def test_settle_explains_the_sites_refused_before_a_secure_round_and_raises_when_none_is_left():
    core = aggregator(secure_aggregation={"clip": 4, "max_samples": 8, "bits": 64})
    refused = {"site_2": "round 3: site 'site_2' withdrew", "site_1": "round 3: site 'site_1' withdrew"}
    survivors = {"site_0": upload(core, 0)}
    assert core.settle(3, refused, survivors) == (refused, refused["site_1"] + "; " + refused["site_2"])
    assert core.settle(3, {}, survivors) == ({}, None)
    with pytest.raises(RejectedUpload) as caught:
        core.settle(3, refused, {})
    assert str(caught.value) == refused["site_1"] + "; " + refused["site_2"] + "; no upload left to aggregate"
