"""Splitting a labelled training set among federated clients: IID, Dirichlet label skew, shards.

Every function returns one sorted int64 index array per client into ``labels`` and is deterministic
given ``seed`` (a private ``np.random.default_rng``; no global random state is touched).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError, DataError, UnknownNameError

PARTITION_NAMES: tuple[str, ...] = ("iid", "dirichlet", "shards")


def _as_labels(labels: np.ndarray) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(
            f"labels must be a 1-D array of integer class indices, got shape {array.shape} and dtype {array.dtype}."
        )
    return array


def _check_int(label: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{label} must be an integer of at least {minimum}, got {value!r}.")
    return int(value)


def _check_clients(labels: np.ndarray, num_clients: int) -> int:
    num_clients = _check_int("num_clients", num_clients, 1)
    if num_clients > labels.shape[0]:
        raise ConfigError(
            f"cannot split {labels.shape[0]} samples among {num_clients} clients; use fewer clients or more data."
        )
    return num_clients


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(_check_int("seed", seed, 0))


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def iid_partition(labels: np.ndarray, num_clients: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle all indices and deal them out in near-equal parts (sizes differ by at most one)."""
    labels = _as_labels(labels)
    num_clients = _check_clients(labels, num_clients)
    order = _rng(seed).permutation(labels.shape[0])
    return _finish(np.array_split(order, num_clients))


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    beta: float,
    seed: int,
    min_samples: int = 10,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split as in MOON (Li et al., CVPR 2021) and its reference code.

    Following Yurochkin et al. (2019): for each class, shuffle its indices and draw client shares
    ``p ~ Dir(beta · 1)``; clients that already hold at least ``N / num_clients`` samples get share 0
    (the reference code's balancing step, which keeps any client from swallowing most of the data),
    the shares are renormalised and the class's indices are cut at the cumulative shares. The whole
    partition is drawn again until every client has at least ``min_samples`` samples. Smaller
    ``beta`` means more skew. Every index goes to exactly one client.

    Raises :class:`ConfigError` for invalid settings and :class:`DataError` when ``max_attempts``
    draws all leave some client with fewer than ``min_samples`` samples.
    """
    labels = _as_labels(labels)
    num_clients = _check_clients(labels, num_clients)
    is_number = isinstance(beta, (int, float, np.integer, np.floating)) and not isinstance(beta, bool)
    if not is_number or not math.isfinite(beta) or beta <= 0:
        raise ConfigError(f"beta must be > 0, got {beta!r}.")
    min_samples = _check_int("min_samples", min_samples, 0)
    max_attempts = _check_int("max_attempts", max_attempts, 1)
    n = labels.shape[0]
    if min_samples * num_clients > n:
        raise ConfigError(
            f"min_samples={min_samples} for each of {num_clients} clients needs {min_samples * num_clients} samples "
            f"but there are only {n}; lower min_samples or use fewer clients."
        )

    rng = _rng(seed)
    classes = np.unique(labels)
    fair_share = n / num_clients
    for _ in range(max_attempts):
        parts = _dirichlet_draw(labels, classes, num_clients, float(beta), fair_share, rng)
        if min(len(p) for p in parts) >= min_samples:
            return _finish(parts)
    raise DataError(
        f"no Dirichlet draw with beta={beta} gave every one of {num_clients} clients at least {min_samples} "
        f"samples in {max_attempts} attempts; use a larger beta or a smaller min_samples."
    )


def _dirichlet_draw(
    labels: np.ndarray, classes: np.ndarray, num_clients: int, beta: float, fair_share: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """One draw of the MOON reference partition (without the minimum-size retry)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for cls in classes:
        members = rng.permutation(np.flatnonzero(labels == cls))
        shares = rng.dirichlet(np.full(num_clients, beta))
        eligible = sizes < fair_share
        shares = shares * eligible
        total = shares.sum()
        if not np.isfinite(total) or total <= 0:
            # A tiny beta can underflow every eligible share to zero: split the class evenly among
            # the eligible clients instead of dividing by zero.
            shares = eligible.astype(float) if eligible.any() else np.ones(num_clients)
            total = shares.sum()
        cuts = (np.cumsum(shares / total) * len(members)).astype(int)[:-1]
        for client, chunk in enumerate(np.split(members, cuts)):
            parts[client].append(chunk)
            sizes[client] += len(chunk)
    return [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]


def shard_partition(
    labels: np.ndarray, num_clients: int, *, shards_per_client: int = 2, seed: int
) -> list[np.ndarray]:
    """Pathological non-IID split of FedAvg (McMahan et al., 2017): label-sorted shards.

    The indices are sorted by label and cut into ``num_clients × shards_per_client`` equal shards;
    each client gets ``shards_per_client`` shards chosen at random, so it sees few classes. When
    ``N`` is not a multiple of the number of shards, a random remainder of fewer than
    ``num_shards`` samples is dropped and belongs to no client.
    """
    labels = _as_labels(labels)
    num_clients = _check_clients(labels, num_clients)
    shards_per_client = _check_int("shards_per_client", shards_per_client, 1)
    num_shards = num_clients * shards_per_client
    n = labels.shape[0]
    if num_shards > n:
        raise ConfigError(
            f"cannot cut {n} samples into {num_shards} shards ({num_clients} clients × {shards_per_client}); "
            "use fewer clients or fewer shards_per_client."
        )
    rng = _rng(seed)
    shard_size = n // num_shards
    # Drop a random remainder (not always the tail of the last class), then order by label with the
    # order inside each class shuffled (a stable sort keeps the shuffled order).
    used = rng.permutation(n)[: num_shards * shard_size]
    by_label = used[np.argsort(labels[used], kind="stable")]
    shards = by_label.reshape(num_shards, shard_size)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return _finish([shards[row].ravel() for row in assignment])


def partition_indices(
    labels: np.ndarray,
    num_clients: int,
    *,
    method: str = "dirichlet",
    beta: float = 0.5,
    shards_per_client: int = 2,
    min_samples: int = 10,
    seed: int = 0,
) -> list[np.ndarray]:
    """Partition by ``method`` (one of :data:`PARTITION_NAMES`); settings of other methods are ignored."""
    key = method.strip().lower() if isinstance(method, str) else method
    if key == "iid":
        return iid_partition(labels, num_clients, seed=seed)
    if key == "dirichlet":
        return dirichlet_partition(labels, num_clients, beta=beta, seed=seed, min_samples=min_samples)
    if key == "shards":
        return shard_partition(labels, num_clients, shards_per_client=shards_per_client, seed=seed)
    raise UnknownNameError(f"unknown partition method {method!r}; known methods: {', '.join(PARTITION_NAMES)}.")


def partition_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Samples per client and class: an int64 array of shape ``(num_clients, num_classes)``."""
    labels = _as_labels(labels)
    num_classes = _check_int("num_classes", num_classes, 1)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(
            f"labels must lie in [0, {num_classes}) for num_classes={num_classes}, "
            f"found {int(labels.min())}..{int(labels.max())}; pass the data set's number of classes."
        )
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for client, part in enumerate(parts):
        counts[client] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return counts
