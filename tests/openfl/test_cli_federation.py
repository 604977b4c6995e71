"""The README's main command path: `fedcontrast federation` end to end, then --resume re-reports."""

import json

import torch

from fedcontrast.cli import main


def test_federation_command_runs_and_exports(tmp_path, capsys):
    argv = ["federation", "--collaborators", "2", "--rounds", "2", "--local-epochs", "1", "--min-samples", "5",
            "--runs-dir", str(tmp_path), "--name", "fed", "--timeout", "240"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "the federation's CA: CN=fed fedcontrast CA" in err and "round 2/2  global test accuracy" in err
    assert "sites' held-out accuracy site_0" in err and "site_1" in err and "weighted mean" in err
    run = tmp_path / "fed"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and 0 <= summary["final_accuracy"] <= 1
    assert set(summary["final_site_accuracy"]) == {"site_0", "site_1"}
    assert 0 <= summary["final_site_accuracy_mean"] <= 1
    header = (run / "rounds.csv").read_text().splitlines()[0]
    assert header == "round,accuracy,loss,site_accuracy,site_0_accuracy,site_1_accuracy"
    state = torch.load(run / "final_model.pt", weights_only=True)
    assert "classifier.weight" in state
    assert (run / "accuracy.png").exists() and (run / "rounds.csv").exists()
    # Rerunning the same command refuses to clobber it; --resume re-reports the finished federation.
    assert main(argv) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    assert "already finished" in capsys.readouterr().out


def test_a_federation_whose_aggregator_lost_a_round_end_is_not_reported_as_finished(tmp_path, monkeypatch):
    """The aggregator's database moved past round 2, but its round end (model export, record) failed
    on a full disk: every party then exits 0 at once on --resume. Say so, do not export round 1's model."""
    import subprocess
    import sys

    import pytest

    from fedcontrast.openfl import launch
    from fedcontrast.openfl.plan import create_workspace

    from .conftest import small_config

    ws = create_workspace(tmp_path / "ws", small_config(rounds=2), log=lambda m: None)
    (ws / "save" / "rounds.jsonl").write_text(
        json.dumps({"round": 1, "rounds": 2, "trained_at": 1.0, "sites": {}}) + "\n"
        + json.dumps({"round": 2, "rounds": 2, "sites": {}}) + "\n")  # round 2's training half never written
    monkeypatch.setattr(launch, "start", lambda *args, **kwargs: subprocess.Popen([sys.executable, "-c", ""]))
    with pytest.raises(launch.FederationFailed) as info:
        launch.run_federation(ws, timeout=60)
    assert "the aggregator never wrote the results of round(s) 2" in str(info.value)
    assert "full disk" in str(info.value) and "--overwrite" in str(info.value)
