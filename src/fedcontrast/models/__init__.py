"""Models: ``build_model(name, ...)`` returns a :class:`ContrastiveNet` with the named encoder.

Models are built on the CPU (their initial weights come from the CPU's RNG, the same whatever device
the run uses, and whatever torch's default device is); the caller moves them to the run's device."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError, UnknownNameError
from .encoders import ResNetEncoder, SimpleCNN
from .heads import PredictionHead, ProjectionHead
from .network import ContrastiveNet

MODEL_NAMES = ("simple_cnn", "resnet18", "resnet50")


def build_encoder(name: str, *, in_channels: int, image_size: int) -> nn.Module:
    """The base encoder called ``name`` for images of ``in_channels × image_size × image_size``, on the CPU."""
    if name == "simple_cnn":
        try:
            with torch.device("cpu"):
                return SimpleCNN(in_channels, image_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if name in ("resnet18", "resnet50"):
        with torch.device("cpu"):
            return ResNetEncoder(name, in_channels)
    raise UnknownNameError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")


def build_model(name: str, *, in_channels: int, image_size: int, num_classes: int,
                projection_dim: int = 256) -> ContrastiveNet:
    """Encoder ``name`` → projection head (output ``projection_dim``) → linear classifier."""
    if projection_dim < 1:
        raise ConfigError(f"projection_dim must be >= 1, got {projection_dim}")
    encoder = build_encoder(name, in_channels=in_channels, image_size=image_size)
    with torch.device("cpu"):
        return ContrastiveNet(encoder, num_classes, projection_dim)


__all__ = ["MODEL_NAMES", "ContrastiveNet", "PredictionHead", "ProjectionHead", "ResNetEncoder",
           "SimpleCNN", "build_encoder", "build_model"]
