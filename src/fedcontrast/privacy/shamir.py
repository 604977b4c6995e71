"""Shamir's t-of-n secret sharing over the prime field GF(2^130 − 5), for secure aggregation's
dropout recovery (:mod:`.secagg`).

A 16-byte piece of a secret is a polynomial's value at 0, its other ``t − 1`` coefficients uniform in
the field (``secrets``: the operating system's CSPRNG); a share is the polynomial's value at the
share's index. Any ``t`` shares rebuild the piece by Lagrange's formula; any ``t − 1`` are uniformly
distributed whatever the secret. The textbook construction in Python integers: pycryptodome's
GF(2^128) scheme, used before, spent two thirds of a site's protocol work in its pure-Python field
multiply. Tested against an independent solve of the shares' linear system (Gauss–Jordan).
"""

from __future__ import annotations

import secrets
from functools import lru_cache

# FIELD = 2^130 − 5 (prime, Poly1305's) is a convenient prime above every 16-byte value: a share is
# 17 bytes per 16 of secret.
FIELD = 2 ** 130 - 5
PIECE, SHARE_PIECE = 16, 17  # a secret's piece and its share's, in bytes


def share_size(secret_bytes: int) -> int:
    """The bytes of one share of a ``secret_bytes``-byte secret."""
    return secret_bytes // PIECE * SHARE_PIECE


def split(secret: bytes, t: int, n: int) -> list[tuple[int, bytes]]:
    """A 32- or 16-byte secret as ``n`` shares (index 1 … n, 17 bytes per 16 of secret), any ``t`` of
    which rebuild it and any ``t − 1`` of which say nothing about it (each piece's polynomial has
    ``t − 1`` uniformly random coefficients above its constant term, the piece)."""
    if not 1 <= t <= n or len(secret) % PIECE:
        raise ValueError(f"cannot share a {len(secret)}-byte secret {t} of {n}")
    pieces = []
    for h in range(0, len(secret), PIECE):
        coefficients = [int.from_bytes(secret[h:h + PIECE], "big")]
        coefficients += [secrets.randbelow(FIELD) for _ in range(t - 1)]
        coefficients.reverse()  # Horner's rule, highest degree first
        values = []
        for x in range(1, n + 1):
            y = 0
            for a in coefficients:
                y = (y * x + a) % FIELD
            values.append(y.to_bytes(SHARE_PIECE, "big"))
        pieces.append(values)
    return [(x, b"".join(parts)) for x, parts in enumerate(zip(*pieces), 1)]


def combine(shares: list[tuple[int, bytes]]) -> bytes:
    """The secret that ``shares`` (index, 17 bytes per 16 of secret) rebuild: each piece is the
    interpolating polynomial's value at 0, ``Σ_j y_j · λ_j`` mod FIELD, with the Lagrange weights
    ``λ_j`` computed once per set of indices (:func:`lagrange_at_zero`). ValueError for shares that
    cannot be one polynomial's (repeated or zero indices, unequal or malformed lengths, or a value
    outside the field or the secret's range: a garbage share)."""
    if not shares:
        raise ValueError("no shares")
    size = len(shares[0][1])
    if size == 0 or size % SHARE_PIECE or any(len(share) != size for _, share in shares):
        raise ValueError("shares of unequal or malformed length")
    weights = lagrange_at_zero(tuple(i for i, _ in shares))
    out = b""
    for h in range(0, size, SHARE_PIECE):
        total = 0
        for weight, (_, share) in zip(weights, shares):
            y = int.from_bytes(share[h:h + SHARE_PIECE], "big")
            if y >= FIELD:
                raise ValueError("a share outside the field")
            total += weight * y
        total %= FIELD
        if total >= 1 << (8 * PIECE):
            raise ValueError("the shares rebuild no 16-byte secret")
        out += total.to_bytes(PIECE, "big")
    return out


@lru_cache(maxsize=256)
def lagrange_at_zero(indices: tuple[int, ...]) -> tuple[int, ...]:
    """``λ_j = Π_{m≠j} x_m / (x_m − x_j)`` mod FIELD: the weights of the shares at ``indices`` in the
    polynomial's value at 0."""
    if len(set(indices)) != len(indices) or any(not 0 < i < FIELD for i in indices):
        raise ValueError("Duplicate or zero share index")
    out = []
    for j, x_j in enumerate(indices):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = numerator * x_m % FIELD
                denominator = denominator * (x_m - x_j) % FIELD
        out.append(numerator * pow(denominator, -1, FIELD) % FIELD)
    return tuple(out)
