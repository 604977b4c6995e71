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
10⁻⁵ of its norm to pass. The sketches are kept in memory (a restarted aggregator checks exact
replays of earlier rounds only, by their saved digests).

Stale uploads: no progress along the global model (``robustness.min_progress``). A fixed radius
leaves a free-rider room: resending its first upload plus noise of 2 × 10⁻⁵ of its norm, or scaled
by 1 ± 10⁻⁴, every round, passes it — while honest uploads never come within 10⁻³ of each other.
What such an upload is, whatever its alteration: it does not follow the global model. An honest
upload ``u_t = w_t + Δ_t`` starts from the global model ``w_t`` the site received, so its distance to
the site's earlier upload ``u_s = w_s + Δ_s`` carries the global model's move ``w_t − w_s`` (the
other sites' work, aggregated) besides the site's own SGD steps; a stale upload stays by its old
one, however far the global model moved. So each accepted upload also keeps the sketch of the global
model its site received (over the upload's model tensors), and an upload is stale when its distance
to an earlier one of the site is below ``min_progress`` × the distance between the global models the
two were made from (the sketch of a difference is the difference of the sketches: one subtraction
per earlier upload). The radius is thus derived from the run's own honest progress — not a constant
—, and falls back to :data:`NEAR_REPLAY` of the upload's norm where the global model did not move.
Measured (every site, every pair of its rounds, the default training, seeds 0–2; digits: FedAvg and
MOON, 3 sites Dir(0.5) and 10 sites Dir(0.1); Fashion-MNIST: FedAvg, 3 sites): an honest upload moved at least
0.54 × the global model's move away from each of its earlier ones (the smallest ratios: where local
training pulls a site back towards its own optimum); the free-rider above 2 × 10⁻⁴ to 3 × 10⁻³ of it.
The default ``min_progress`` 0.1 lies between (benchmarks/free_rider.py, RESULTS.md). A plugin whose uploads do
not start from the received global model (FedSiam-DA's ``local_start: previous``) says so
(``uploads_follow_global`` False): its sites get the fixed radius only.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import torch

from .updates import _weight_names

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
        # the sketch of the global model each upload was made from, over the model tensors ``names``
        # (a row of NaN: not known); 2 KiB more per accepted upload
        self.received = torch.empty(0, BUCKETS, dtype=torch.float64, device="cpu")
        self.names: tuple[str, ...] | None = None

    def add(self, round_num: int, sketch: torch.Tensor, norm: float, names: tuple[str, ...] | None = None,
            received: torch.Tensor | None = None) -> None:
        """``received``: the sketch of the global model the upload was made from, over its model tensors
        ``names`` (:func:`upload_sketch` of those tensors); None when not known."""
        n = self.count
        if n == self.matrix.shape[0]:  # full: twice the room, the rows kept
            cap = max(4, 2 * n)
            self.rounds = torch.cat([self.rounds, self.rounds.new_empty(cap - n)])
            self.matrix = torch.cat([self.matrix, self.matrix.new_empty((cap - n, BUCKETS))])
            self.norms = torch.cat([self.norms, self.norms.new_empty(cap - n)])
            self.received = torch.cat([self.received, self.received.new_empty((cap - n, BUCKETS))])
        self.rounds[n], self.norms[n] = round_num, norm
        self.matrix[n] = sketch
        if received is not None and names and self.names in (None, names):
            self.names = names
            self.received[n] = received
        else:  # not known, or over other tensors than the earlier rows: never compared
            self.received[n] = math.nan
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


class Stale(NamedTuple):
    """An upload found to be a copy of an earlier one of its site (:func:`stale`): that upload's round,
    their distance ``‖s(u) − s(v)‖`` and scale ``max(‖u‖, ‖v‖)``, how far the global model the site
    received moved between the two (``moved``, NaN: not known) and the radius the distance is below
    (``max(NEAR_REPLAY · scale, min_progress · moved)``)."""
    round: int
    distance: float
    scale: float
    moved: float
    radius: float

    @property
    def relative(self) -> float:
        return self.distance / self.scale

    @property
    def by_progress(self) -> bool:
        """The radius is the one derived from the global model's move (not the fixed near-copy radius)."""
        return self.radius > NEAR_REPLAY * self.scale

    def sentence(self, site: str, round_num: int, min_progress: float | None) -> str:
        """The rejection of ``site``'s upload of round ``round_num``, in one sentence."""
        if self.by_progress:
            return (f"site {site!r} sent in round {round_num} an upload within {self.relative:.2g} (relative distance) "
                    f"of the one it sent in round {self.round}, though the global model it received moved "
                    f"{self.moved / self.scale:.2g} since then: it moved {self.distance / self.moved:.2g}× the global "
                    f"model's move, below the plan's min_progress {min_progress:g} (honest uploads follow the global "
                    "model): its earlier upload resent, altered, not fresh work; rejected")
        return (f"site {site!r} sent in round {round_num} an upload within {self.relative:.2g} (relative distance) of "
                f"the one it sent in round {self.round}, below the {NEAR_REPLAY:g} that honest training always "
                "exceeds: a replay altered in its last digits, not fresh work; rejected")


class ReceivedSketches:
    """The sketch of a round's global model over each set of model tensors an upload made from it holds:
    what a stale upload is measured against (:func:`stale`), made once for the sites of a round."""

    def __init__(self) -> None:
        self.reference: tuple[Mapping[str, torch.Tensor], int] | None = None  # the model and its round
        self.kept: dict[tuple[str, ...], torch.Tensor] = {}

    def of(self, upload: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor] | None,
           names: tuple[str, ...] | None = None, round_num: int = 0) -> tuple[tuple[str, ...], torch.Tensor | None]:
        """(``upload``'s model tensors — ``names`` when known —, the sketch of ``reference``, the global
        model of round ``round_num``, over them); no sketch without a reference or model tensors."""
        if not reference:
            return (), None
        names = tuple(_weight_names(upload, reference)) if names is None else tuple(names)
        if not names:
            return (), None
        if self.reference is None or self.reference[0] is not reference or self.reference[1] != round_num:
            self.reference, self.kept = (reference, round_num), {}
        if names not in self.kept:
            self.kept[names] = upload_sketch({n: reference[n] for n in names})[0]
        return names, self.kept[names]


def stale(sketch: tuple[torch.Tensor, float], history: SketchHistory | None, *, received: torch.Tensor | None = None,
          names: tuple[str, ...] | None = None, min_progress: float | None = None,
          skip_round: int | None = None) -> Stale | None:
    """The earlier upload in ``history`` (those of round ``skip_round`` left out) that the upload with
    ``sketch`` stays too near to, or None: nearer than :data:`NEAR_REPLAY` of their norms, or — given
    ``received`` (the sketch of the global model this upload was made from, over the model tensors
    ``names``) and ``min_progress`` — nearer than ``min_progress`` × the distance between that global
    model and the one the earlier upload was made from. Of several, the one with the smallest ratio of
    distance to radius (then the earliest). An all-zero upload is left to its digest."""
    values, norm = sketch
    n = 0 if history is None else history.count
    if not n or not norm > 0 or not torch.isfinite(values).all():
        return None
    assert history is not None
    scales = history.norms[:n].clamp(min=norm)  # max(‖u‖, ‖v‖) for each earlier v
    distances = torch.linalg.vector_norm(history.matrix[:n] - values, dim=1)
    radii = NEAR_REPLAY * scales
    moved = torch.full((n,), math.nan, dtype=torch.float64)
    if received is not None and min_progress and names and names == history.names \
            and bool(torch.isfinite(received).all()):
        moved = torch.linalg.vector_norm(history.received[:n] - received, dim=1)  # NaN rows stay NaN
        radii = torch.where(torch.isfinite(moved), torch.maximum(radii, min_progress * moved), radii)
    near = distances < radii
    if skip_round is not None and skip_round in history.seen:
        near &= history.rounds[:n] != skip_round
    if not bool(near.any()):
        return None
    best = int(torch.where(near, distances / radii, torch.inf).argmin())
    return Stale(int(history.rounds[best]), float(distances[best]), float(scales[best]), float(moved[best]),
                 float(radii[best]))


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
    """What an accepted upload leaves for replay detection: its digest and its sketch (:mod:`.replay`),
    and (its model tensors, the sketch of the global model it was made from over them) when known."""
    digest: str
    sketch: tuple[torch.Tensor, float]
    received: tuple[tuple[str, ...], torch.Tensor | None] = ((), None)
