"""A site's state file under OpenFL: a task redone after a crash starts from the state of its first
attempt, one process per collaborator name, and a corrupt file ends the collaborator in one sentence."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcontrast.config import RunConfig
from fedcontrast.errors import CheckpointError
from fedcontrast.openfl.loader import SiteDataLoader
from fedcontrast.openfl.packing import GLOBAL_PACKED
from fedcontrast.openfl.protocol import CollaboratorStopped
from fedcontrast.openfl.runner import PluginTaskRunner

CONFIG = RunConfig(algorithm="moon", dataset="synthetic", image_size=16, clients=2, rounds=3, min_samples=5,
                   projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32})
SETTINGS = {"run_config": CONFIG.to_dict()}


def make_runner(state_dir):
    """A fresh runner, as a (re)started collaborator process builds it."""
    loader = SiteDataLoader(data_path="shard:0", **SETTINGS)
    return PluginTaskRunner(data_loader=loader, state_dir=str(state_dir), **SETTINGS)


def train(runner, round_num):
    uploads, _ = runner.train(col_name="site_0", round_num=round_num,
                              input_tensor_dict={GLOBAL_PACKED: runner.initial_packed.copy()})
    return {k.tensor_name: v for k, v in uploads.items()}


def test_a_round_redone_after_a_crash_starts_from_the_state_of_its_first_attempt(tmp_path):
    runner = make_runner(tmp_path / "uninterrupted")
    expected = [train(runner, r) for r in range(3)]
    final = torch.load(tmp_path / "uninterrupted" / "site_0.pt", weights_only=True)

    sites = tmp_path / "crashed"
    runner = make_runner(sites)
    train(runner, 0)
    train(runner, 1)  # saved its state, then crashed before its upload reached the aggregator
    redone = [train(make_runner(sites), 1), train(make_runner(sites), 2)]  # restarted: round 1 again
    for got, want in zip(redone, expected[1:]):
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in want)  # bit for bit: MOON's previous model too
    state = torch.load(sites / "site_0.pt", weights_only=True)
    assert state.keys() == final.keys() and all(torch.equal(state[k][w], final[k][w]) for k in final for w in final[k])
    # only the state that the last round (OpenFL's 2, the third) started from is kept besides the latest
    assert sorted(p.name for p in sites.iterdir()) == ["site_0.lock", "site_0.pt", "site_0.round3.train.pt"]


HOLDER = """
import sys
from tests.openfl.test_site_state import make_runner, train
train(make_runner(sys.argv[1]), 0)  # a collaborator process named site_0, still running
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_second_process_with_the_same_collaborator_name_is_refused(tmp_path):
    sites = tmp_path / "sites"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(sites)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert holder.stdout.readline().strip() == "holding"
        before = sorted(p.name for p in sites.iterdir())
        runner = make_runner(sites)
        with pytest.raises(CollaboratorStopped) as info:
            train(runner, 0)
        assert str(info.value) == (f"fedcontrast collaborator: error: another collaborator process named site_0 is "
                                   f"running in this workspace (pid {holder.pid}); stop it before starting this one")
        assert sorted(p.name for p in sites.iterdir()) == before  # it touched nothing
    finally:
        holder.communicate("\n", timeout=60)
    assert train(runner, 1)  # the other one is gone: this one may run


@pytest.mark.parametrize("content,problem", [(b"not a state file", "UnpicklingError"),
                                               ([1.0, 2.0], "it holds a list, not a site's state")])
def test_a_corrupt_state_file_is_named_in_one_sentence_and_kept(tmp_path, content, problem):
    sites = tmp_path / "sites"
    sites.mkdir()
    path = sites / "site_0.pt"
    path.write_bytes(content) if isinstance(content, bytes) else torch.save(content, path)
    before = path.read_bytes()
    runner = make_runner(sites)
    with pytest.raises(CheckpointError) as info:  # SafeCollaborator ends the process with this one sentence
        train(runner, 0)
    assert str(info.value) == (f"this site's state file {path} is corrupt ({problem}); move it away to start the "
                               "site afresh")
    assert path.read_bytes() == before and sorted(p.name for p in sites.iterdir()) == ["site_0.lock", "site_0.pt"]
