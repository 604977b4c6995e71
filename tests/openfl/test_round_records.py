"""save/rounds.jsonl stays strict JSON: a NaN or infinite metric is never written into it."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from fedcontrast.openfl.records import RoundReport, json_safe, read_records, site_metrics


def strict(text):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def db(rows):
    return pd.DataFrame([{"tensor_name": n, "origin": "agg", "round": 1, "report": True, "tags": ("metric", site),
                          "nparray": np.array(v)} for n, site, v in rows])


def test_non_finite_site_metrics_are_left_out_with_a_warning_naming_the_site(caplog):
    table = db([("evaluate_accuracy", "site_0", 0.75), ("evaluate_loss", "site_0", float("nan")),
                ("evaluate_accuracy", "site_1", float("inf"))])
    with caplog.at_level(logging.WARNING):
        metrics = site_metrics(table, 1, ["site_0", "site_1"], ["evaluate"])
    assert metrics == {"site_0": {"evaluate": {"accuracy": 0.75}}}
    assert "site site_0 reported evaluate_loss = nan" in caplog.text
    assert "site site_1 reported evaluate_accuracy = inf" in caplog.text


def test_a_round_record_with_nan_metrics_is_valid_json(tmp_path, caplog):
    report = object.__new__(RoundReport)  # only what write_record uses: no model, no data
    table = db([("evaluate_accuracy", "site_0", 0.5), ("evaluate_samples", "site_0", 10.0),
                ("evaluate_accuracy", "site_1", float("nan"))])
    report.__dict__.update(out_dir=Path(tmp_path), rounds=2, written=0, sites=["site_0", "site_1"],
                           tensor_db=SimpleNamespace(tensor_db=table),
                           pending={"round": 1, "rounds": 2, "accuracy": float("nan"),
                                    "sites": {"site_1": {"training": {"train_loss": float("-inf")}}}})
    with caplog.at_level(logging.WARNING):
        report.write_record(1)
    [record] = strict((tmp_path / "rounds.jsonl").read_text())
    assert record["accuracy"] is None and record["sites"]["site_1"]["training"]["train_loss"] is None
    assert record["sites"]["site_0"]["evaluation"] == {"accuracy": 0.5, "samples": 10.0}
    assert "evaluation" not in record["sites"]["site_1"] and record["site_accuracy"] == 0.5
    assert "round 1.accuracy is nan; written as null" in caplog.text
    assert read_records(tmp_path) == [record]
    assert json_safe({"a": [1.0, float("nan")], "b": "x"}) == {"a": [1.0, None], "b": "x"}


def _report(tmp_path, table, sent, pending):
    report = object.__new__(RoundReport)  # only what write_record and resume use: no model, no data
    report.__dict__.update(out_dir=Path(tmp_path), rounds=2, written=0, reopened=None, sites=["site_0", "site_1"],
                           tensor_db=SimpleNamespace(tensor_db=table), sent=sent, pending=pending)
    return report


def test_a_record_written_at_a_stop_is_incomplete_and_a_resume_rewrites_it_whole(tmp_path):
    # Issue 21.6: the federation stopped (a full disk) before every site had evaluated model 1; the resumed
    # federation's evaluations of it must not be lost behind the record the stopping aggregator kept.
    pending = {"round": 1, "rounds": 2, "trained_at": 1.0, "withheld": {"site_1": ["train_loss"]},
               "sites": {"site_0": {"samples": 5.0, "training": {"train_loss": 1.0}},
                         "site_1": {"samples": 7.0, "training": {}}}}
    evaluated = {"evaluate": {"site_0": ["evaluate_accuracy", "evaluate_samples"]}}
    stopping = _report(tmp_path, db([("evaluate_accuracy", "site_0", 0.5), ("evaluate_samples", "site_0", 10.0)]),
                       {1: evaluated}, dict(pending))
    stopping.write_record(1)  # SafeAggregator._fail: the last aggregated round's record, as far as it got
    [kept] = read_records(tmp_path)
    assert kept["incomplete"] and kept["not_evaluated"] == ["site_1"] and "evaluation" in kept["sites"]["site_0"]

    for pending_file in (dict(pending), {}):  # the pending file of that round, or none: the record's own half
        resumed = _report(tmp_path, db([("evaluate_accuracy", "site_0", 0.5), ("evaluate_samples", "site_0", 10.0),
                                        ("evaluate_accuracy", "site_1", 0.25), ("evaluate_samples", "site_1", 30.0)]),
                          {1: {"evaluate": {"site_0": [], "site_1": []}}}, pending_file)
        resumed.resume(read_records(tmp_path))
        assert (resumed.written, resumed.reopened) == (0, 1) and resumed.pending == pending
        resumed.write_record(1)
        [record] = strict((tmp_path / "rounds.jsonl").read_text())  # replaced, not appended
        assert "incomplete" not in record and "not_evaluated" not in record
        assert {s: v["evaluation"]["accuracy"] for s, v in record["sites"].items()} == {"site_0": 0.5, "site_1": 0.25}
        assert record["sites"]["site_0"]["training"] == {"train_loss": 1.0} and record["site_accuracy"] == 0.3125
        assert record["withheld"] == {"site_1": ["train_loss"]} and resumed.reopened is None
        resumed.resume(read_records(tmp_path))
        assert (resumed.written, resumed.reopened) == (1, None)  # whole: a later resume leaves it alone
        (tmp_path / "rounds.jsonl").write_text(json.dumps(kept) + "\n")


def test_a_site_silent_at_the_end_of_the_round_is_named_and_the_record_is_final(tmp_path):
    report = _report(tmp_path, db([("evaluate_accuracy", "site_0", 0.5)]),
                     {1: {"evaluate": {"site_0": ["evaluate_accuracy"]}}}, {"round": 1, "rounds": 2})
    report.write_record(1, round_ended=True)  # min_sites let the round end without site_1
    [record] = read_records(tmp_path)
    assert record["not_evaluated"] == ["site_1"] and "incomplete" not in record
    report.resume(read_records(tmp_path))
    assert (report.written, report.reopened) == (1, None)
