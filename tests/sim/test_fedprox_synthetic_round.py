"""A simulated round on FedProx's Synthetic(α, β) at 200 sites, each site on its own generated samples."""

import csv

from fedcontrast.config import RunConfig, TrainingConfig
from fedcontrast.sim import run_simulation


def test_a_round_at_200_sites(tmp_path):
    config = RunConfig(algorithm="fedavg", dataset="fedprox_synthetic", partition="natural", clients=200, rounds=1,
                       public_fraction=0.0, projection_dim=16,
                       dataset_settings={"alpha": 1.0, "beta": 1.0, "max_site_samples": 60},
                       training=TrainingConfig(local_epochs=1, batch_size=32))
    summary = run_simulation(config, tmp_path / "run")
    assert len(summary["accuracy_curve"]) == 1 and 0 <= summary["final_accuracy"] <= 1
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["site"] != "global"]
    assert len({r["site"] for r in rows}) == 200
