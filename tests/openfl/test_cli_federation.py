"""The README's main command path: `fedcontrast federation` end to end, then --resume re-reports."""

import json

import torch

from fedcontrast.cli import main


def test_federation_command_runs_and_exports(tmp_path, capsys):
    argv = ["federation", "--collaborators", "2", "--rounds", "2", "--local-epochs", "1", "--min-samples", "5",
            "--runs-dir", str(tmp_path), "--name", "fed", "--timeout", "240"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "fx workspace certify" in err and "round 2/2  global test accuracy" in err
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
