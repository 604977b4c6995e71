"""DP-SGD through Opacus wraps the shared training loop; every plugin runs with each DP kind it declares."""

import pytest
import torch

from fedcontrast.algorithms import available_algorithms, get_algorithm
from fedcontrast.config import RunConfig
from fedcontrast.construction import initial_model
from fedcontrast.privacy import history_of
from fedcontrast.sim.federation import Federation

MECHANISMS = {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0},
              "representations": {"noise_multiplier": 1.0, "clip": 1.0}}


def tiny(algorithm, privacy, **changes):
    return RunConfig(algorithm=algorithm, dataset="synthetic", image_size=16, clients=2, rounds=1, min_samples=5,
                     projection_dim=32, public_fraction=0.2, training={"local_epochs": 1, "batch_size": 32},
                     hyperparameters={"fedpcl": {"pretrain_epochs": 1}, "fedssc": {"min_class_samples": 2}},
                     privacy=privacy, **changes)


# fedssc with both kinds at once runs in test_accounting.py
CASES = [(a, k) for a in available_algorithms() for k in sorted(get_algorithm(a).dp_kinds) if a != "fedssc"]


@pytest.mark.parametrize("algorithm,kind", CASES)
def test_every_declared_dp_kind_runs_and_its_uploads_pass_the_checks(algorithm, kind):
    fed = Federation(tiny(algorithm, {kind: MECHANISMS[kind]}))
    fed.run_round(1)  # validates uploads against the declaration and the plugin's check_upload
    count_sigma = fed.config.privacy.count_noise_multiplier
    for site in fed.sites:
        history = [h for h in history_of(site.state) if h != [count_sigma, 1.0, 1]]  # the one-off count release
        kinds = {1.0 if q == 1.0 else "sgd" for _, q, _ in history}
        assert kinds == ({1.0} if kind == "representations" else {"sgd"})
        assert [count_sigma, 1.0, 1] in history_of(site.state)


def test_builtin_dp_declarations():
    assert get_algorithm("fedssc").dp_kinds == {"dp_sgd", "representations"}
    assert get_algorithm("fedpcl").dp_kinds == {"representations"}
    assert get_algorithm("moon").dp_kinds == {"dp_sgd"}
    assert get_algorithm("fedprox").dp_kinds == frozenset()


def test_dp_sgd_noise_moves_the_weights_and_hooks_are_removed():
    def train(sigma):
        fed = Federation(tiny("fedavg", {"dp_sgd": {"noise_multiplier": sigma, "max_grad_norm": 1e-6}}))
        start = {k: v.clone() for k, v in fed.site_model.state_dict().items()}
        fed.run_round(1)
        hooks = sum(len(m._forward_hooks) + len(m._backward_hooks) for m in fed.site_model.modules())
        change = sum((fed.site_model.state_dict()[k] - start[k]).norm() ** 2 for k in start) ** 0.5
        return float(change), hooks

    # Gradients clipped to ~0: what moves the weights is the noise (and weight decay, in the quiet run).
    quiet, hooks = train(0.1)  # the smallest σ a configuration accepts
    loud, _ = train(1e6)  # noise std σC/B = 0.03 per coordinate and step
    assert hooks == 0
    assert loud > 100 * quiet


def test_dp_sgd_replaces_batchnorm_on_every_party():
    config = tiny("moon", {"dp_sgd": MECHANISMS["dp_sgd"]}, model="resnet18")
    model = initial_model(config, in_channels=1, image_size=16, num_classes=10)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "BatchNorm2d" not in kinds and "GroupNorm" in kinds
    again = initial_model(config, in_channels=1, image_size=16, num_classes=10)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
