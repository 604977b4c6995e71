"""One vector per direction on the wire, instead of one OpenFL tensor per model tensor.

OpenFL 1.9 keeps every tensor in a pandas table and does several whole-table lookups per tensor,
per site, per round (profiled: about a third of a collaborator's active time at one local epoch).
Packing the plugin's declared tensors, in declaration order, into a single vector makes that one
lookup each way.

OpenFL moves float32 arrays only, so the container is float32, but what it carries is the raw
little-endian bytes of each tensor in its *declared* dtype, concatenated (padded to a multiple of
4): an int8 or float16 upload costs 1 or 2 bytes per value on the wire, not 4, and every value
arrives bit for bit. The container's float32 view of those bytes is never computed with (it may
hold NaN bit patterns); unpacking reinterprets the bytes, restores shapes and dtypes, and checks
floating-point tensors for NaN/inf. The plugin and its declarations are unchanged: transport only.
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


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * getattr(torch, spec.dtype).itemsize


def packed_bytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of payload the declared tensors take on the wire."""
    return sum(_nbytes(s) for s in specs)


def packed_size(specs: Sequence[TensorSpec]) -> int:
    """Length of the float32 container: the payload rounded up to whole 4-byte words."""
    return -(-packed_bytes(specs) // 4)


def pack(tensors: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> np.ndarray:
    """The bytes of ``tensors`` (each in its declared dtype, in the order of ``specs``) as a float32 vector."""
    if not specs:
        return np.zeros(0, dtype=np.float32)
    parts = []
    for s in specs:
        t = tensors[s.name].detach().to("cpu", getattr(torch, s.dtype)).contiguous().reshape(-1)
        parts.append(t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8, device="cpu"))
    payload = torch.cat(parts)
    pad = (-len(payload)) % 4
    if pad:
        payload = torch.cat([payload, torch.zeros(pad, dtype=torch.uint8, device="cpu")])
    return payload.numpy().view(np.float32).copy()


def unpack(vector: np.ndarray, specs: Sequence[TensorSpec], *,
           sender: str = "the aggregator") -> dict[str, torch.Tensor]:
    """Split a packed vector back into the declared tensors (shapes and dtypes restored).

    A vector of the wrong length, or with NaN/inf values in a floating-point tensor, raises
    :class:`InvalidUploadError` naming ``sender`` (e.g. ``"site 'site_1'"``) and the tensor.
    """
    array = np.ascontiguousarray(np.asarray(vector)).reshape(-1)
    if array.dtype != np.float32:
        raise InvalidUploadError(f"{sender} sent a {array.dtype} vector where fedcontrast packs float32; rejected")
    if array.size != packed_size(specs):
        raise InvalidUploadError(f"{sender} sent {array.size} values where its declaration has "
                                 f"{packed_size(specs)}; rejected")
    raw = torch.from_numpy(array.view(np.uint8).copy())  # OpenFL hands read-only buffers
    out, offset = {}, 0
    for spec in specs:
        n = _nbytes(spec)
        part = raw[offset:offset + n].clone().view(getattr(torch, spec.dtype)).reshape(spec.shape)  # aligned copy
        if part.is_floating_point() and not bool(torch.isfinite(part).all()):
            raise InvalidUploadError(f"{sender} uploaded {spec.name!r} with NaN or infinite values; rejected")
        out[spec.name] = part
        offset += n
    return out
