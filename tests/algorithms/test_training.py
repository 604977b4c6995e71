"""The shared local step: gradient clipping against its closed form, and where it applies."""

import math

import pytest
import torch

from fedcontrast.algorithms.training import optimizer_step
from fedcontrast.config import TrainingConfig
from fedcontrast.errors import ConfigError


def _model_with_grads(scale: float) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    grads = [scale * torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    return model, grads


@pytest.mark.parametrize("scale, clip", [(10.0, 1.0), (10.0, 5.0), (0.01, 5.0), (3.0, None), (3.0, 0.0)])
def test_a_step_moves_by_lr_times_the_clipped_gradient(scale, clip):
    """Plain SGD (no momentum, no decay): w ← w − lr · g · min(1, c / ‖g‖), ‖g‖ over every parameter."""
    model, grads = _model_with_grads(scale)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainingConfig(lr=0.1, momentum=0.0, weight_decay=0.0, clip_grad_norm=clip)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    optimizer_step(optimizer, cfg)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    factor = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
    for p, w0, g in zip(model.parameters(), before, grads):
        assert torch.allclose(p.detach(), w0 - 0.1 * factor * g, atol=1e-6)
    if clip and norm > clip:
        moved = math.sqrt(sum(float((p.detach() - w0).pow(2).sum()) for p, w0 in zip(model.parameters(), before)))
        assert moved == pytest.approx(0.1 * clip, rel=1e-4)


def test_no_clipping_where_the_caller_says_so():
    """Under DP-SGD each sample's gradient is clipped by Opacus: the step's own clip is not applied."""
    model, grads = _model_with_grads(10.0)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainingConfig(lr=0.1, momentum=0.0, weight_decay=0.0, clip_grad_norm=1.0)
    optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1), cfg, clip=False)
    for p, w0, g in zip(model.parameters(), before, grads):
        assert torch.allclose(p.detach(), w0 - 0.1 * g, atol=1e-6)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "5"])
def test_a_bad_clip_is_one_sentence(value):
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        TrainingConfig(clip_grad_norm=value)


def test_the_cosine_schedule_of_the_learning_rate_across_rounds():
    from fedcontrast.config import RunConfig

    config = RunConfig(rounds=4, training={"lr": 0.1, "lr_schedule": "cosine"})
    expected = [0.1 * 0.5 * (1 + math.cos(math.pi * (r - 1) / 4)) for r in range(1, 5)]  # 0.1, 0.085, 0.05, 0.015
    assert [config.training_at(r).lr for r in range(1, 5)] == pytest.approx(expected)
    assert config.training_at(5).lr == pytest.approx(expected[-1])  # the final evaluation counts as the last round
    assert config.training_at(2).momentum == config.training.momentum  # only the rate changes
    constant = RunConfig(rounds=4, training={"lr": 0.1, "lr_schedule": "constant"})
    assert all(constant.training_at(r) is constant.training for r in range(1, 6))
    with pytest.raises(ConfigError, match="lr_schedule must be one of constant, cosine"):
        TrainingConfig(lr_schedule="step")


def test_a_site_trains_at_its_rounds_rate_on_every_engine_path():
    """The simulator gives a site's tasks the round's settings (the deployments call the same method)."""
    from fedcontrast.config import RunConfig
    from fedcontrast.sim.federation import Federation

    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, rounds=3, min_samples=5,
                       training={"lr": 0.2, "lr_schedule": "cosine", "local_epochs": 1})
    federation = Federation(config)
    assert [federation.site_context(federation.sites[0], r, 0).training.lr for r in (1, 2, 3)] == pytest.approx(
        [0.2, 0.15, 0.05])


def test_a_scheduled_run_resumes_only_with_its_rounds(tmp_path):
    from fedcontrast.config import RunConfig
    from fedcontrast.errors import CheckpointError
    from fedcontrast.sim import run_simulation

    config = RunConfig(algorithm="fedavg", dataset="synthetic", image_size=16, clients=2, rounds=3, min_samples=5,
                       training={"lr_schedule": "cosine", "local_epochs": 1})
    run_simulation(config, tmp_path, stop_after=1)
    with pytest.raises(CheckpointError, match="cosine schedule over 3 rounds"):
        run_simulation(config.replace(rounds=5), tmp_path, resume=True)
    assert run_simulation(config, tmp_path, resume=True)["rounds_completed"] == 3
