"""A checkpoint that lacks what a resume reads is refused in one sentence naming the file, and kept."""

import pytest
import torch

from fedcontrast.cli import main
from fedcontrast.errors import CheckpointError
from fedcontrast.sim import run_simulation
from fedcontrast.sim.checkpoint import load_checkpoint


@pytest.mark.parametrize("drop", ["federation", "rows", "federation.site_states.site_1", "federation.downlink.global"])
def test_checkpoint_missing_keys_is_refused_naming_the_file(tmp_path, tiny_config, drop):
    run = tmp_path / "run"
    run_simulation(tiny_config, run, stop_after=1)
    path = run / "checkpoint.pt"
    data = torch.load(path, weights_only=True)
    *parents, last = drop.split(".")
    node = data
    for key in parents:
        node = node[key]
    del node[last]
    torch.save(data, path)
    saved = path.read_bytes()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert f"checkpoint {path} is incomplete (no {drop})" in str(info.value)
    assert path.read_bytes() == saved


def test_resume_from_an_incomplete_checkpoint_is_one_sentence(tmp_path, capsys):
    argv = ["simulate", "--dataset", "synthetic", "--image-size", "16", "--clients", "2", "--rounds", "2",
            "--local-epochs", "1", "--min-samples", "5", "--public-fraction", "0", "--quiet", "--algorithm", "fedavg",
            "--runs-dir", str(tmp_path), "--name", "r"]
    assert main([*argv, "--rounds", "1"]) == 0
    path = tmp_path / "r" / "checkpoint.pt"
    data = torch.load(path, weights_only=True)
    del data["federation"]["server_state"]
    torch.save(data, path)
    metrics = (tmp_path / "r" / "metrics.csv").read_text()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"checkpoint {path} is incomplete (no federation.server_state)" in err
    assert (tmp_path / "r" / "metrics.csv").read_text() == metrics
