"""Tensors as one Flower record: a site's model crosses Flower as two arrays (its bytes and its
layout) instead of one array per tensor. Flower stores and sends every array of a record as objects
of its own, one HTTP request each on every hop (ServerApp → SuperLink → SuperNode → ClientApp, and
back): 29 objects for MOON's model, 5 packed. Used by both sides (:mod:`.records` at the operator,
:mod:`.client_app` at a site); imports nothing of fedcontrast.
"""

from __future__ import annotations

from typing import Any

PACKED, LAYOUT = "__packed__", "__layout__"  # a packed ArrayRecord: every tensor's bytes; names, dtypes, shapes


def pack_arrays(arrays: dict[str, Any]):
    """Tensors (numpy) as a Flower ArrayRecord of two arrays: their bytes, one after another, and
    their layout (JSON). Flower stores and sends every array of a record as objects of its own, one
    request each on every hop (ServerApp → SuperLink → SuperNode → ClientApp, and back): 29 for
    MOON's model, 5 packed."""
    import json

    import numpy as np
    from flwr.app import Array, ArrayRecord

    layout, parts = [], []
    for name, value in arrays.items():
        a = np.asarray(value)
        layout.append([name, a.dtype.str, list(a.shape)])
        parts.append(np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8))
    packed = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    meta = np.frombuffer(json.dumps(layout).encode("utf-8"), dtype=np.uint8)
    return ArrayRecord(array_dict={LAYOUT: Array.from_numpy_ndarray(meta), PACKED: Array.from_numpy_ndarray(packed)})


def unpack_arrays(record) -> dict[str, Any]:
    """The tensors (numpy) of an ArrayRecord, packed (:func:`pack_arrays`) or one array each."""
    import json

    import numpy as np

    arrays = dict(record.items())
    if set(arrays) != {PACKED, LAYOUT}:
        return {k: a.numpy() for k, a in arrays.items()}
    data = arrays[PACKED].numpy().tobytes()
    out, offset = {}, 0
    for name, dtype, shape in json.loads(arrays[LAYOUT].numpy().tobytes().decode("utf-8")):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out[name] = np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape).copy()
        offset += count * dt.itemsize
    return out
