"""What the loss tests' float64 numpy references share (a plain helper, no fixtures)."""

import numpy as np


def cosine(a, b):
    """Cosine similarity of two vectors, as a float."""
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
