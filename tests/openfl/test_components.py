"""The aggregator's bookkeeping, without processes: per-site metrics read from OpenFL's tensor
database (not its average), the weighted mean over sites, and the rounds the assigner hands out."""

import numpy as np
import pandas as pd
import pytest

from fedcontrast.openfl.components import RoundAssigner
from fedcontrast.openfl.records import site_metrics, weighted_site_mean
from fedcontrast.openfl.runner import WEIGHT_METRIC


def db(rows):
    return pd.DataFrame([{"tensor_name": n, "origin": "agg", "round": r, "report": rep, "tags": tags,
                          "nparray": np.array(v)} for n, r, rep, tags, v in rows])


def test_site_metrics_are_read_per_site_and_task_never_averaged():
    table = db([
        ("train_loss", 3, True, ("metric", "hosp1"), 0.5),
        ("train_loss", 3, True, ("metric", "hosp2"), 1.5),
        ("train_loss", 3, True, ("metric",), 1.0),  # OpenFL's own average: no site
        ("evaluate_accuracy", 3, True, ("metric", "hosp1"), 0.75),
        ("evaluate_samples", 3, True, ("metric", "hosp1"), 40.0),
        (WEIGHT_METRIC, 3, True, ("metric", "hosp2"), 120.0),
        ("train_loss", 2, True, ("metric", "hosp1"), 9.0),  # another round
        ("fedcontrast.global", 3, False, ("trained", "hosp1"), 0.0),  # not a metric
        ("train_loss", 3, True, ("metric", "intruder"), 7.0),  # not a site of the plan
    ])
    metrics = site_metrics(table, 3, ["hosp1", "hosp2"], ["evaluate", "train"])
    assert metrics == {"hosp1": {"train": {"loss": 0.5}, "evaluate": {"accuracy": 0.75, "samples": 40.0}},
                       "hosp2": {"train": {"loss": 1.5}, "": {"samples": 120.0}}}


def test_the_sites_mean_is_weighted_by_their_held_out_samples():
    sites = {"a": {"evaluation": {"accuracy": 0.5, "samples": 10.0}},
             "b": {"evaluation": {"accuracy": 1.0, "samples": 30.0}},
             "c": {"training": {"loss": 1.0}}}  # did not evaluate: not counted
    assert weighted_site_mean(sites) == pytest.approx((0.5 * 10 + 1.0 * 30) / 40)
    assert weighted_site_mean({"c": {}}) is None


def test_every_round_starts_with_evaluation_and_one_evaluation_round_follows():
    assigner = RoundAssigner(train_tasks=["train", "similarity"], tasks={}, authorized_cols=["a", "b"],
                             rounds_to_train=3)
    for r in range(3):
        assert assigner.get_tasks_for_collaborator("a", r) == ["evaluate", "train", "similarity"]
        assert assigner.get_collaborators_for_task("train", r) == ["a", "b"]
    assert assigner.get_all_tasks_for_round(3) == ["evaluate"]  # the final model, measured at every site
    assert assigner.get_collaborators_for_task("train", 3) == []
