"""Tests of the partition table, CSV and heat-map."""

import csv

import numpy as np
import pytest

from fedcontrast.data import format_partition_table, write_partition_report
from fedcontrast.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def counts() -> np.ndarray:
    return np.array([[5, 0, 12], [1, 30, 2]], dtype=np.int64)


def test_table_has_client_rows_class_columns_and_totals(counts):
    table = format_partition_table(counts, class_names=["cat", "dog", "emu"])
    lines = table.splitlines()
    assert lines[0].split() == ["client", "cat", "dog", "emu", "total"]
    assert lines[1].split() == ["client_0", "5", "0", "12", "17"]
    assert lines[2].split() == ["client_1", "1", "30", "2", "33"]
    assert lines[3].split() == ["total", "6", "30", "14", "50"]
    assert len({len(line) for line in lines}) == 1, "columns must be aligned"


def test_table_defaults_to_numbered_classes(counts):
    assert format_partition_table(counts).splitlines()[0].split() == ["client", "0", "1", "2", "total"]


def test_csv_round_trips_the_counts_and_png_is_valid(tmp_path, counts):
    paths = write_partition_report(counts, tmp_path / "nested" / "report", title="Dirichlet beta=0.5")
    assert set(paths) == {"csv", "png"}
    with paths["csv"].open(newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["client", "0", "1", "2", "total"]
    assert [row[0] for row in rows[1:]] == ["client_0", "client_1"]
    body = np.array([[int(v) for v in row[1:]] for row in rows[1:]])
    assert np.array_equal(body[:, :-1], counts)
    assert np.array_equal(body[:, -1], counts.sum(axis=1))
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC
    assert paths["png"].stat().st_size > 1000


def test_large_grids_are_written_too(tmp_path):
    counts = np.random.default_rng(0).integers(0, 50, size=(40, 20))
    paths = write_partition_report(counts, tmp_path)
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "bad", [np.array([1, 2, 3]), np.array([[1.5, 2.0]]), np.array([[1, -2]])]
)
def test_bad_counts_are_config_errors(tmp_path, bad):
    with pytest.raises(ConfigError):
        format_partition_table(bad)
    with pytest.raises(ConfigError):
        write_partition_report(bad, tmp_path)


def test_class_names_must_match_the_columns(counts):
    with pytest.raises(ConfigError, match="class names"):
        format_partition_table(counts, class_names=["a", "b"])
