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


def test_a_sites_local_model_is_scored_on_its_own_held_out_samples():
    """fedprox_synthetic holds out each site's own test samples: a site's local model is scored on
    those (an explicit loop here), not on the shared test split re-weighted to the site's labels."""
    import torch

    from fedcontrast.sim.federation import Federation
    from fedcontrast.tensors import weight_tensors

    config = RunConfig(algorithm="fedavg", dataset="fedprox_synthetic", partition="natural", clients=4, rounds=1,
                       public_fraction=0.0, projection_dim=16, dataset_settings={"max_site_samples": 80},
                       training=TrainingConfig(local_epochs=1, batch_size=32))
    federation = Federation(config, local_evaluation=True)
    model = federation.site_model
    uploads, expected = {}, []
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 10][-1]
    for site, favoured in zip(federation.sites, (7, 8, 5, 3)):  # each model all but predicts one class
        with torch.no_grad():
            head.bias.zero_()
            head.bias[favoured] = 1e4
        uploads[site.name] = weight_tensors(model)
        own = federation.splits.test.subset(federation.splits.site_test[site.index])
        model.eval()
        with torch.no_grad():
            expected.append((model(own.x)[1].argmax(1) == own.y).double().mean().item())  # (z, logits)
    got = federation.local_model_evaluation(uploads)
    mean = sum(expected) / len(expected)
    assert abs(got["local_accuracy"] - mean) < 1e-12 and len(set(expected)) > 1
    assert "local_balanced_accuracy" in got  # the shared test split, as it is
