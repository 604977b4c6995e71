"""Sites may differ in what they release (issue 21, point 1): each metric is averaged over the sites
that released it, who withheld what is recorded, and the operator's view says why it is empty."""

from .conftest import small_config

# The federation itself (sites that release different metrics, and a restarted aggregator replaying
# such a round) runs across network namespaces: tests/openfl/test_aggregator_restart.py.


# --- the aggregator's averages over the sites that released a metric (no federation) ---------------

def _aggregator(results, weights):
    """A SafeAggregator holding only what the round's metric computation reads: ``results`` is
    ``{(task, site): {metric: value}}`` (a site's task results), ``weights`` its data sizes."""
    import queue
    from types import SimpleNamespace

    import numpy as np
    from openfl.databases import TensorDB
    from openfl.utilities import TaskResultKey, TensorKey

    from fedcontrast.openfl.components import SafeAggregator

    agg = object.__new__(SafeAggregator)
    sites = sorted({site for _, site in results})
    agg.__dict__.update(round_number=0, uuid="agg", collaborators_done=sites, tensor_db=TensorDB(),
                        metric_queue=queue.Queue(), best_model_score=None, _secure_aggregation_enabled=False,
                        collaborator_tasks_results={}, collaborator_task_weight={},
                        assigner=SimpleNamespace(get_collaborators_for_task=lambda task, r: sites,
                                                 get_aggregation_type_for_task=lambda task: None,
                                                 is_task_group_evaluation=lambda: False))
    for (task, site), metrics in results.items():
        keys = [TensorKey(name, "agg", 0, True, ("metric", site)) for name in metrics]
        agg.tensor_db.cache_tensor({k: np.array(v) for k, v in zip(keys, metrics.values())})
        agg.collaborator_tasks_results[TaskResultKey(task, site, 0)] = keys
        agg.collaborator_task_weight[TaskResultKey(task, site, 0)] = weights.get((task, site), -1)
    return agg


def test_each_metric_is_averaged_over_the_sites_that_released_it():
    # site_0 releases its evaluation, site_1 withholds it (OpenFL 1.9: float(None), the round ends);
    # site_0 withholds its training loss, the others release it (OpenFL 1.9: the metric is dropped)
    agg = _aggregator({("evaluate", "site_0"): {"evaluate_accuracy": 0.8, "evaluate_samples": 10.0},
                       ("evaluate", "site_1"): {},
                       ("evaluate", "site_2"): {"evaluate_accuracy": 0.5, "evaluate_samples": 30.0},
                       ("train", "site_0"): {"fedcontrast_aggregation_weight": 100.0},
                       ("train", "site_1"): {"fedcontrast_aggregation_weight": 300.0, "train_loss": 2.0},
                       ("train", "site_2"): {"fedcontrast_aggregation_weight": 600.0, "train_loss": 1.0}},
                      {("train", "site_0"): 100, ("train", "site_1"): 300, ("train", "site_2"): 600})
    evaluate = agg._compute_validation_related_task_metrics("evaluate")
    # the evaluation task's weights are uniform (OpenFL: no "train"/"valid" in its name)
    assert evaluate == {"aggregator/evaluate/evaluate_accuracy": 0.65, "aggregator/evaluate/evaluate_samples": 20.0}
    train = agg._compute_validation_related_task_metrics("train")
    assert train["aggregator/train/train_loss"] == (300 * 2.0 + 600 * 1.0) / 900  # weighted by data size, as today
    assert train["aggregator/train/fedcontrast_aggregation_weight"] == (100 ** 2 + 300 ** 2 + 600 ** 2) / 1000


def test_a_metric_that_no_site_released_is_absent_not_zero():
    agg = _aggregator({("evaluate", "site_0"): {}, ("evaluate", "site_1"): {}}, {})
    assert agg._compute_validation_related_task_metrics("evaluate") == {}
    assert agg.metric_queue.empty()


def test_who_withheld_what_is_inferred_from_what_each_site_sent():
    from fedcontrast.openfl.records import describe_withheld, withheld_metrics

    declared = {"evaluate": ("evaluate_accuracy", "evaluate_loss", "evaluate_samples"), "train": ("train_loss",)}
    sent = {"evaluate": {"site_0": ["evaluate_accuracy", "evaluate_samples"], "site_1": [], "site_2": []},
            "train": {"site_0": ["fedcontrast_aggregation_weight", "train_dp_epsilon", "train_loss"],
                      "site_1": ["fedcontrast_aggregation_weight"], "site_2": ["fedcontrast_aggregation_weight",
                                                                            "train_loss"]}}
    withheld = withheld_metrics(sent, declared)
    # site_0 sent its evaluation without a loss (its plugin measured none): not counted as withheld
    assert withheld == {"site_1": ["evaluate_accuracy", "evaluate_loss", "evaluate_samples", "train_dp_epsilon",
                                   "train_loss"],
                        "site_2": ["evaluate_accuracy", "evaluate_loss", "evaluate_samples", "train_dp_epsilon"]}
    assert describe_withheld(withheld) == ("site_1 withheld its evaluation, training and ε metrics; "
                                           "site_2 withheld its evaluation and ε metrics")
    assert describe_withheld({"a": ["evaluate_accuracy"], "b": ["evaluate_samples"]}) == \
        "a, b withheld their evaluation metrics"


# --- what the operator sees (issue 21, point 8) -------------------------------------------------------

def _operator_record(round_num):
    return {"round": round_num, "rounds": 2, "trained_at": 1.0, "time": 2.0,
            "no_global_accuracy": "the aggregator holds no test data",
            "sites": {"site_0": {"samples": 95.0, "training": {}}, "site_1": {"samples": 103.0, "training": {}}},
            "withheld": {"site_0": ["evaluate_accuracy", "evaluate_loss", "evaluate_samples"],
                         "site_1": ["evaluate_accuracy", "evaluate_loss", "evaluate_samples", "train_loss"]}}


def test_the_round_record_and_log_say_who_withheld_and_that_the_aggregator_has_no_test_data(tmp_path, caplog):
    import logging
    from types import SimpleNamespace

    import pandas as pd

    from fedcontrast.algorithms import get_algorithm
    from fedcontrast.openfl.records import NO_TEST_DATA, RoundReport, read_records

    report = object.__new__(RoundReport)  # only what write_record uses: no model, no data
    table = pd.DataFrame(columns=["tensor_name", "origin", "round", "report", "tags", "nparray"])
    from fedcontrast.config import RunConfig

    report.__dict__.update(out_dir=tmp_path, rounds=2, written=0, sites=["site_0", "site_1"], no_test=NO_TEST_DATA,
                           algorithm=get_algorithm("fedavg"), tensor_db=SimpleNamespace(tensor_db=table),
                           config=RunConfig(algorithm="fedavg", clients=2),
                           sent={1: {"evaluate": {"site_0": [], "site_1": []}}},
                           pending={"round": 1, "rounds": 2, "no_global_accuracy": NO_TEST_DATA,
                                    "withheld": {"site_1": ["train_loss"]},
                                    "sites": {"site_0": {"training": {}}, "site_1": {"training": {}}}})
    with caplog.at_level(logging.INFO):
        report.write_record(1)
    [record] = read_records(tmp_path)
    evaluation = ["evaluate_accuracy", "evaluate_loss", "evaluate_samples",  # on its held-out split
                  "evaluate_val_accuracy", "evaluate_val_loss", "evaluate_val_samples"]  # and on its validation part
    assert record["withheld"] == {"site_0": evaluation, "site_1": [*evaluation, "train_loss"]}
    assert record["no_global_accuracy"] == NO_TEST_DATA and "site_accuracy" not in record
    assert ("round 1/2: accuracy at the sites on their own held-out data: n/a; site_0, site_1 withheld their "
            "evaluation metrics") in caplog.text


def test_the_operators_report_says_why_its_view_is_empty(tmp_path, capsys):
    import json

    from fedcontrast.cli import main
    from fedcontrast.openfl.launch import format_round
    from fedcontrast.openfl.plan import create_workspace

    line = format_round(_operator_record(1))
    assert line == ("round 1/2  no global accuracy (the aggregator holds no test data)  no site released its "
                    "held-out accuracy  site_0 withheld its evaluation metrics; site_1 withheld its evaluation and "
                    "training metrics")
    ws = create_workspace(tmp_path / "ws", small_config(), log=lambda m: None)
    (ws / "save" / "rounds.jsonl").write_text("".join(json.dumps(_operator_record(r)) + "\n" for r in (1, 2)))
    out = tmp_path / "report"
    out.mkdir()
    (out / "accuracy.png").write_bytes(b"stale")  # an earlier export's plot is not left to mislead
    assert main(["report", str(ws), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert line in printed
    assert "2 rounds; rounds.csv and summary.json in" in printed and not (out / "accuracy.png").exists()
    assert "final_accuracy is null: the aggregator holds no test data" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] is None and summary["plot"] is None
    why = summary["why_null"]
    assert why["final_accuracy"] == "the aggregator holds no test data"
    assert why["best_round"].startswith("no site released a validation accuracy")
    assert why["final_site_accuracy.site_1"].startswith("site_1 withheld its evaluation metrics")
    assert why["final_site_accuracy_mean"] == ("no site released its held-out accuracy for the final model "
                                               "(site_0, site_1 withheld their evaluation metrics)")
    assert why["plot"].startswith("nothing to plot")
