"""The validation split: each site holds out part of its own training data; the global model is scored
on those parts every round, and the best round is the one they pick, never the test split's."""

import json

import numpy as np
import pytest
import torch

from fedcontrast.construction import load_splits, partition, site_validation, split_site_data
from fedcontrast.evaluation import evaluate_classifier
from fedcontrast.outputs import GLOBAL_SITE, SummaryTally, best_by_validation, metric_row
from fedcontrast.sim import run_simulation
from fedcontrast.sim.federation import Federation


def test_a_site_holds_out_a_stratified_seeded_part_of_its_own_data(tiny_config):
    config = tiny_config.replace(validation_fraction=0.25)
    labels = np.repeat(np.arange(4), [8, 8, 4, 20])  # 40 samples, four classes
    kept, held = site_validation(config, labels, 3)
    assert len(held) == 10 and len(kept) == 30
    assert set(kept).isdisjoint(held) and sorted([*kept, *held]) == list(range(40))
    # stratified: every class gives its share (largest remainders), and keeps training samples
    assert [int((labels[held] == c).sum()) for c in range(4)] == [2, 2, 1, 5]
    again_kept, again_held = site_validation(config, labels, 3)
    assert np.array_equal(held, again_held) and np.array_equal(kept, again_kept)  # every engine draws the same
    _, other = site_validation(config, labels, 4)
    assert not np.array_equal(held, other)  # another site draws its own
    kept0, held0 = site_validation(config.replace(validation_fraction=0.0), labels, 3)
    assert held0.size == 0 and np.array_equal(kept0, np.arange(40))


def test_the_simulators_sites_never_train_on_their_validation_part(tiny_config):
    config = tiny_config.replace(validation_fraction=0.2)
    federation = Federation(config)
    splits = load_splits(config)
    for index, (site, shard) in enumerate(zip(federation.sites, partition(config, splits))):
        whole = splits.train.subset(shard)
        train, validation = split_site_data(config, whole, index)
        assert validation is not None and len(train) + len(validation) == len(whole)
        assert torch.equal(site.data.x.cpu(), train.x) and torch.equal(federation.site_validations[index].x.cpu(),
                                                                         validation.x)
        # no image of the validation part is among the images the site trains on
        trained = {row.numpy().tobytes() for row in train.x.flatten(1)}
        assert not any(row.numpy().tobytes() in trained for row in validation.x.flatten(1))
    assert len(federation.validation) == sum(len(v) for v in federation.site_validations if v is not None)
    assert len(federation.server.labelled) == len(splits.train) - len(federation.validation)


def test_a_deployed_shard_site_holds_out_what_the_simulator_holds_out(tiny_config):
    """OpenFL's and Flower's ``shard:N`` sites build their data with SiteData: the same training and
    validation parts as the simulator's site, so a deployment still equals the simulation."""
    from fedcontrast.site.data import SiteData

    config = tiny_config.replace(validation_fraction=0.2)
    federation = Federation(config)
    for index in range(config.clients):
        data = SiteData(data_path=f"shard:{index}", run_config=config.to_dict())
        assert torch.equal(data.train.x, federation.sites[index].data.x.cpu())
        assert torch.equal(data.validation.y, federation.site_validations[index].y.cpu())


def test_each_round_scores_the_global_model_on_the_validation_parts(tmp_path, tiny_config):
    config = tiny_config.replace(validation_fraction=0.2, rounds=2)
    federation = Federation(config)
    rows = federation.run_round(1)
    glob = next(r for r in rows if r["site"] == GLOBAL_SITE)
    extra = json.loads(glob["extra"])
    from fedcontrast.algorithms import load_weights

    load_weights(federation.server.model, federation.downlink.global_tensors)
    expected = evaluate_classifier(federation.server.model, federation.validation, federation.device)
    assert extra["val_accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert extra["val_loss"] == pytest.approx(expected["loss"], abs=1e-5)

    summary = run_simulation(config.replace(validation_fraction=0.0), tmp_path / "none")
    assert summary["best_round"] is None and summary["best_accuracy"] is None
    assert "never chooses" in summary["best_chosen_by"] and summary["final_accuracy"] is not None


def _rows(test: list[float], validation: list[float | None]) -> list[dict]:
    rows = []
    for r, (t, v) in enumerate(zip(test, validation), start=1):
        metrics = {"accuracy": t} | ({"val_accuracy": v} if v is not None else {})
        rows += [metric_row(r, GLOBAL_SITE, "evaluate", 10, metrics),
                 metric_row(r, "site_0", "train", 30, {"accuracy": 0.5 + r / 10}),
                 metric_row(r, "site_1", "train", 10, {"accuracy": 0.9})]
    return rows


def test_the_best_round_is_the_validation_curves_never_the_test_curves():
    test = [0.50, 0.90, 0.70, 0.80]  # the test curve peaks in round 2
    validation = [0.40, 0.60, 0.85, 0.85]  # validation in round 3 (the first of the tie)
    tally = SummaryTally()
    tally.add(_rows(test, validation))
    summary = tally.summary(config={"algorithm": "fedavg", "dataset": "digits"}, wall_time_s=1.0, rounds_total=4)
    assert summary["best_round"] == 3 and summary["best_val_accuracy"] == 0.85
    assert summary["best_accuracy"] == 0.70  # the test accuracy of round 3's model, not 0.90
    assert summary["final_accuracy"] == 0.80 and summary["final_val_accuracy"] == 0.85
    # the sites' training accuracy in the last round, weighted by their samples: (30·0.9 + 10·0.9) / 40
    assert summary["final_train_accuracy"] == pytest.approx(0.9)
    assert summary["val_accuracy_curve"] == validation


@pytest.mark.parametrize("curve, expected", [
    ([], None), ([None, None], None), ([0.2, float("nan"), 0.1], 0), ([0.1, 0.3, 0.3, 0.2], 1), ([None, 0.5], 1),
])
def test_best_by_validation(curve, expected):
    assert best_by_validation(curve) == expected
