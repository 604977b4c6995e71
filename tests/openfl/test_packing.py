"""The wire format: packing the declared tensors into one float32 vector and back is lossless."""

import pytest
import torch

from fedcontrast.algorithms import InvalidUploadError, TensorSpec
from fedcontrast.openfl.packing import pack, packed_size, unpack

SPECS = [TensorSpec("a", (2, 3), "float32", "upload"), TensorSpec("counts", (4,), "int64", "upload"),
         TensorSpec("b", (1,), "float32", "upload")]


def test_round_trip_restores_values_shapes_and_dtypes():
    tensors = {"a": torch.randn(2, 3), "counts": torch.tensor([0, 3, 7, 16_000_000]), "b": torch.tensor([-1.5])}
    vector = pack(tensors, SPECS)
    assert vector.dtype.name == "float32" and vector.shape == (packed_size(SPECS),) == (11,)
    out = unpack(vector, SPECS)
    for spec in SPECS:
        assert out[spec.name].dtype == getattr(torch, spec.dtype)
        assert torch.equal(out[spec.name], tensors[spec.name])


def test_wrong_length_and_non_finite_values_name_the_sender():
    tensors = {"a": torch.zeros(2, 3), "counts": torch.zeros(4, dtype=torch.long), "b": torch.zeros(1)}
    vector = pack(tensors, SPECS)
    with pytest.raises(InvalidUploadError, match="site 'x' sent 10 values where its declaration has 11"):
        unpack(vector[:-1], SPECS, sender="site 'x'")
    vector[7] = float("inf")  # inside "counts"
    with pytest.raises(InvalidUploadError, match="site 'y' uploaded 'counts' with NaN or infinite"):
        unpack(vector, SPECS, sender="site 'y'")
