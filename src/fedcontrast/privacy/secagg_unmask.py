"""The aggregator's unmasking (:mod:`.secagg_relay` routes the messages): each revealed share checked
against the tree its dealer signed, each secret rebuilt from any t good shares (:func:`rebuild`) and
checked against what its site committed to, the masks removed from the sum (:func:`unmask`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import x25519

from .secagg import (
    Quantizer,
    SecAggSite,
    SecureAggregationError,
    _combine,
    commitment,
    expand,
    leaf,
    merkle_root_of,
    prg,
    s_public,
    share_hash,
)
from .secagg_graph import Graph
from .shamir import PIECE, SHARE_PIECE, decode, on_polynomial

SEARCH_LIMIT = 20_000  # t-subsets tried, at most, for a dealer whose own shares disagree beyond decoding


def rebuild(target: str, what: str, shares: list[tuple[str, int, bytes]], threshold: int,
            valid: Callable[[bytes], bool]) -> tuple[bytes, list[str]]:
    """``target``'s secret from ``shares`` (holder, index, share), every one of them a share
    ``target`` itself signed (its Merkle path checked against ``target``'s signed root:
    :func:`check_reveals`), and the holders of the shares off the polynomial that rebuilds it.

    The secret must pass ``valid`` (the seed's commitment, the key's public half). The first
    ``threshold`` shares rebuild it when ``target`` dealt honestly, and every other share is then
    checked against their polynomial. Otherwise ``target`` signed shares that disagree, and any
    ``threshold`` good ones still rebuild it: Reed–Solomon decoding (Berlekamp–Welch, up to
    ``⌊(m − t)/2⌋`` bad shares among ``m``), else every subset of ``threshold`` shares while there are
    at most :data:`SEARCH_LIMIT`. Raises, naming ``target``, when neither finds it."""
    m = len(shares)
    if m < threshold:
        raise SecureAggregationError(f"only {m} good shares of site {target}'s {what} arrived, fewer than the "
                                     f"threshold {threshold}: the round ends without a sum")
    points = [(i, s) for _, i, s in shares]
    if len({i for i, _ in points}) != m:
        raise SecureAggregationError(f"site {target} signed two shares of its {what} with one index: the round ends "
                                     "without a sum")

    def off(basis: list[tuple[int, bytes]]) -> list[str]:
        inside = set(basis)
        rest = [(h, i, s) for h, i, s in shares if (i, s) not in inside]
        return [h for (h, _, _), on in zip(rest, on_polynomial(basis, [(i, s) for _, i, s in rest])) if not on]

    def attempt(basis: list[tuple[int, bytes]]) -> bytes | None:
        try:
            secret = _combine(basis)
        except ValueError:
            return None
        return secret if valid(secret) else None

    secret = attempt(points[:threshold])
    if secret is not None:
        return secret, off(points[:threshold])
    decoded = decode_shares(points, threshold)
    if decoded is not None and valid(decoded[0]):
        basis = [p for p in points if p[0] in decoded[1]][:threshold]
        return decoded[0], off(basis)
    tried = 0
    if math.comb(m, threshold) <= SEARCH_LIMIT:
        for subset in itertools.combinations(points, threshold):
            tried += 1
            secret = attempt(list(subset))
            if secret is not None:
                return secret, off(list(subset))
        raise SecureAggregationError(
            f"site {target} signed {m} shares of its {what} (revealed by {', '.join(sorted(h for h, _, _ in shares))}) "
            f"and no {threshold} of them rebuild what it committed to: it dealt bad shares (every subset tried); the "
            "round ends without a sum")
    raise SecureAggregationError(
        f"site {target} signed {m} shares of its {what} (revealed by {', '.join(sorted(h for h, _, _ in shares))}) "
        f"that do not rebuild what it committed to, and decoding, which corrects up to {(m - threshold) // 2} bad "
        f"shares, finds no polynomial that does: {target} dealt bad shares; the round ends without a sum")


def decode_shares(points: list[tuple[int, bytes]], threshold: int) -> tuple[bytes, set[int]] | None:
    """The secret that Reed–Solomon decoding of ``points`` (index, share) gives, piece by piece, and
    the indices on every piece's polynomial; None when a piece cannot be decoded."""
    size = len(points[0][1])
    if any(len(s) != size for _, s in points) or size % SHARE_PIECE:
        return None
    secret, on = b"", {i for i, _ in points}
    for h in range(0, size, SHARE_PIECE):
        piece = decode([(i, int.from_bytes(s[h:h + SHARE_PIECE], "big")) for i, s in points], threshold)
        if piece is None or piece[0][0] >= 1 << (8 * PIECE):
            return None
        secret += piece[0][0].to_bytes(PIECE, "big")
        on &= piece[1]
    return (secret, on) if len(on) >= threshold else None


def check_reveals(reveals: dict[str, dict[str, tuple[Any, ...]]], roots: dict[str, bytes],
                  blamed: dict[str, str] | None = None,
                  withheld: dict[str, str] | None = None, left_out: dict[str, list[str]] | None = None,
                  ) -> dict[tuple[str, str], list[tuple[str, int, bytes]]]:
    """The revealed shares (holder → target → (kind, index, share, other share's hash, path), or
    ``("withheld", why)``) whose Merkle path leads to their dealer's signed root (``roots``: dealer →
    root), by (target, kind); a share whose path does not was altered by its holder, who goes into
    ``blamed``; a holder that withheld a dealer's shares goes, with its reason, into ``withheld``
    (holder → sentence; nobody is blamed for what no one can check); ``left_out``: target → what was
    left out of its shares, for the sentence that ends a round."""
    by_target: dict[tuple[str, str], list[tuple[str, int, bytes]]] = {}
    for holder, entries in reveals.items():
        for target, entry in entries.items():
            if left_out is not None:
                left_out.setdefault(target, [])
            if entry[0] == "withheld":
                if left_out is not None:
                    left_out[target].append(f"{holder} withheld its share ({str(entry[1])[:200]})")
                if withheld is not None:
                    withheld[holder] = (withheld.get(holder, "") + "; " if holder in withheld else "") + \
                        f"it withheld its share of site {target}: {str(entry[1])[:200]}"
                continue
            kind, index, share, other, path = entry
            hashes = (share_hash("b", share), other) if kind == "b" else (other, share_hash("s", share))
            root = roots.get(target)
            if root is None or merkle_root_of(leaf(holder, index, *hashes), index - 1, path) != root:
                if left_out is not None:
                    left_out[target].append(f"{holder}'s is not the one {target} dealt it")
                if blamed is not None:
                    what = "self-mask seed" if kind == "b" else "pairwise-mask key"
                    blamed[holder] = (f"its share of site {target}'s {what} is not the one {target} dealt it (not on "
                                      f"{target}'s signed tree); left out")
                continue
            by_target.setdefault((target, kind), []).append((holder, index, share))
    return by_target


def _rebuild_one(site: str, survived: bool, shares: list[tuple[str, int, bytes]], threshold: int,
                 advert: dict[str, bytes]) -> tuple[bytes, list[str]]:
    """A survivor's self-mask seed (checked against its commitment) or a dropped site's pairwise-mask
    key (against its advertised public key) from its good shares (:func:`rebuild`)."""
    if survived:
        def seed_committed(secret: bytes) -> bool:
            return "commit" not in advert or commitment(secret) == advert["commit"]

        return rebuild(site, "self-mask seed", shares, threshold, seed_committed)

    def key_advertised(secret: bytes) -> bool:
        return s_public(expand(secret, b"mask key")) == advert["s_pk"]

    return rebuild(site, "pairwise-mask key", shares, threshold, key_advertised)


def unmask(masked: dict[str, np.ndarray], reveals: dict[str, dict[str, tuple[Any, ...]]],
           adverts: dict[str, dict[str, bytes]], sites: list[str], threshold: int, quantizer: Quantizer,
           blamed: dict[str, str] | None = None, graph: Graph | None = None, *, roots: dict[str, bytes],
           withheld: dict[str, str] | None = None) -> np.ndarray:
    """The sum of the survivors' vectors from their masked vectors (``masked``: survivor → vector) and
    the survivors' reveals (survivor → its :meth:`SecAggSite.reveal`). Each revealed share is checked
    against the tree its dealer signed (``roots``: dealer → root, signatures checked by the caller):
    one that is not on it blames its holder; a dealer whose own signed shares disagree is blamed
    (:func:`rebuild`); blamed senders go into ``blamed`` (site → sentence) and are left out. Every
    rebuilt secret is checked against the advert (``commit`` for a self-mask seed, ``s_pk`` for a
    dropped site's key). ``graph`` (SecAgg+, :mod:`.secagg_graph`): each secret is rebuilt from
    ``graph.threshold`` shares of its site's neighbourhood, and a dropped site's masks removed only
    with its surviving neighbours."""
    survivors = [s for s in sites if s in masked]
    left_out: dict[str, list[str]] = {}
    by_target = check_reveals(reveals, roots, blamed, withheld, left_out)  # (target, kind) → its good shares
    t_shares = threshold if graph is None else graph.threshold
    if len(survivors) < threshold:
        raise SecureAggregationError(f"only {len(survivors)} of {len(sites)} sites sent masked uploads, fewer than the "
                                     f"threshold {threshold}; the round ends without a sum")
    size = next(iter(masked.values())).size
    total = np.zeros(size, dtype=quantizer.unsigned)
    with np.errstate(over="ignore"):
        for site in survivors:
            total = total + masked[site]
        for site in sites:
            survived = site in survivors
            kind = "b" if survived else "s"
            shares = by_target.get((site, kind), [])
            advert = adverts[site]
            try:
                secret, bad = _rebuild_one(site, survived, shares, t_shares, advert)
            except SecureAggregationError as exc:
                if left_out.get(site):
                    raise SecureAggregationError(f"{exc} (left out: {'; '.join(left_out[site])})") from None
                raise
            if bad and blamed is not None:
                blamed[site] = (f"it dealt shares of its {'self-mask seed' if survived else 'pairwise-mask key'} that "
                                f"are not on one polynomial (those it signed for {', '.join(sorted(bad))}); its secret "
                                "was rebuilt from the others")
            if survived:
                total = total - prg(expand(secret, b"self mask"), size, quantizer.unsigned)
                continue
            dropped_key = x25519.X25519PrivateKey.from_private_bytes(expand(secret, b"mask key"))
            for other in (survivors if graph is None else [s for s in survivors if s in graph.closed(site)]):
                # the dropped site's pairwise masks left in the survivors' vectors
                pairwise = prg(SecAggSite._pair_seed(dropped_key, adverts[other]["s_pk"]), size, quantizer.unsigned)
                total = total - pairwise if sites.index(other) < sites.index(site) else total + pairwise
    return quantizer.decode(total)


