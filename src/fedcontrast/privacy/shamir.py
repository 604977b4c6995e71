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


def lagrange_at_zero(indices: tuple[int, ...]) -> tuple[int, ...]:
    """``λ_j = Π_{m≠j} x_m / (x_m − x_j)`` mod FIELD: the weights of the shares at ``indices`` in the
    polynomial's value at 0 (:func:`lagrange_at` at 0, cached there)."""
    return lagrange_at(indices, 0)


@lru_cache(maxsize=1024)
def lagrange_at(indices: tuple[int, ...], x: int) -> tuple[int, ...]:
    """``λ_j(x) = Π_{m≠j} (x − x_m) / (x_j − x_m)`` mod FIELD: the weights of the shares at
    ``indices`` in the interpolating polynomial's value at ``x``."""
    if len(set(indices)) != len(indices) or any(not 0 < i < FIELD for i in indices):
        raise ValueError("Duplicate or zero share index")
    out = []
    for j, x_j in enumerate(indices):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = numerator * (x - x_m) % FIELD
                denominator = denominator * (x_j - x_m) % FIELD
        out.append(numerator * pow(denominator, -1, FIELD) % FIELD)
    return tuple(out)


def _pieces(share: bytes) -> list[int]:
    values = [int.from_bytes(share[h:h + SHARE_PIECE], "big") for h in range(0, len(share), SHARE_PIECE)]
    if any(v >= FIELD for v in values):
        raise ValueError("a share outside the field")
    return values


def on_polynomial(basis: list[tuple[int, bytes]], shares: list[tuple[int, bytes]]) -> list[bool]:
    """Whether each of ``shares`` (index, bytes) lies, piece by piece, on the polynomial of degree
    below ``len(basis)`` that the ``basis`` shares interpolate (its Lagrange weights at each index)."""
    indices = tuple(i for i, _ in basis)
    pieces = [_pieces(s) for _, s in basis]
    out = []
    for x, value in shares:
        try:
            wanted = _pieces(value)
        except ValueError:
            out.append(False)
            continue
        if len(value) != len(basis[0][1]) or x in indices:
            out.append(False)
            continue
        weights = lagrange_at(indices, x)
        out.append(all(sum(w * p[h] for w, p in zip(weights, pieces)) % FIELD == wanted[h]
                       for h in range(len(wanted))))
    return out


def _solve(rows: list[list[int]]) -> list[int] | None:
    """One solution of the linear system ``rows`` (each the coefficients, then the right-hand side)
    mod FIELD, free unknowns set to 0; None when it has none (Gauss–Jordan)."""
    rows = [list(r) for r in rows]
    unknowns = len(rows[0]) - 1
    pivots: list[int] = []
    r = 0
    for c in range(unknowns):
        p = next((i for i in range(r, len(rows)) if rows[i][c] % FIELD), None)
        if p is None:
            continue
        rows[r], rows[p] = rows[p], rows[r]
        inverse = pow(rows[r][c], -1, FIELD)
        rows[r] = [v * inverse % FIELD for v in rows[r]]
        for i in range(len(rows)):
            if i != r and rows[i][c]:
                factor = rows[i][c]
                rows[i] = [(a - factor * b) % FIELD for a, b in zip(rows[i], rows[r])]
        pivots.append(c)
        r += 1
        if r == len(rows):
            break
    if any(all(v == 0 for v in row[:-1]) and row[-1] for row in rows[r:]):
        return None  # inconsistent
    solution = [0] * unknowns
    for i, c in enumerate(pivots):
        solution[c] = rows[i][-1]
    return solution


def _divide(numerator: list[int], denominator: list[int]) -> list[int] | None:
    """``numerator / denominator`` (coefficients from degree 0 up, the denominator monic) mod FIELD;
    None when the division leaves a remainder."""
    num = list(numerator)
    d = len(denominator) - 1
    quotient = [0] * max(1, len(num) - d)
    for i in range(len(num) - 1, d - 1, -1):
        coefficient = num[i]  # the denominator is monic
        quotient[i - d] = coefficient
        if coefficient:
            for j in range(d + 1):
                num[i - d + j] = (num[i - d + j] - coefficient * denominator[j]) % FIELD
    return quotient if not any(num[:d]) else None


def decode(points: list[tuple[int, int]], t: int) -> tuple[list[int], set[int]] | None:
    """Reed–Solomon decoding (Berlekamp–Welch) of one piece: the polynomial of degree below ``t``
    (coefficients from degree 0) through all but at most ``⌊(m − t)/2⌋`` of the ``m`` ``points``
    (x, y), and the x of the points on it; None when no such polynomial exists."""
    m = len(points)
    for errors in range((m - t) // 2, 0, -1):
        # Q(x_i) = y_i·E(x_i), E monic of degree `errors`, Q of degree below t + errors
        rows = []
        for x, y in points:
            powers = [pow(x, j, FIELD) for j in range(t + errors)]
            rows.append(powers + [(-y * powers[j]) % FIELD for j in range(errors)]
                        + [y * pow(x, errors, FIELD) % FIELD])
        solution = _solve(rows)
        if solution is None:
            continue
        q, e = solution[:t + errors], solution[t + errors:] + [1]
        p = _divide(q, e)
        if p is None or len(p) > t and any(p[t:]):
            continue
        p = (p + [0] * t)[:t]
        on = {x for x, y in points if _horner(p, x) == y % FIELD}
        if len(on) >= m - errors:
            return p, on
    return None


def _horner(coefficients: list[int], x: int) -> int:
    y = 0
    for a in reversed(coefficients):
        y = (y * x + a) % FIELD
    return y
