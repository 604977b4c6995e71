"""Near-copies of a site's earlier uploads: a replay changed in its last digits is still a replay.

An exact replay is found by its digest (:func:`~.screen.upload_digest`); a replay with a value changed
by one ULP has another digest. So each accepted upload also leaves a *sketch*: a count sketch of all
its numbers — each value added, with a fixed pseudo-random sign, to one of :data:`BUCKETS` buckets
(seeded by the tensor's name, so every upload of a plan is sketched alike) — and its norm. The sketch
is linear, so the sketch of a difference is the difference of sketches, and for a difference spread
over many values its norm is the difference's norm up to a few per cent (a count sketch preserves
the squared norm in expectation; with 256 buckets the relative spread is about √(2/256) ≈ 9 %); a
change confined to a few values is measured exactly. An upload whose relative distance
``‖s(u) − s(v)‖ / ‖u‖`` to one of the same site's earlier uploads is below :data:`NEAR_REPLAY` is
rejected as a replay.

Why honest sites are not flagged: an honest upload is the result of local training that starts from
the newest global model, so it differs from any of the site's earlier uploads at least by the global
model's moves in between and by its own SGD steps, each of which moves every trained weight by
lr × gradient. Measured on digits (3 sites, 10 rounds, 1 local epoch, seed 0; 135 comparisons each),
the smallest relative distance between a site's upload and any of its earlier ones is 1.2 × 10⁻³
(FedAvg), 4.2 × 10⁻³ (MOON) and 2.4 × 10⁻³ (FedPCL). :data:`NEAR_REPLAY` = 10⁻⁵ is two orders of magnitude below
that, and 80 times float32's relative rounding (1.2 × 10⁻⁷): a replay must be altered by more than
10⁻⁵ of its norm to pass — by then it carries a perturbation rather than a copy, which the update
bounds judge as any other upload. The sketches are kept in memory (a restarted aggregator checks
exact replays of earlier rounds only, by their saved digests).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import torch

BUCKETS = 256
NEAR_REPLAY = 1e-5  # relative L2 distance below which an upload is a near-copy of an earlier one


# (name, numel) → the buckets and signs of a tensor of that name and size: drawn once per process, not
# once per upload (every site of a round uploads the same names); at most CACHED_VALUES values in all
_HASHES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
CACHED_VALUES = 1 << 23


def _hashes(name: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket and sign (±1, float64) of each of ``numel`` values named ``name``: a generator seeded by
    the name, so every upload of a plan is sketched alike."""
    key = (name, numel)
    found = _HASHES.get(key)
    if found is not None:
        return found
    g = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()))
    buckets = torch.randint(0, BUCKETS, (numel,), generator=g, device="cpu")
    signs = torch.randint(0, 2, (numel,), generator=g, dtype=torch.float64, device="cpu") * 2 - 1
    if sum(b.numel() for b, _ in _HASHES.values()) + numel <= CACHED_VALUES:
        _HASHES[key] = (buckets, signs)
    return buckets, signs


def upload_sketch(upload: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """(the count sketch of every number in ``upload``, float64, and the upload's L2 norm).

    The tensors are sketched together: their values, buckets and signs each one vector, in name order,
    added into the buckets by one ``index_add_`` (which adds one value after another, as a call per
    tensor did); the norm is one dot product per tensor, summed in name order."""
    names = [n for n in sorted(upload) if upload[n].numel()]
    sketch = torch.zeros(BUCKETS, dtype=torch.float64, device="cpu")
    if not names:
        return sketch, 0.0
    tensors = [upload[n].detach().to("cpu").reshape(-1) for n in names]
    if all(t.dtype == tensors[0].dtype for t in tensors) and tensors[0].is_floating_point():
        values = torch.cat(tensors).to(torch.float64)  # exact, as each tensor's own conversion
    else:
        values = torch.cat([t.to(torch.float64) for t in tensors])
    buckets, signs = _layout_hashes(tuple((n, t.numel()) for n, t in zip(names, tensors)))
    sketch.index_add_(0, buckets, values * signs)
    squared = 0.0
    for part in values.split([t.numel() for t in tensors]):
        part = part.clone()  # a fresh, aligned copy: the dot product groups its terms as on the tensor alone
        squared += float(part.dot(part))
    return sketch, squared ** 0.5


_LAYOUTS: dict[tuple[tuple[str, int], ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _layout_hashes(layout: tuple[tuple[str, int], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The buckets and signs of an upload of these (name, numel), one after another (:func:`_hashes`)."""
    found = _LAYOUTS.get(layout)
    if found is not None:
        return found
    parts = [_hashes(name, numel) for name, numel in layout]
    joined = torch.cat([b for b, _ in parts]), torch.cat([s for _, s in parts])
    if sum(n for _, n in layout) * 2 <= CACHED_VALUES and len(_LAYOUTS) < 8:
        _LAYOUTS[layout] = joined
    return joined


class SketchHistory:
    """One site's accepted uploads' sketches, the rows of one matrix (grown by doubling), with their
    norms and rounds: a new upload is compared with every earlier one in a few operations, whatever
    the number of rounds (a list of sketches stacked again for each comparison cost a round's worth
    more each round). 2 KiB per accepted upload, kept in memory."""

    def __init__(self) -> None:
        self.count = 0
        self.seen: set[int] = set()  # the rounds among the rows
        self.rounds = torch.empty(0, dtype=torch.int64, device="cpu")  # on the CPU, as the sketches
        self.matrix = torch.empty(0, BUCKETS, dtype=torch.float64, device="cpu")
        self.norms = torch.empty(0, dtype=torch.float64, device="cpu")

    def add(self, round_num: int, sketch: torch.Tensor, norm: float) -> None:
        n = self.count
        if n == self.matrix.shape[0]:  # full: twice the room, the rows kept
            cap = max(4, 2 * n)
            self.rounds = torch.cat([self.rounds, self.rounds.new_empty(cap - n)])
            self.matrix = torch.cat([self.matrix, self.matrix.new_empty((cap - n, BUCKETS))])
            self.norms = torch.cat([self.norms, self.norms.new_empty(cap - n)])
        self.rounds[n], self.norms[n] = round_num, norm
        self.matrix[n] = sketch
        self.count = n + 1
        self.seen.add(round_num)


def nearest(sketch: tuple[torch.Tensor, float], history: SketchHistory | None, skip_round: int | None = None
            ) -> tuple[int, float] | None:
    """(the round, relative distance) of the earlier upload in ``history`` (those of round
    ``skip_round`` left out) nearest to ``sketch`` when that distance is below :data:`NEAR_REPLAY`;
    None otherwise (or when the upload is all zeros: only its digest counts). Every earlier sketch is
    compared at once (one distance per row of the history's matrix); of equal distances the earliest."""
    values, norm = sketch
    n = 0 if history is None else history.count
    if not n or not torch.isfinite(values).all():
        return None
    assert history is not None
    scales = history.norms[:n].clamp(min=norm)  # max(‖u‖, ‖v‖) for each earlier v
    distances = torch.linalg.vector_norm(history.matrix[:n] - values, dim=1) / scales
    near = distances < NEAR_REPLAY  # a scale of 0 (both all zeros) gives NaN: never near
    if skip_round is not None and skip_round in history.seen:
        near &= history.rounds[:n] != skip_round
    if not bool(near.any()):
        return None
    best = int(torch.where(near, distances, torch.inf).argmin())
    return int(history.rounds[best]), float(distances[best])


def upload_digest(upload: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of an upload's names and bytes (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(upload):
        t = upload[name].detach().to("cpu").contiguous()
        h.update(name.encode() + b"\0" + str(t.dtype).encode() + b"\0" + str(tuple(t.shape)).encode() + b"\0")
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # its bytes, without a copy
    return h.hexdigest()


class ReplayMark(NamedTuple):
    """What an accepted upload leaves for replay detection: its digest and its sketch (:mod:`.replay`)."""
    digest: str
    sketch: tuple
