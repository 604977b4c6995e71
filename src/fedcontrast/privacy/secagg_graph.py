"""Who masks with whom: SecAgg+'s neighbourhoods (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead").

Above a few dozen sites each site masks pairwise only with its ``k`` neighbours on a random
``k``-regular graph and Shamir-shares its self-mask seed and its mask key only among them (and
itself), threshold ``t_k``: the sharing, masking and unmasking grow with ``k``, not with the number of
sites. The graph is Bell et al.'s random Harary graph: the sites on a ring in a random order, each
joined to the ``k/2`` nearest on either side.

**No party draws the graph.** Every site commits, in its signed advert, to 32 random bytes; once
the relay has fixed which adverts are in the round and sent every site their commitments, each site
reveals its bytes, and the round's seed is :func:`graph_seed` of all of them (a site that keeps its
bytes ends the round). SHA-256 over the seed, the round, the sites and ``k`` keys a ChaCha20 keystream,
turned into the ring's order by Fisher–Yates with rejection sampling (uniform, no modulo bias).
Until the last honest site reveals nobody knows the graph, and then nobody can change it: no one,
the operator included, can choose a graph or search for one offline (:mod:`.secagg_protocol`). Each
site checks every set the relay sends against its own neighbourhood.

**The rule** (:func:`neighbourhood_size`): ``k = 2·⌈3·log2 n⌉`` (``NEIGHBOUR_FACTOR`` = 3: n = 100:
40; n = 1000: 60); the full graph — Bonawitz et al.'s protocol, unchanged — whenever that leaves a
site with more than half the others as neighbours (``n ≤ 2k + 1``, below about 80 sites) or when
the plan says ``neighbours: full``. ``t_k = ⌊2(k+1)/3⌋ + 1`` of the ``k + 1`` holders of a site's
shares, Bonawitz et al.'s two thirds applied to a neighbourhood (:func:`neighbourhood_threshold`).
What this tolerates, with what failure probability, is in docs/privacy.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from ..config.sections import default_threshold

NEIGHBOUR_FACTOR = 3  # k = 2·⌈NEIGHBOUR_FACTOR·log2 n⌉


def neighbourhood_size(sites: int, setting: str | int = "auto") -> int:
    """``k``, the neighbours of each site for a round of ``sites`` sites under the plan's
    ``neighbours`` setting (``auto``, ``full`` or an even number); ``sites − 1``: the full graph."""
    full = sites - 1
    if setting == "full" or sites < 3:
        return full
    k = 2 * math.ceil(NEIGHBOUR_FACTOR * math.log2(sites)) if setting == "auto" else int(setting)
    return full if 2 * k + 1 >= sites else k


def neighbourhood_threshold(k: int) -> int:
    """``t_k``: the shares (of the ``k + 1`` a site's neighbourhood and the site itself hold) that
    rebuild one of its secrets: ``⌊2(k+1)/3⌋ + 1``."""
    return default_threshold(k + 1)


def _words(key: bytes) -> Iterator[int]:
    """32-bit words of ChaCha20's keystream under ``key`` (32 bytes), without end."""
    encryptor = Cipher(algorithms.ChaCha20(key, b"\0" * 16), mode=None).encryptor()
    while True:
        block = encryptor.update(b"\0" * 4096)
        for i in range(0, len(block), 4):
            yield int.from_bytes(block[i:i + 4], "little")


def graph_seed(session: bytes, round_num: int, randomness: dict[str, bytes]) -> bytes:
    """The seed a round's graph is drawn from: SHA-256 over the session, the round and every site's
    revealed randomness (site → 32 bytes, each committed to in its advert before any was revealed)."""
    return hashlib.sha256(json.dumps(["fedcontrast secagg+ graph seed", session.hex(), int(round_num),
                                      sorted([site, value.hex()] for site, value in randomness.items())],
                                     separators=(",", ":")).encode()).digest()


def ring(sites: list[str], session: bytes, round_num: int, k: int) -> list[str]:
    """The sites in the ring's order of ``round_num``: a permutation drawn by Fisher–Yates from the
    keystream keyed by SHA-256(protocol, session, round, sites, k), each draw by rejection sampling."""
    seed = hashlib.sha256(json.dumps(["fedcontrast secagg+ graph", session.hex(), int(round_num), list(sites), int(k)],
                                     separators=(",", ":")).encode()).digest()
    words, order = _words(seed), list(sites)
    for i in range(len(order) - 1, 0, -1):
        span = i + 1
        limit = (1 << 32) - (1 << 32) % span  # words at or above it would favour the low residues
        word = next(words)
        while word >= limit:
            word = next(words)
        j = word % span
        order[i], order[j] = order[j], order[i]
    return order


@dataclass(frozen=True)
class Graph:
    """One round's graph over ``sites`` (the plan's order): ``around[s]`` is ``s``'s closed
    neighbourhood (itself and its neighbours), ``threshold`` the shares that rebuild one of a site's
    secrets (``t_k``; the plan's threshold in the full graph), ``k`` the degree."""

    sites: tuple[str, ...]
    k: int
    threshold: int
    around: dict[str, frozenset[str]]

    @property
    def full(self) -> bool:
        return self.k >= len(self.sites) - 1

    def closed(self, site: str) -> frozenset[str]:
        return self.around[site]

    def holders(self, target: str, members: list[str]) -> list[str]:
        """Those of ``members`` that hold ``target``'s shares, in order: the x-coordinate of a holder's
        share is its place here + 1."""
        mine = self.around[target]
        return [s for s in members if s in mine]


def graph_for(sites: list[str], threshold: int, setting: str | int, session: bytes, round_num: int) -> Graph:
    """The graph of a round of ``sites`` (plan order) with the plan's ``threshold`` and ``neighbours``
    ``setting``; the full graph keeps the plan's threshold for the shares, as before. (Kept for the
    last few rounds: the simulator's parties, all in one process, draw the same graph once.)"""
    return _graph(tuple(sites), threshold, setting, session, round_num)


@lru_cache(maxsize=8)
def _graph(sites: tuple[str, ...], threshold: int, setting: str | int, session: bytes, round_num: int) -> Graph:
    n = len(sites)
    k = neighbourhood_size(n, setting)
    if k >= n - 1:
        everyone = frozenset(sites)
        return Graph(tuple(sites), n - 1, threshold, {s: everyone for s in sites})
    order = ring(list(sites), session, round_num, k)
    place = {s: i for i, s in enumerate(order)}
    around = {s: frozenset(order[(place[s] + d) % n] for d in range(-(k // 2), k // 2 + 1)) for s in sites}
    return Graph(tuple(sites), k, neighbourhood_threshold(k), around)


def _tail(k: int, p: float, at_least: int) -> float:
    return sum(math.comb(k, i) * p**i * (1 - p) ** (k - i) for i in range(max(at_least, 0), k + 1))


def failure_bounds(sites: int, k: int, colluding: float = 0.05, dropping: float = 0.05) -> dict[str, float]:
    """Per round, union-bounded over the sites, with a ``colluding`` fraction of the sites and a
    ``dropping`` one fixed independently of the graph (docs/privacy.md): the probability that an
    operator following the protocol can rebuild both secrets of an honest site (``t_k`` colluding
    neighbours), that one lying about dropouts can (``2t_k − k − 1``), and that the round fails
    (a site with more than ``k + 1 − t_k`` of its holders gone)."""
    t = neighbourhood_threshold(k)
    return {"follows": min(1.0, sites * _tail(k, colluding, t)),
            "lies": min(1.0, sites * _tail(k, colluding, 2 * t - k - 1)),
            "fails": min(1.0, sites * _tail(k, dropping, k + 2 - t))}
