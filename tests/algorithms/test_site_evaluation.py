"""What a site measures of what it received, on its own held-out data (``evaluate_at_site``), for
every plugin: against an independent computation, and never changing the site's state."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fedcontrast.algorithms import available_algorithms, load_weights
from fedcontrast.algorithms.fedpcl import GLOBAL_PROTOTYPES, LOCAL_SETS, PRESENT
from fedcontrast.algorithms.fedsiam import LOCAL_MODEL
from fedcontrast.config import RunConfig
from fedcontrast.evaluation import evaluate_classifier, linear_probe
from fedcontrast.sim import Federation

SETTINGS = {"fedpcl": {"pretrain_epochs": 2, "projection_hidden": [16]}, "flesd": {"distill_epochs": 1,
                                                                                  "probe_epochs": 10}}


def after_one_round(algorithm: str) -> tuple[Federation, object]:
    config = RunConfig(algorithm=algorithm, dataset="synthetic", clients=2, rounds=1, min_samples=5, seed=1,
                       public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                       hyperparameters={algorithm: SETTINGS[algorithm]} if algorithm in SETTINGS else {})
    federation = Federation(config)
    federation.run_round(1)
    site = federation.sites[0]
    held_out = federation.test.subset(torch.arange(60))  # stands for the site's own test split
    return federation, (federation.site_context(site, 1, 0), federation.downlink.for_site(site.name), held_out)


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_every_plugin_measures_what_it_received_without_changing_the_site(algorithm):
    federation, (ctx, received, test) = after_one_round(algorithm)
    before = copy.deepcopy(ctx.state)
    metrics = federation.algorithm.evaluate_at_site(ctx, received, test)
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert all(isinstance(v, float) for v in metrics.values())
    assert before.keys() == ctx.state.keys()
    for key, value in before.items():  # read, never written
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, ctx.state[key])
        elif isinstance(value, dict):
            assert all(torch.equal(v, ctx.state[key][k]) for k, v in value.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("algorithm", ["fedavg", "moon", "fedssc", "fedprox"])
def test_weight_sharing_plugins_measure_the_received_global_model(algorithm):
    federation, (ctx, received, test) = after_one_round(algorithm)
    model = copy.deepcopy(federation.server.model)
    load_weights(model, federation.downlink.global_tensors)
    # the reference on the device under test (the federation's: CUDA where present), as the site measures
    assert federation.algorithm.evaluate_at_site(ctx, received, test) == evaluate_classifier(model, test,
                                                                                             federation.device)


def test_fedsiam_also_measures_the_sites_own_local_model():
    federation, (ctx, received, test) = after_one_round("fedsiam_da")
    metrics = federation.algorithm.evaluate_at_site(ctx, received, test)
    local = copy.deepcopy(federation.server.model)
    load_weights(local, ctx.state[LOCAL_MODEL])
    assert metrics["local_accuracy"] == evaluate_classifier(local, test, federation.device)["accuracy"]


def test_fedpcl_measures_the_personal_model_by_its_prototypes():
    federation, (ctx, received, test) = after_one_round("fedpcl")
    algorithm = federation.algorithm
    metrics = algorithm.evaluate_at_site(ctx, received, test)
    features = algorithm.features(test, ctx.public, ctx.device)
    head = algorithm.head(ctx, features.shape[1], received[GLOBAL_PROTOTYPES].shape[1]).eval()
    with torch.no_grad():
        z = F.normalize(head(features), dim=1)
    for key, protos in (("accuracy", received[GLOBAL_PROTOTYPES]), ("local_accuracy", received[LOCAL_SETS][0])):
        correct = 0
        for i in range(len(test)):  # an explicit loop: the nearest prototype among the classes that have one
            distances = {c: float(((z[i] - protos[c]) ** 2).sum()) for c in range(len(protos))
                         if received[PRESENT][c] > 0}
            correct += int(min(distances, key=distances.get) == int(test.y[i]))
        assert metrics[key] == pytest.approx(correct / len(test))


def test_flesd_measures_a_linear_probe_on_the_sites_own_labelled_data():
    federation, (ctx, received, test) = after_one_round("flesd")
    metrics = federation.algorithm.evaluate_at_site(ctx, received, test)
    model = copy.deepcopy(federation.server.model)
    load_weights(model, received)
    expected = linear_probe(model.encoder, ctx.data, test, federation.device, epochs=10, module=model)
    assert metrics["accuracy"] == expected["probe_accuracy"]
