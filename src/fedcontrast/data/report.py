"""Human-readable views of a partition: a text table, a CSV file and a heat-map."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..errors import ConfigError

# Above this many cells the numbers would overlap into an unreadable smear (e.g. 100 clients ×
# 100 classes), so the heat-map then shows colours only; the CSV always has the exact counts.
_MAX_ANNOTATED_CELLS = 600


def _as_counts(counts: np.ndarray) -> np.ndarray:
    array = np.asarray(counts)
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer) or (array.size and array.min() < 0):
        raise ConfigError(
            f"counts must be a 2-D array of non-negative integers (clients × classes), got shape {array.shape} "
            f"and dtype {array.dtype}; pass the result of partition_counts."
        )
    return array.astype(np.int64)


def _class_labels(num_classes: int, class_names: list[str] | tuple[str, ...] | None) -> list[str]:
    if class_names is None:
        return [str(c) for c in range(num_classes)]
    if len(class_names) != num_classes:
        raise ConfigError(f"got {len(class_names)} class names for {num_classes} classes; pass one name per column.")
    return [str(c) for c in class_names]


def format_partition_table(counts: np.ndarray, class_names: list[str] | None = None) -> str:
    """An aligned text table: one row per client (``client_0``, ...), one column per class, a
    ``total`` column and a final ``total`` row."""
    counts = _as_counts(counts)
    header = ["client", *_class_labels(counts.shape[1], class_names), "total"]
    rows = [[f"client_{i}", *map(str, row), str(int(row.sum()))] for i, row in enumerate(counts)]
    rows.append(["total", *map(str, counts.sum(axis=0)), str(int(counts.sum()))])
    table = [header, *rows]
    widths = [max(len(line[col]) for line in table) for col in range(len(header))]
    # Names are left-aligned and numbers right-aligned, so digits of equal place line up.
    lines = [
        "  ".join(cell.ljust(w) if col == 0 else cell.rjust(w) for col, (cell, w) in enumerate(zip(line, widths)))
        for line in table
    ]
    return "\n".join(lines)


def label_skew(counts: np.ndarray) -> float:
    """How far the sites' label distributions are from the pooled one: the total-variation distance,
    averaged over the sites weighted by their sizes (0: every site alike; near 1: disjoint classes)."""
    counts = _as_counts(counts).astype(np.float64)
    sizes = counts.sum(axis=1)
    pooled = counts.sum(axis=0) / max(sizes.sum(), 1.0)
    shares = counts / np.maximum(sizes, 1.0)[:, None]
    return float((0.5 * np.abs(shares - pooled).sum(axis=1) * sizes).sum() / max(sizes.sum(), 1.0))


def format_partition_summary(counts: np.ndarray) -> str:
    """Two lines for any number of sites: samples per site and classes per site (minimum, median,
    mean, maximum), and how far the sites' label distributions are from the pooled one."""
    counts = _as_counts(counts)
    sizes, classes = counts.sum(axis=1), (counts > 0).sum(axis=1)

    def spread(values: np.ndarray) -> str:
        return (f"min {int(values.min())}, median {float(np.median(values)):g}, mean {float(values.mean()):.1f}, "
                f"max {int(values.max())}") if values.size else "none"

    return (f"{len(counts)} sites, {int(counts.sum())} training samples; samples per site: {spread(sizes)}\n"
            f"classes per site: {spread(classes)}; label skew (size-weighted total variation from the "
            f"pooled label distribution, 0 = every site alike): {label_skew(counts):.3f}")


def write_partition_report(
    counts: np.ndarray,
    out_dir: str | Path,
    *,
    title: str = "",
    class_names: list[str] | None = None,
) -> dict[str, Path]:
    """Write ``partition.csv`` and ``partition.png`` into ``out_dir`` (created if needed).

    The CSV has the header ``client,<class...>,total`` and one row per client. The PNG is a
    heat-map with clients on the y axis and classes on the x axis, each cell annotated with its
    count (for grids up to a few hundred cells). Returns ``{"csv": path, "png": path}``.
    """
    counts = _as_counts(counts)
    names = _class_labels(counts.shape[1], class_names)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    csv_path = out / "partition.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["client", *names, "total"])
        for i, row in enumerate(counts):
            writer.writerow([f"client_{i}", *row.tolist(), int(row.sum())])

    png_path = out / "partition.png"
    _plot_heatmap(counts, names, title, png_path)
    return {"csv": csv_path, "png": png_path}


def _plot_heatmap(counts: np.ndarray, names: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede the pyplot import
    import matplotlib.pyplot as plt

    clients, classes = counts.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.6 * classes, 24), min(1.5 + 0.4 * clients, 24)))
    try:
        image = ax.imshow(counts, cmap="Blues", aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="samples")
        ax.set_xlabel("class")
        ax.set_ylabel("client")
        ax.set_xticks(range(classes), names, rotation=45 if max(map(len, names), default=0) > 3 else 0)
        if clients <= 100:  # beyond, one label per row is an unreadable smear
            ax.set_yticks(range(clients), [f"client_{i}" for i in range(clients)])
        if title:
            ax.set_title(title)
        if counts.size <= _MAX_ANNOTATED_CELLS:
            threshold = counts.max() / 2 if counts.size else 0
            for (row, col), value in np.ndenumerate(counts):
                # White text on dark cells, black on light ones, so every number stays legible.
                ax.text(col, row, str(value), ha="center", va="center", fontsize=7,
                        color="white" if value > threshold else "black")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)  # pyplot keeps figures alive otherwise; many reports would leak memory
