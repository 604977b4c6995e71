"""Tests of the client partitions: coverage, skew, determinism and validation."""

import numpy as np
import pytest

from fedcontrast.data import (
    PARTITION_NAMES,
    dirichlet_partition,
    iid_partition,
    partition_counts,
    partition_indices,
    shard_partition,
)
from fedcontrast.errors import ConfigError, DataError, UnknownNameError

NUM_CLASSES = 10


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """1,000 labels, 100 per class, in shuffled order."""
    return np.random.default_rng(123).permutation(np.repeat(np.arange(NUM_CLASSES), 100))


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "each client's indices must be sorted and distinct"
    joined = np.concatenate(parts)
    assert len(joined) == n, "every sample must go to exactly one client"
    assert np.array_equal(np.sort(joined), np.arange(n))


def mean_max_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    counts = partition_counts(labels, parts, NUM_CLASSES)
    return float(np.mean(counts.max(axis=1) / counts.sum(axis=1)))


@pytest.mark.parametrize("num_clients", [1, 5, 20])
def test_iid_covers_every_sample_once_in_near_equal_parts(labels, num_clients):
    parts = iid_partition(labels, num_clients, seed=0)
    assert len(parts) == num_clients
    assert_exact_cover(parts, len(labels))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_clients", [1, 5, 20])
@pytest.mark.parametrize("beta", [0.1, 0.5, 100.0])
def test_dirichlet_covers_every_sample_once_and_respects_min_samples(labels, num_clients, beta):
    parts = dirichlet_partition(labels, num_clients, beta=beta, seed=1, min_samples=10)
    assert len(parts) == num_clients
    assert_exact_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= 10
    counts = partition_counts(labels, parts, NUM_CLASSES)
    assert counts.sum() == len(labels)
    assert np.array_equal(counts.sum(axis=0), np.bincount(labels, minlength=NUM_CLASSES))


@pytest.mark.parametrize("num_clients", [5, 10])
def test_small_beta_is_much_more_skewed_than_large_beta(labels, num_clients):
    skewed = np.mean([mean_max_class_share(labels, dirichlet_partition(labels, num_clients, beta=0.1, seed=s))
                      for s in range(3)])
    even = np.mean([mean_max_class_share(labels, dirichlet_partition(labels, num_clients, beta=100.0, seed=s))
                    for s in range(3)])
    assert even < 0.2  # close to the IID value 1/10
    assert skewed > even + 0.3


def test_dirichlet_balancing_stops_clients_from_growing_past_their_fair_share(labels):
    # The reference code gives a client no share of later classes once it holds N / num_clients
    # samples, so a client can pass that mark by at most one class's worth of samples.
    num_clients = 10
    fair = len(labels) / num_clients
    largest_class = np.bincount(labels).max()
    for seed in range(5):
        parts = dirichlet_partition(labels, num_clients, beta=0.1, seed=seed, min_samples=0)
        assert max(len(p) for p in parts) < fair + largest_class


@pytest.mark.parametrize("method", PARTITION_NAMES)
def test_same_seed_same_split_and_different_seed_different_split(labels, method):
    first = partition_indices(labels, 5, method=method, seed=7)
    again = partition_indices(labels, 5, method=method, seed=7)
    other = partition_indices(labels, 5, method=method, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_partition_indices_dispatches_to_the_named_method(labels):
    direct = dirichlet_partition(labels, 4, beta=0.3, seed=2, min_samples=5)
    via = partition_indices(labels, 4, method="dirichlet", beta=0.3, min_samples=5, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(direct, via))
    direct = shard_partition(labels, 4, shards_per_client=3, seed=2)
    via = partition_indices(labels, 4, method="SHARDS", shards_per_client=3, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(direct, via))


@pytest.mark.parametrize("num_clients", [5, 10, 30])
def test_class_pure_shards_give_each_client_at_most_shards_per_client_labels(num_clients):
    # 60 clients' worth of shards: 10 classes × 60 samples, shard sizes dividing 60 keep shards class-pure.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 60))
    shards_per_client = 2
    parts = shard_partition(labels, num_clients, shards_per_client=shards_per_client, seed=3)
    assert 60 % (len(labels) // (num_clients * shards_per_client)) == 0
    assert_exact_cover(parts, len(labels))
    for part in parts:
        assert len(np.unique(labels[part])) <= shards_per_client
    assert len({len(p) for p in parts}) == 1


def test_shards_drop_only_a_remainder_smaller_than_the_number_of_shards():
    labels = np.random.default_rng(0).integers(0, 10, size=1003)
    parts = shard_partition(labels, 10, shards_per_client=2, seed=0)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # no sample in two clients
    assert len(joined) == 1000  # 20 shards of 50; 3 samples dropped
    assert len(labels) - len(joined) < 20


def test_partition_counts_match_a_manual_count(labels):
    parts = iid_partition(labels, 3, seed=0)
    counts = partition_counts(labels, parts, NUM_CLASSES)
    assert counts.shape == (3, NUM_CLASSES) and counts.dtype == np.int64
    for client, part in enumerate(parts):
        for cls in range(NUM_CLASSES):
            assert counts[client, cls] == np.sum(labels[part] == cls)


@pytest.mark.parametrize("beta", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_beta_is_a_config_error(labels, beta):
    with pytest.raises(ConfigError, match="beta must be > 0"):
        dirichlet_partition(labels, 5, beta=beta, seed=0)


def test_bad_client_numbers_are_config_errors(labels):
    with pytest.raises(ConfigError, match="num_clients"):
        iid_partition(labels, 0, seed=0)
    with pytest.raises(ConfigError, match="cannot split 5 samples among 6 clients"):
        partition_indices(np.arange(5) % 2, 6, method="iid")
    with pytest.raises(ConfigError, match="cannot split"):
        dirichlet_partition(np.arange(5) % 2, 6, beta=0.5, seed=0, min_samples=0)
    with pytest.raises(ConfigError, match="min_samples"):
        dirichlet_partition(labels, 10, beta=0.5, seed=0, min_samples=101)
    with pytest.raises(ConfigError, match="shards_per_client"):
        shard_partition(labels, 5, shards_per_client=0, seed=0)
    with pytest.raises(ConfigError, match="shards"):
        shard_partition(labels, 100, shards_per_client=20, seed=0)
    with pytest.raises(ConfigError, match="seed"):
        iid_partition(labels, 5, seed=-1)


def test_unknown_method_lists_the_known_methods(labels):
    with pytest.raises(UnknownNameError) as info:
        partition_indices(labels, 5, method="pathological")
    assert isinstance(info.value, ConfigError)
    for name in PARTITION_NAMES:
        assert name in str(info.value)


def test_unreachable_min_samples_is_a_data_error_after_max_attempts(labels):
    # With beta = 0.01 nearly every class goes to one client, so 10 clients of >= 99 samples each
    # (almost an exact equal split) cannot come out of 5 draws.
    with pytest.raises(DataError, match="larger beta or a smaller min_samples"):
        dirichlet_partition(labels, 10, beta=0.01, seed=0, min_samples=99, max_attempts=5)


def test_labels_must_be_integer_class_indices():
    with pytest.raises(DataError):
        iid_partition(np.zeros((4, 2), dtype=np.int64), 2, seed=0)
    with pytest.raises(DataError):
        iid_partition(np.array([0.5, 1.5, 2.5]), 2, seed=0)
