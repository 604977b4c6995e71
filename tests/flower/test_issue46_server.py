"""Issue 46, item 2 on the Flower deployment's ServerApp (the stand-in grid of test_flower_server.py):
metrics.csv's samples and bytes filled as on the other engines (empty, with the reason, under secure
aggregation), a record of who withheld which metrics, a one-site mean labelled as such, and
``seconds_per_round`` right after ``--resume``."""

from __future__ import annotations

import csv
import json
import time

import pytest

pytest.importorskip("flwr", reason="the Flower engine is the extra [flower] (its own environment)")

from flwr.app import ConfigRecord

from fedcontrast.flower.server_app import FlowerServer, SiteProblem

from .test_flower_server import NODES, SITES, Grid, SecureGrid, StopsAnswering, config, task_identity  # noqa: F401


def metrics(folder):
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_csv_holds_each_sites_samples_and_the_messages_bytes(tmp_path):
    server = FlowerServer(Grid(), config(), tmp_path, NODES, round_timeout=5, start_timeout=5)
    server.run()
    train = [r for r in metrics(tmp_path) if r["task"] == "train"]
    assert {r["site"] for r in train} == set(SITES) and len(train) == 2 * len(SITES)
    weights = server.downlink.global_tensors
    size = sum(v.numel() * v.element_size() for v in weights.values())
    for row in train:  # the count each site released (100 in the stand-in), and what travelled each way
        assert int(row["samples"]) == 100
        assert int(row["bytes_downloaded"]) == size and int(row["bytes_uploaded"]) == size  # it sends back as much
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bytes_uploaded_per_site_per_round"] == size


def test_under_secure_aggregation_a_sites_samples_are_none_with_the_reason(tmp_path):
    from fedcontrast.config import SecureAggregationConfig

    grid = SecureGrid(SecureAggregationConfig(bits=64), {}, {s: 100.0 for s in SITES})
    server = FlowerServer(grid, grid.plan, tmp_path, NODES, round_timeout=5, start_timeout=5,
                          site_keys=grid.registered)
    server.connect()
    server.run_round(1)
    from fedcontrast.outputs import write_metrics_csv

    write_metrics_csv(tmp_path / "metrics.csv", server.rows)
    train = [r for r in metrics(tmp_path) if r["task"] == "train"]
    assert train and all(r["samples"] == "" for r in train)  # inside the secure sum, not known to the operator
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert record["samples"].startswith("under secure aggregation a site's samples field is None")
    # each site's bytes: what it sent for the secure sum, as the round's record counts them
    assert {r["site"]: int(r["bytes_uploaded"]) for r in train} == record["secure_bytes"]
    assert all(int(r["bytes_downloaded"]) > 0 for r in train)


class Withholds(Grid):
    """hosp2's policy keeps its metrics (under DP the default): its replies carry none; the others send theirs."""

    def pull_messages(self, ids):
        replies = super().pull_messages(ids)
        for reply in replies:
            if "outcome" in reply.content:
                outcome = dict(reply.content["outcome"])
                withheld = outcome["site"] == "hosp2"
                outcome["metrics"] = json.dumps({"train": {} if withheld else {"loss": 1.0, "accuracy": 0.5}})
                outcome["evaluation"] = "{}" if withheld else json.dumps({"accuracy": 0.5, "samples": 10.0})
                reply.content["outcome"] = ConfigRecord(outcome)
        return replies


def test_a_record_names_who_withheld_which_metrics(tmp_path, capsys):
    server = FlowerServer(Withholds(), config(), tmp_path, NODES, round_timeout=5, start_timeout=5)
    summary = server.run()
    records = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    for record in records:
        assert list(record["withheld"]) == ["hosp2"]
        assert {"train_loss", "train_accuracy", "evaluate_accuracy", "evaluate_samples"} <= \
            set(record["withheld"]["hosp2"])
    assert "round 1: hosp2 withheld its evaluation and training metrics" in capsys.readouterr().out
    assert "evaluate_accuracy" in summary["final_evaluation_withheld"]["hosp2"]
    from fedcontrast.flower.folders import run_report

    assert any("hosp2 withheld its evaluation and training metrics" in line for line in run_report(tmp_path))


def test_a_mean_over_one_site_is_labelled_as_one_sites(tmp_path, capsys):
    from fedcontrast.flower import server_app
    from fedcontrast.flower.records import CONFIG_KEY

    one = {"hosp1": NODES["hosp1"]}

    class Context:
        run_config = {CONFIG_KEY: json.dumps(config(sites=("hosp1",)).to_dict()), "out-dir": str(tmp_path),
                      "round-timeout": 5, "start-timeout": 5, "site-nodes": json.dumps(one)}

    grid = Grid()
    grid.nodes = one
    server_app.server._main(grid, Context())
    out = capsys.readouterr().out
    assert "sites' held-out accuracy of the model after round 1: 0.5000 (1 site)" in out
    assert "the sites' held-out accuracy of the final model 0.5000 (1 site);" in out
    assert json.loads((tmp_path / "outcome.json").read_text())["final_sites"] == 1


class Slow(Grid):
    """Every train message takes ``SLOW_S`` seconds to answer."""

    def pull_messages(self, ids):
        if any(self.pending.get(m) is not None and self.pending[m].metadata.message_type == "train" for m in ids):
            time.sleep(SLOW_S)
        return super().pull_messages(ids)


class SlowStops(StopsAnswering, Slow):
    pass


SLOW_S = 0.6


def test_seconds_per_round_after_resume_counts_every_round_once(tmp_path):
    plan = config().replace(rounds=3)
    out = tmp_path / "run"
    with pytest.raises(SiteProblem, match="round 2: no answer"):
        FlowerServer(SlowStops(), plan, out, NODES, round_timeout=1, start_timeout=5).run()
    resumed = FlowerServer(Slow(), plan, out, NODES, round_timeout=5, start_timeout=5, resume=True)
    summary = resumed.run()
    assert resumed.timed_rounds == 3  # round 1 (before the stop) and rounds 2, 3 (after it)
    # each of the 3 rounds took at least SLOW_S: the mean is at least that (this part's time over 3 rounds was not)
    assert summary["seconds_per_round"] >= SLOW_S
    assert summary["seconds_per_round"] == pytest.approx(resumed.round_seconds / 3, abs=1e-3)
    assert summary["rounds_this_part"] == 2
