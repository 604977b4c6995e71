"""Data: in-memory data sets, client partitions and partition reports.

``load_dataset`` reads a data set once (never downloading) into normalised tensors split into
train / test / public; the partition functions split the training labels among clients; the report
functions show how the classes ended up distributed.
"""

from .datasets import DATASET_NAMES, ArrayDataset, DataSplits, load_dataset
from .partition import (
    PARTITION_NAMES,
    dirichlet_partition,
    iid_partition,
    partition_counts,
    partition_indices,
    shard_partition,
)
from .report import format_partition_table, write_partition_report

__all__ = [
    "ArrayDataset",
    "DataSplits",
    "DATASET_NAMES",
    "load_dataset",
    "PARTITION_NAMES",
    "iid_partition",
    "dirichlet_partition",
    "shard_partition",
    "partition_indices",
    "partition_counts",
    "format_partition_table",
    "write_partition_report",
]
