"""Tensors as one Flower record: a site's model crosses Flower as one array (its layout, then its
bytes) instead of one array per tensor. Flower stores and sends every array of a record as objects
of its own, one HTTP request each on every hop (ServerApp → SuperLink → SuperNode → ClientApp, and
back): 29 arrays for MOON's model, one packed. Used by both sides (:mod:`.records` at the operator,
:mod:`.client_app` at a site); imports nothing of fedcontrast.
"""

from __future__ import annotations

from typing import Any

PACKED = "__packed__"  # a packed ArrayRecord's one array: its layout's length and layout, then the tensors' bytes
_LAYOUT = "__layout__"  # the layout apart, as a site or operator of an earlier fedcontrast sends it (still read)


def pack_arrays(arrays: dict[str, Any]):
    """Tensors (numpy) as a Flower ArrayRecord of one array: a 4-byte length, the layout (JSON: names,
    dtypes, shapes), then every tensor's bytes one after another. Flower stores and sends every array
    of a record as objects of its own (the array and its chunks), one request each on every hop: 29
    arrays for MOON's model, one packed."""
    import json

    import numpy as np
    from flwr.app import Array, ArrayRecord

    layout, parts = [], []
    for name, value in arrays.items():
        a = np.asarray(value)
        layout.append([name, a.dtype.str, list(a.shape)])
        parts.append(np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8))
    meta = json.dumps(layout).encode("utf-8")
    head = np.frombuffer(len(meta).to_bytes(4, "little") + meta, dtype=np.uint8)
    return ArrayRecord(array_dict={PACKED: Array.from_numpy_ndarray(np.concatenate([head, *parts]))})


def unpack_arrays(record) -> dict[str, Any]:
    """The tensors (numpy) of an ArrayRecord, packed (:func:`pack_arrays`) or one array each."""
    import json

    import numpy as np

    arrays = dict(record.items())
    if set(arrays) == {PACKED, _LAYOUT}:  # as fedcontrast packed before 2026-11-27: the layout apart
        data, meta, offset = arrays[PACKED].numpy().tobytes(), arrays[_LAYOUT].numpy().tobytes(), 0
    elif set(arrays) == {PACKED}:
        data = arrays[PACKED].numpy().tobytes()
        size = int.from_bytes(data[:4], "little")
        meta, offset = data[4:4 + size], 4 + size
    else:
        return {k: a.numpy() for k, a in arrays.items()}
    out = {}
    for name, dtype, shape in json.loads(meta.decode("utf-8")):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out[name] = np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape).copy()
        offset += count * dt.itemsize
    return out
