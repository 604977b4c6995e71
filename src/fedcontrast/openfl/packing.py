"""One float32 vector per direction on the wire, instead of one OpenFL tensor per model tensor.

OpenFL 1.9 keeps every tensor in a pandas table and does several whole-table lookups per tensor,
per site, per round (profiled: about a third of a collaborator's active time at one local epoch).
Packing the plugin's declared tensors, in declaration order, into a single vector makes that one
lookup each way. Everything travels as float32 in OpenFL anyway; unpacking restores each declared
shape and dtype. The plugin and its declarations are unchanged: this is transport only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..algorithms import InvalidUploadError, TensorSpec

GLOBAL_PACKED = "fedcontrast.global"  # the downlink for every site (and the OpenFL "model")
PERSONAL_PACKED = "fedcontrast.personal"  # a site's own downlink
UPLOAD_PACKED = GLOBAL_PACKED  # a site's upload; aggregated into the next round's GLOBAL_PACKED


def packed_size(specs: Sequence[TensorSpec]) -> int:
    return sum(math.prod(s.shape) for s in specs)


def pack(tensors: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> np.ndarray:
    """Concatenate ``tensors`` in the order of ``specs`` into one float32 vector."""
    if not specs:
        return np.zeros(0, dtype=np.float32)
    return torch.cat([tensors[s.name].detach().reshape(-1).to("cpu", torch.float32) for s in specs]).numpy()


def unpack(vector: np.ndarray, specs: Sequence[TensorSpec], *, sender: str = "the aggregator") -> dict[str, torch.Tensor]:
    """Split a packed vector back into the declared tensors (shapes and dtypes restored).

    A vector of the wrong length, or with NaN/inf values, raises :class:`InvalidUploadError`
    naming ``sender`` (e.g. ``"site 'site_1'"``) and the tensor.
    """
    flat = torch.from_numpy(np.array(vector, dtype=np.float32, copy=True)).reshape(-1)
    if flat.numel() != packed_size(specs):
        raise InvalidUploadError(f"{sender} sent {flat.numel()} values where its declaration has "
                                 f"{packed_size(specs)}; rejected")
    out, offset = {}, 0
    for spec in specs:
        n = math.prod(spec.shape)
        part = flat[offset:offset + n]
        if not bool(torch.isfinite(part).all()):
            raise InvalidUploadError(f"{sender} uploaded {spec.name!r} with NaN or infinite values; rejected")
        out[spec.name] = part.reshape(spec.shape).to(getattr(torch, spec.dtype))
        offset += n
    return out
