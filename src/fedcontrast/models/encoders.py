"""Base encoders: MOON's simple CNN and CIFAR-style torchvision ResNets.

An encoder maps ``(B, C, H, W)`` images to ``(B, feature_dim)`` features and exposes ``feature_dim``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MaxPool2x2(nn.Module):
    """2×2 max-pooling, stride 2, identical in value to ``nn.MaxPool2d(2)``.

    Without autograd (evaluation, MOON's frozen reference models) it takes the maximum of four
    strided views, which on CPU is over ten times faster than ``max_pool2d``'s NCHW kernel; with
    autograd it uses ``max_pool2d``, whose backward is the faster one.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.max_pool2d(x, 2)
        h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
        rows = torch.maximum(x[..., 0:h:2, :w], x[..., 1:h:2, :w])
        return torch.maximum(rows[..., 0::2], rows[..., 1::2])


class SimpleCNN(nn.Module):
    """MOON's CIFAR-10 base encoder (Li et al. 2021, §4.1), adapted to any input size.

    Two 5×5 convolutions (6 and 16 channels), each followed by ReLU and 2×2 max-pooling, then fully
    connected layers of 120 and 84 units with ReLU. The flattened size is computed from the input
    size, so 28×28 and 32×32 inputs (and anything ≥ 16×16) work unchanged.
    """

    def __init__(self, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(inplace=True), MaxPool2x2(),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), MaxPool2x2(),
        )
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"SimpleCNN needs images of at least 16x16 pixels, got {image_size}x{image_size}")
        self.fc = nn.Sequential(nn.Linear(16 * side * side, 120), nn.ReLU(inplace=True),
                                nn.Linear(120, 84), nn.ReLU(inplace=True))
        self.feature_dim = 84

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.conv(x), 1))  # (B, 84)


class ResNetEncoder(nn.Module):
    """A torchvision ResNet-18/50 adapted to small images, without its classifier.

    As is usual for 32×32 inputs, the 7×7 stride-2 stem and its max-pool are replaced by a 3×3
    stride-1 convolution, so that small images are not reduced to 1×1 before the last stage.
    Weights start random; pre-trained weights are loaded from local files by the caller.
    """

    def __init__(self, arch: str = "resnet18", in_channels: int = 3) -> None:
        super().__init__()
        import torchvision  # imported lazily: the simple CNN path does not need it

        factories = {"resnet18": torchvision.models.resnet18, "resnet50": torchvision.models.resnet50}
        if arch not in factories:
            raise ValueError(f"unknown ResNet architecture {arch!r}; known: {', '.join(factories)}")
        net = factories[arch](weights=None)
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        self.feature_dim = net.fc.in_features
        net.fc = nn.Identity()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, 512) for resnet18, (B, 2048) for resnet50
