"""Models expose the projected representation separately from the logits, for every encoder."""

import pytest
import torch

from fedcontrast.errors import ConfigError, UnknownNameError
from fedcontrast.models import PredictionHead, build_model


@pytest.mark.parametrize("name,channels,size", [("simple_cnn", 1, 32), ("simple_cnn", 3, 28),
                                                ("simple_cnn", 1, 16), ("resnet18", 3, 32), ("resnet50", 1, 16)])
def test_shapes(name, channels, size):
    model = build_model(name, in_channels=channels, image_size=size, num_classes=7, projection_dim=64)
    x = torch.randn(3, channels, size, size)
    z, logits = model(x)
    assert z.shape == (3, 64) and logits.shape == (3, 7)
    assert torch.allclose(model.represent(x), z)


def test_simple_cnn_is_moons_architecture():
    model = build_model("simple_cnn", in_channels=3, image_size=32, num_classes=10)
    convs = [m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(6, (5, 5)), (16, (5, 5))]
    fcs = [m.out_features for m in model.encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert fcs == [120, 84]
    assert model.projection.net[-1].out_features == 256


def test_prediction_head_has_batchnorm_only_in_hidden_layer():
    head = PredictionHead(32, 16)
    assert sum(isinstance(m, torch.nn.BatchNorm1d) for m in head.modules()) == 1
    assert isinstance(head.net[-1], torch.nn.Linear)
    assert head(torch.randn(4, 32)).shape == (4, 32)


def test_bad_model_settings():
    with pytest.raises(UnknownNameError, match="simple_cnn"):
        build_model("vgg", in_channels=1, image_size=32, num_classes=10)
    with pytest.raises(ConfigError, match="16x16"):
        build_model("simple_cnn", in_channels=1, image_size=8, num_classes=10)


@pytest.mark.parametrize("shape", [(3, 6, 28, 28), (2, 16, 10, 10), (1, 2, 7, 9)])
def test_fast_max_pool_equals_max_pool2d(shape):
    from fedcontrast.models.encoders import MaxPool2x2

    x = torch.randn(*shape)
    with torch.no_grad():  # the fast path
        assert torch.equal(MaxPool2x2()(x), torch.nn.functional.max_pool2d(x, 2))
    xg = x.clone().requires_grad_()
    out = MaxPool2x2()(xg)
    out.sum().backward()
    assert torch.equal(out.detach(), torch.nn.functional.max_pool2d(x, 2))
    assert xg.grad.sum().item() == out.numel()  # one winner per window
