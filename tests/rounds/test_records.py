"""The sites' weighted mean score (:func:`fedcontrast.rounds.records.weighted_site_mean`), as Flower's
ServerApp and OpenFL's round records compute it, against sums written out by hand."""

from fedcontrast.rounds.records import weighted_site_mean

EVALUATIONS = [
    {"accuracy": 0.5, "samples": 10.0, "val_accuracy": 0.25, "val_samples": 4.0},
    {"accuracy": 0.9, "samples": 30.0},  # no validation part
    {"samples": 50.0},  # its accuracy withheld
    {"accuracy": 0.1, "samples": 0.0, "val_accuracy": 1.0, "val_samples": 0.0},  # no held-out samples
    {"accuracy": 0.3, "samples": 20.0, "val_accuracy": 0.75, "val_samples": 12.0},
]


def test_the_mean_weights_each_score_by_its_samples_over_the_sites_that_have_both():
    assert weighted_site_mean(EVALUATIONS) == ((0.5 * 10 + 0.9 * 30 + 0.3 * 20) / 60, 60.0)
    assert weighted_site_mean(EVALUATIONS, "val_accuracy", "val_samples") == ((0.25 * 4 + 0.75 * 12) / 16, 16.0)


def test_the_sums_are_taken_in_the_order_given():
    scores = [(0.1, 3.0), (0.7, 7.0), (0.2, 11.0)]
    total, weighted = 0.0, 0.0
    for a, n in scores:
        total, weighted = total + n, weighted + n * a
    mean, samples = weighted_site_mean([{"accuracy": a, "samples": n} for a, n in scores])
    assert mean.hex() == (weighted / total).hex() and samples == total == 21.0


def test_a_missing_sample_count_counts_as_the_default():
    evaluations = [{"accuracy": 0.2}, {"accuracy": 0.8, "samples": 3.0}]
    assert weighted_site_mean(evaluations) == (3 * 0.8 / 3, 3.0)  # default 0: left out
    assert weighted_site_mean(evaluations, default=1.0) == ((0.2 * 1 + 0.8 * 3) / 4, 4.0)


def test_no_site_with_a_score_and_samples_gives_none():
    assert weighted_site_mean([]) is None
    assert weighted_site_mean([{"samples": 5.0}, {"accuracy": 0.5, "samples": 0.0}, {"accuracy": 0.5}]) is None
