"""save/rounds.jsonl stays strict JSON: a NaN or infinite metric is never written into it."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from fedcontrast.openfl.components import RoundReport, json_safe, read_records, site_metrics


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
