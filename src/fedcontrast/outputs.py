"""What a run writes: metrics.csv, summary.json, accuracy.png, TensorBoard scalars."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .atomic import atomic_write_bytes, atomic_write_text, write_failure

METRIC_COLUMNS = ("round", "site", "task", "samples", "loss", "accuracy", "bytes_uploaded",
                  "bytes_downloaded", "extra")
GLOBAL_SITE = "global"  # the site name of the aggregator's test evaluation rows


def one_site(count: int | None) -> str:
    """What follows a figure over the sites when it is one site's alone, not a mean: `` (1 site)``."""
    return " (1 site)" if count == 1 else ""


def sites_evaluated(rows: Sequence[dict[str, Any]], round_num: int) -> int:
    """How many sites' held-out evaluations of the model after ``round_num`` are in ``rows`` (what
    the ``global`` row of that round is the weighted mean of)."""
    return len({r["site"] for r in rows if r.get("task") == "evaluate" and r["site"] != GLOBAL_SITE
                and int(r["round"]) == round_num and _finite(r.get("accuracy"))})


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def metric_row(round_num: int, site: str, task: str, samples: int | None, metrics: dict[str, float],
               bytes_uploaded: int = 0, bytes_downloaded: int = 0) -> dict[str, Any]:
    """One row of metrics.csv; metrics other than loss and accuracy go to the JSON ``extra`` column."""
    extra = {k: round(float(v), 6) for k, v in sorted(metrics.items()) if k not in ("loss", "accuracy")}
    return {"round": round_num, "site": site, "task": task, "samples": samples,
            "loss": float(metrics.get("loss", math.nan)), "accuracy": float(metrics.get("accuracy", math.nan)),
            "bytes_uploaded": bytes_uploaded, "bytes_downloaded": bytes_downloaded,
            "extra": json.dumps(extra, separators=(",", ":"))}


def write_metrics_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=METRIC_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())


def append_metrics_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Add ``rows`` (a round's) to ``path``, a metrics.csv written by :func:`write_metrics_csv` (written
    whole when it does not exist yet): a round costs its own rows, not the run's. A write cut short (a
    kill, a full disk) is repaired by a resume, which rewrites the file from the checkpoint's rows."""
    if not path.exists():
        write_metrics_csv(path, rows)
        return
    text = io.StringIO(newline="")
    csv.DictWriter(text, fieldnames=METRIC_COLUMNS).writerows(rows)
    try:
        with open(path, "ab") as f:
            f.write(text.getvalue().encode())
    except OSError as exc:
        raise write_failure(path, exc) from None


def test_accuracy_curve(rows: Sequence[dict[str, Any]]) -> list[float]:
    """Global test accuracy after each round, in round order."""
    return [r["accuracy"] for r in sorted((r for r in rows if r["site"] == GLOBAL_SITE),
                                          key=lambda r: r["round"])]


def validation_accuracy_curve(rows: Sequence[dict[str, Any]]) -> list[float | None]:
    """The global model's accuracy on the sites' validation parts after each round, in round order
    (None where a round has none: no validation split)."""
    out: list[float | None] = []
    for r in sorted((r for r in rows if r["site"] == GLOBAL_SITE), key=lambda r: r["round"]):
        extra = r["extra"] if isinstance(r["extra"], dict) else json.loads(r["extra"] or "{}")
        out.append(extra.get("val_accuracy"))
    return out


def best_by_validation(validation: Sequence[float | None]) -> int | None:
    """The index of the round the validation curve picks: the first with the highest validation
    accuracy (NaN never picked); None where no round has one. The test curve is never looked at."""
    scored = [(v, -i) for i, v in enumerate(validation) if v is not None and v == v]
    return -max(scored)[1] if scored else None


def rounds_to_reach(curve: Sequence[float], target: float | None) -> int | None:
    """The first round (1-based) whose accuracy is ≥ ``target``; None if never or no target."""
    if target is None:
        return None
    return next((i + 1 for i, acc in enumerate(curve) if acc >= target), None)


def build_summary(rows: Sequence[dict[str, Any]], *, config: dict[str, Any], wall_time_s: float,
                  rounds_total: int) -> dict[str, Any]:
    """summary.json of a run's metrics ``rows`` (:class:`SummaryTally` over all of them at once)."""
    tally = SummaryTally()
    tally.add(rows)
    return tally.summary(config=config, wall_time_s=wall_time_s, rounds_total=rounds_total)


class SummaryTally:
    """What summary.json needs of the rows seen so far, kept as rounds finish (:meth:`add` each round's
    rows, all of a round's in one call): a round costs its own rows, not every row of the run again."""

    def __init__(self) -> None:
        self.global_rows: list[dict[str, Any]] = []
        self.uploaded_total, self.uploaded_count = 0, 0  # bytes uploaded, and (round, site) pairs
        self.train_accuracy: dict[int, tuple[float, int]] = {}  # round → (Σ samples × accuracy, Σ samples)
        self.train_sites: dict[int, set[str]] = {}  # round → the sites in that round's training accuracy

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        uploaded: dict[tuple[int, str], int] = {}  # (round, site) → bytes, over the site's tasks
        for r in rows:
            if r["site"] == GLOBAL_SITE:
                self.global_rows.append(r)
            else:
                key = (r["round"], r["site"])
                uploaded[key] = uploaded.get(key, 0) + r["bytes_uploaded"]
                accuracy, samples = r.get("accuracy"), r.get("samples") or 0
                if r.get("task") == "train" and accuracy is not None and accuracy == accuracy and samples:
                    total, count = self.train_accuracy.get(r["round"], (0.0, 0))  # the sites' training accuracy
                    self.train_accuracy[r["round"]] = (total + samples * accuracy, count + samples)
                    self.train_sites.setdefault(r["round"], set()).add(r["site"])
        self.uploaded_total += sum(uploaded.values())
        self.uploaded_count += len(uploaded)

    def validation_curve(self) -> list[float | None]:
        return validation_accuracy_curve(self.global_rows)

    def curve(self) -> list[float]:
        """Global test accuracy after each round so far (:func:`test_accuracy_curve`)."""
        return test_accuracy_curve(self.global_rows)

    def summary(self, *, config: dict[str, Any], wall_time_s: float, rounds_total: int) -> dict[str, Any]:
        curve, validation = self.curve(), self.validation_curve()
        best = best_by_validation(validation)  # chosen on the sites' validation parts, never on the test split
        last = sorted(self.global_rows, key=lambda r: r["round"])[-1:]  # the last round's (stable sort)
        final_metrics = json.loads(last[0]["extra"]) if last else {}
        trained = self.train_accuracy.get(last[0]["round"]) if last else None
        return {
            "algorithm": config["algorithm"], "dataset": config["dataset"],
            "rounds_completed": len(curve), "rounds_planned": rounds_total,
            "final_accuracy": curve[-1] if curve else None,
            "final_val_accuracy": validation[-1] if validation else None,
            # the sites' accuracy on their own training data in the last round (its last epoch), sample-weighted
            "final_train_accuracy": trained[0] / trained[1] if trained and trained[1] else None,
            "final_train_sites": len(self.train_sites.get(last[0]["round"], ())) if last else 0,  # 1: no mean
            # the round the validation curve picks, and the test accuracy of that round's model
            "best_round": best + 1 if best is not None else None,
            "best_val_accuracy": validation[best] if best is not None else None,
            "best_accuracy": curve[best] if best is not None else None,
            "best_chosen_by": "validation" if best is not None else
            "none: no validation split (validation_fraction 0), and the test split never chooses",
            "target_accuracy": config.get("target_accuracy"),
            "rounds_to_target": rounds_to_reach(curve, config.get("target_accuracy")),
            "bytes_uploaded_per_site_per_round": (self.uploaded_total / self.uploaded_count
                                                  if self.uploaded_count else 0),
            "wall_time_s": round(wall_time_s, 3),
            "final_metrics": final_metrics,  # the last round's other test metrics (local accuracy, ξ, ...)
            "accuracy_curve": curve,
            "val_accuracy_curve": validation,
        }


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def plot_curves(path: Path, curves: Mapping[str, Sequence[float | None]], *, title: str,
                bands: Mapping[str, Sequence[float]] | None = None, ylabel: str = "global test accuracy",
                styles: dict[str, dict[str, Any]] | None = None) -> None:
    """Test accuracy per round, one line per entry of ``curves`` (optional ± bands; None values are
    gaps; ``styles``: matplotlib line settings per label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, curve in curves.items():
        xs = range(1, len(curve) + 1)
        values = [float("nan") if c is None else c for c in curve]
        ax.plot(xs, values, label=label, **{"linewidth": 1.6, **(styles or {}).get(label, {})})
        if bands and label in bands:
            lo = [c - b for c, b in zip(values, bands[label])]
            hi = [c + b for c, b in zip(values, bands[label])]
            ax.fill_between(xs, lo, hi, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    image = io.BytesIO()  # rendered in memory: a full disk must not leave a truncated image
    fig.savefig(image, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    atomic_write_bytes(path, image.getbuffer())


class TensorBoardLog:
    """TensorBoard scalars; a missing tensorboard package only disables this output. A write that
    fails (a full disk) is an :class:`~fedcontrast.errors.OutputError` naming the folder."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        self.log_dir = log_dir
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboard is a declared dependency
            self.writer = None
            return
        try:
            self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)
        except OSError as exc:
            raise write_failure(log_dir, exc) from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            try:
                for key, value in values.items():
                    self.writer.add_scalar(key, value, step)
                self.writer.flush()
            except OSError as exc:
                raise write_failure(self.log_dir, exc) from None

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except OSError as exc:
                raise write_failure(self.log_dir, exc) from None
