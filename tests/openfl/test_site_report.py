"""What a site takes home: its own per-round report (accuracy, training, bytes, ε against its
policy's budget) and the final model, written in its own workspace by the task runner."""

import csv
import json

import pytest
import torch

from fedcontrast.cli import main
from fedcontrast.config import RunConfig
from fedcontrast.construction import initial_model
from fedcontrast.evaluation import evaluate_classifier
from fedcontrast.openfl.loader import SiteDataLoader
from fedcontrast.openfl.packing import GLOBAL_PACKED, pack, unpack
from fedcontrast.openfl.runner import PluginTaskRunner
from fedcontrast.privacy import planned_epsilon
from fedcontrast.privacy.policy import SitePolicy
from fedcontrast.site.report import load_final_model, read_rows, score_final_model

BASE = dict(dataset="synthetic", image_size=16, clients=2, rounds=2, min_samples=5, projection_dim=32,
            public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32})


def run_rounds(config, state_dir, rounds, *, policy=None, input_packed=None):
    """A fresh runner (a restarted collaborator) doing ``rounds`` as OpenFL schedules them: evaluate,
    then the plugin's tasks; the round after the last training round is evaluation only."""
    settings = {"run_config": config.to_dict()}
    loader = SiteDataLoader(data_path="shard:0", **settings)
    loader.site_policy = policy
    runner = PluginTaskRunner(data_loader=loader, state_dir=str(state_dir), **settings)
    inputs = {GLOBAL_PACKED: runner.initial_packed.copy() if input_packed is None else input_packed}
    for round_num in rounds:
        runner.evaluate(col_name="site_0", round_num=round_num, input_tensor_dict=inputs)
        if round_num < config.rounds:
            for task in runner.algorithm.tasks:
                getattr(runner, task)(col_name="site_0", round_num=round_num, input_tensor_dict=inputs)
    return runner, loader


def test_site_report_has_a_row_per_round_with_epsilon_against_the_budget_and_survives_a_restart(tmp_path):
    config = RunConfig(algorithm="fedssc", **BASE, hyperparameters={"fedssc": {"min_class_samples": 2}},
                       privacy={"representations": {"noise_multiplier": 2.0, "clip": 1.0}})
    policy = SitePolicy(max_epsilon=50.0)
    runner, loader = run_rounds(config, tmp_path / "sites", [0, 1], policy=policy)
    run_rounds(config, tmp_path / "sites", [1, 2], policy=policy)  # restarted: round 1 redone, then the final round
    folder = tmp_path / "site_report" / "site_0" / "latest"  # this run's own folder (site/report.py)
    rows = read_rows(folder)
    assert [r["round"] for r in rows] == [0, 1, 2]  # keyed by round: the redone round is not repeated
    planned = planned_epsilon(config.privacy, config.training, n=len(loader.train), rounds=2)
    for row in rows:  # row r: the model after round r (0: the initial one), scored when it came back
        assert row["held_out_samples"] == len(loader.test) and 0.0 <= row["accuracy"] <= 1.0
        assert row["epsilon_budget"] == 50.0
    for row in rows[1:]:  # rounds 1 and 2: the site's own training figures
        assert row["training"]["train_loss"] > 0 and row["bytes_sent"] > runner.initial_packed.nbytes // 100
        assert row["bytes_received"] == runner.initial_packed.nbytes
    # round 1 also released the sample count (once); round 2 the planned per-round figure; spent: the total
    assert rows[1]["epsilon_spent"] == rows[1]["epsilon_round"] < rows[2]["epsilon_spent"]
    assert rows[2]["epsilon_round"] == pytest.approx(planned.per_round, abs=1e-9)
    assert rows[2]["epsilon_spent"] == pytest.approx(planned.total, abs=1e-9)
    assert "training" not in rows[0] and "epsilon_spent" not in rows[0]  # the initial model: no round of its own
    with open(folder / "rounds.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["round"]) for r in table] == [0, 1, 2]
    assert float(table[2]["epsilon_spent"]) == pytest.approx(planned.total, abs=1e-9)
    assert (folder / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("algorithm", ["moon", "fedsiam_da"])
def test_final_model_at_the_site_scores_what_its_report_states(tmp_path, algorithm):
    config = RunConfig(algorithm=algorithm, **BASE)
    runner, loader = run_rounds(config, tmp_path / "sites", [0, 1])
    # the final round's downlink: another model than the initial one
    received = unpack(runner.initial_packed, runner.global_specs)
    generator = torch.Generator().manual_seed(1)
    packed = pack({k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
                   for k, v in received.items()}, runner.global_specs)
    run_rounds(config, tmp_path / "sites", [2], input_packed=packed)
    folder = tmp_path / "site_report" / "site_0" / "latest"  # this run's own folder (site/report.py)
    final = read_rows(folder)[-1]
    assert final["round"] == 2 and final["accuracy"] is not None
    info = json.loads((folder / "final_model.json").read_text())
    assert info["files"]["model"] == "final_model.pt" and info["evaluation"]["accuracy"] == final["accuracy"]
    # a plain state_dict of the run's model, loadable without fedcontrast's helpers
    model = initial_model(config, **loader.shape)
    model.load_state_dict(torch.load(folder / "final_model.pt", weights_only=True))
    assert evaluate_classifier(model, loader.test, torch.device("cpu"))["accuracy"] == final["accuracy"]
    initial = initial_model(config, **loader.shape).state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    loaded, loaded_config, _ = load_final_model(folder)
    assert loaded_config == config
    assert score_final_model(folder, loader.train, loader.test, validation=loader.validation) == final["evaluation"]


def test_report_in_a_site_workspace_shows_the_sites_own_rounds(tmp_path, capsys):
    config = RunConfig(algorithm="moon", **{**BASE, "rounds": 1})
    run_rounds(config, tmp_path / "local_state" / "sites", [0, 1])
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = read_rows(tmp_path / "local_state" / "site_report" / "site_0")
    assert f"site_0, round 1/1 (final model): held-out accuracy {rows[-1]['accuracy']:.4f}" in out
    assert "final_model.pt" in out and "rounds.csv" in out


def test_report_in_a_workspace_without_rounds_says_so(tmp_path, capsys):
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan.yaml").write_text("{}\n")
    assert main(["report", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert err.startswith("fedcontrast: error:") and "no finished round" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "plan")]) == 2  # neither a workspace nor a Flower folder: one sentence
    err = capsys.readouterr().err
    assert err.startswith(f"fedcontrast: error: {tmp_path / 'plan'} is neither an OpenFL workspace") and \
        len(err.strip().splitlines()) == 1
