"""The common shape in which every source hands over its images."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RawData:
    """Images and labels as read from a source, before resizing, splitting and normalisation.

    ``test_x``/``test_y`` are ``None`` when the source has no official test split.
    """

    train_x: np.ndarray  # (N, C, H, W), uint8 or float
    train_y: np.ndarray  # (N,) int64
    test_x: np.ndarray | None
    test_y: np.ndarray | None
    class_names: tuple[str, ...]
