"""FedProx's Synthetic(α, β): reproducible, its own sites and held-out sets, β skews the labels and α
changes nothing of the data, 1,000 sites drawn one site at a time, each sample once, and the settings refused
in one sentence."""

import numpy as np
import pytest

from fedcontrast.config import RunConfig
from fedcontrast.config.datasets import DATASET_NAMES, FedProxSyntheticSettings
from fedcontrast.construction import load_splits, partition, site_test_of
from fedcontrast.data import fedprox_synthetic, load_dataset, partition_counts
from fedcontrast.data.fedprox_synthetic import image_side, make_fedprox_synthetic
from fedcontrast.data.report import format_partition_summary, label_skew
from fedcontrast.errors import ConfigError

SMALL = {"max_site_samples": 120}


def make(sites=20, seed=0, public_fraction=0.1, **settings):
    return make_fedprox_synthetic(FedProxSyntheticSettings(**{**SMALL, **settings}), sites=sites, seed=seed,
                                  test_fraction=0.2, public_fraction=public_fraction)


def skew(data, classes=10):
    return label_skew(partition_counts(data.train[1], list(data.site_train), classes))


def test_registered_by_name():
    assert "fedprox_synthetic" in DATASET_NAMES


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    for x, y in ((a.train, b.train), (a.test, b.test), (a.public, b.public)):
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
    assert [len(p) for p in a.site_train] == [len(p) for p in b.site_train]
    assert a.train[0].shape != c.train[0].shape or not np.array_equal(a.train[0], c.train[0])


def test_a_site_is_the_same_whatever_the_number_of_sites():
    few, many = make(sites=5), make(sites=40)
    for k in range(5):
        assert np.array_equal(few.train[0][few.site_train[k]], many.train[0][many.site_train[k]])
        assert np.array_equal(few.test[1][few.site_test[k]], many.test[1][many.site_test[k]])


def test_each_site_holds_its_own_training_and_test_samples():
    data = make(sites=30, min_site_samples=10)
    train = np.concatenate(data.site_train)
    test = np.concatenate(data.site_test)
    assert np.array_equal(np.sort(train), np.arange(len(data.train[1])))  # every sample one site's
    assert np.array_equal(np.sort(test), np.arange(len(data.test[1])))
    for own, held in zip(data.site_train, data.site_test):
        assert len(own) >= 1 and len(held) >= 1
        assert abs(len(held) / (len(own) + len(held)) - 0.2) < 0.15  # the public tenth comes out of the rest
    assert data.train[0].shape[1:] == (1, 8, 8) and data.train[0].dtype == np.float32
    assert np.all(data.train[0][:, 0].reshape(len(data.train[1]), -1)[:, 60:] == 0)  # 60 features, then zeros
    assert image_side(60) == 8 and image_side(64) == 8 and image_side(65) == 9 and image_side(10) == 8


def test_sizes_follow_a_power_law_with_the_floor_and_cap():
    data = make_fedprox_synthetic(FedProxSyntheticSettings(max_site_samples=2000), sites=400, seed=0,
                                  test_fraction=0.2, public_fraction=0.0)
    sizes = np.array([len(a) + len(b) for a, b in zip(data.site_train, data.site_test)])
    assert sizes.min() >= 50 and sizes.max() <= 2000
    assert np.median(sizes) < sizes.mean() / 2  # heavy tail: a few large sites, many small ones


def test_beta_skews_the_labels_and_alpha_leaves_the_data_as_it_is():
    # Measured at 200 sites (cap 120): label skew 0.79 at β=0, 0.81 at β=1, 0.83 at β=3, for every α.
    skews = {beta: np.mean([skew(make(sites=200, seed=s, alpha=0, beta=beta)) for s in (0, 1)])
             for beta in (0.0, 3.0)}
    assert skews[3.0] > skews[0.0] + 0.02
    low, high = make(sites=100, alpha=0.0, beta=1.0), make(sites=100, alpha=5.0, beta=1.0)
    assert np.array_equal(low.train[0], high.train[0])  # the features never see u_k
    assert np.mean(low.train[1] == high.train[1]) > 0.999  # u_k moves every class's score alike


def test_a_thousand_sites_build_one_draw_per_site_each_sample_once(monkeypatch):
    drawn = []  # the samples of each draw: one per site, nothing drawn twice or thrown away
    draw = fedprox_synthetic._site_samples
    monkeypatch.setattr(fedprox_synthetic, "_site_samples", lambda *a: drawn.append(a[2]) or draw(*a))
    data = make(sites=1000, features=16, max_site_samples=60, public_fraction=0.0)
    assert len(data.site_train) == 1000 and min(len(p) for p in data.site_train) >= 1
    assert len(drawn) == 1000 and sum(drawn) == len(data.train[1]) + len(data.test[1])


def test_load_dataset_gives_images_the_models_take_and_the_sites():
    splits = load_dataset("fedprox_synthetic", sites=12, split_seed=1, settings=SMALL)
    assert splits.train.x.shape[1:] == (1, 16, 16) and splits.num_classes == 10  # simple_cnn's smallest input
    assert len(splits.site_train) == 12 and len(splits.site_test) == 12 and splits.public is not None
    with pytest.raises(ConfigError, match="sites"):
        load_dataset("fedprox_synthetic")
    with pytest.raises(ConfigError,
                       match="dataset_settings apply to fashion_mnist, fedprox_synthetic, mnist, not digits"):
        load_dataset("digits", settings={"alpha": 1})


def test_the_run_takes_its_own_partition_and_held_out_sets():
    config = RunConfig.from_dict({"dataset": "fedprox_synthetic", "clients": 6,
                                  "dataset_settings": {"alpha": 0.5, "beta": 0.5, **SMALL}})
    assert config.partition == "natural"
    assert config.default_name() == "moon-fedprox_synthetic-k6-a0.5b0.5-s0"
    splits = load_splits(config)
    parts = partition(config, splits)
    assert [len(p) for p in parts] == [len(p) for p in splits.site_train]
    held = site_test_of(config, splits, 2, splits.train.y[parts[2]])
    assert len(held) == len(splits.site_test[2])
    assert RunConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()
    back = config.replace(dataset="digits")
    assert back.partition == "dirichlet" and back.dataset_settings == {}
    assert "dataset_settings" not in back.to_dict()
    assert RunConfig().replace(dataset="fedprox_synthetic").partition == "natural"
    summary = format_partition_summary(partition_counts(splits.train.y.numpy(), parts, 10))
    assert "6 sites" in summary and "classes per site" in summary


@pytest.mark.parametrize("data,fragment", [
    ({"dataset": "fedprox_synthetic", "partition": "iid"}, "partition iid does not apply"),
    ({"dataset": "digits", "partition": "natural"}, "digits is split by dirichlet"),
    ({"dataset": "digits", "dataset_settings": {"alpha": 1}}, "not digits"),
    ({"dataset": "fedprox_synthetic", "dataset_settings": {"gamma": 1}}, "unknown fedprox_synthetic dataset"),
    ({"dataset": "fedprox_synthetic", "dataset_settings": {"beta": -1}}, "beta must be"),
    ({"dataset": "fedprox_synthetic", "dataset_settings": {"max_site_samples": 10}}, "max_site_samples"),
])
def test_settings_that_do_not_apply_are_one_sentence(data, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RunConfig.from_dict(data)
