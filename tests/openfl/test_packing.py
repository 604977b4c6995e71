"""The wire format: the declared tensors' bytes in one float32 container, and back, losslessly."""

import numpy as np
import pytest
import torch

from fedcontrast.algorithms import InvalidUploadError, TensorSpec
from fedcontrast.openfl.packing import pack, packed_bytes, packed_size, unpack

SPECS = [TensorSpec("a", (2, 3), "float32", "upload"), TensorSpec("counts", (4,), "int64", "upload"),
         TensorSpec("b", (1,), "float32", "upload")]


def test_round_trip_restores_values_shapes_and_dtypes():
    tensors = {"a": torch.randn(2, 3), "counts": torch.tensor([0, 3, 7, 2**40]), "b": torch.tensor([-1.5])}
    vector = pack(tensors, SPECS)
    assert packed_bytes(SPECS) == 6 * 4 + 4 * 8 + 4
    assert vector.dtype.name == "float32" and vector.shape == (packed_size(SPECS),) == (15,)
    out = unpack(vector, SPECS)
    for spec in SPECS:
        assert out[spec.name].dtype == getattr(torch, spec.dtype)
        assert torch.equal(out[spec.name], tensors[spec.name])  # int64 beyond float32's 2^24, exactly


def test_quantised_tensors_take_their_own_size_on_the_wire():
    specs = [TensorSpec("q", (5, 3), "int8", "upload"), TensorSpec("h", (3,), "float16", "upload"),
             TensorSpec("u", (32,), "uint8", "download")]
    tensors = {"q": torch.randint(-128, 128, (5, 3), dtype=torch.int8),
               "h": torch.tensor([0.5, -2.0, 65504.0], dtype=torch.float16),
               "u": torch.arange(32, dtype=torch.uint8) * 7}
    vector = pack(tensors, specs)
    assert packed_bytes(specs) == 15 + 6 + 32 and vector.nbytes == 56  # padded to whole words
    out = unpack(vector, specs)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_wrong_length_and_non_finite_values_name_the_sender():
    tensors = {"a": torch.zeros(2, 3), "counts": torch.zeros(4, dtype=torch.long), "b": torch.zeros(1)}
    vector = pack(tensors, SPECS)
    with pytest.raises(InvalidUploadError, match="site 'x' sent 14 values where its declaration has 15"):
        unpack(vector[:-1], SPECS, sender="site 'x'")
    vector[-1] = float("inf")  # "b"
    with pytest.raises(InvalidUploadError, match="site 'y' uploaded 'b' with NaN or infinite"):
        unpack(vector, SPECS, sender="site 'y'")
    with pytest.raises(InvalidUploadError, match="float64 vector"):
        unpack(np.zeros(15), SPECS, sender="site 'z'")
