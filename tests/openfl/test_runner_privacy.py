"""Under OpenFL the accountant history lives in the site's state file and survives a restart."""

import pytest
import torch

from fedcontrast.config import RunConfig
from fedcontrast.openfl.loader import SiteDataLoader
from fedcontrast.openfl.packing import GLOBAL_PACKED
from fedcontrast.openfl.runner import PluginTaskRunner
from fedcontrast.privacy import HISTORY_KEY, planned_epsilon


def test_epsilon_accumulates_across_runner_restarts(tmp_path):
    config = RunConfig(algorithm="fedssc", dataset="synthetic", image_size=16, clients=2, rounds=2, min_samples=5,
                       projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                       hyperparameters={"fedssc": {"min_class_samples": 2}},
                       privacy={"representations": {"noise_multiplier": 2.0, "clip": 1.0}})
    settings = {"run_config": config.to_dict()}
    for round_num in range(2):  # a fresh runner each round: a restarted collaborator process
        loader = SiteDataLoader(data_path="shard:0", **settings)
        runner = PluginTaskRunner(data_loader=loader, state_dir=str(tmp_path / "sites"), **settings)
        uploads, _ = runner.train(col_name="site_0", round_num=round_num,
                                  input_tensor_dict={GLOBAL_PACKED: runner.initial_packed.copy()})
        metrics = {k.tensor_name: float(v) for k, v in uploads.items() if "metric" in k.tags}
    state = torch.load(tmp_path / "sites" / "site_0.pt", weights_only=True)
    # round 1 (OpenFL's 0): the release and the sample count (noised once); round 2: the release; all kept
    assert [row[0] for row in state[HISTORY_KEY]] == [1.0, 1.0, 2.0]
    planned = planned_epsilon(config.privacy, config.training, n=len(loader.train), rounds=2)
    assert metrics["train_dp_epsilon"] == pytest.approx(planned.total, abs=1e-9)
    assert metrics["train_dp_epsilon_round"] == pytest.approx(planned.per_round, abs=1e-9)
