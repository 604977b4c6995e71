"""``fedcontrast compare``: several algorithms on the same partitions and seeds, one table, one plot."""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from ..config import RunConfig
from ..construction import build_algorithm
from ..errors import ConfigError
from ..outputs import plot_curves, rounds_to_reach, write_json
from ..yamlio import loads_yaml
from .simulator import Progress, run_simulation


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"moon"`` → ("moon", {}); ``"moon:mu=1,temperature=0.2"`` → ("moon", {"mu": 1, "temperature": 0.2})."""
    name, _, rest = spec.partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"algorithm variant {spec!r} must look like name:key=value,key=value")
        settings[key.strip()] = loads_yaml(value, f"algorithm variant {spec!r}")
    return name.strip(), settings


def variant_config(base: RunConfig, spec: str, seed: int) -> RunConfig:
    name, settings = parse_variant(spec)
    hyper = {k: dict(v) for k, v in base.hyperparameters.items()}
    if settings:
        hyper[name] = {**hyper.get(name, {}), **settings}
    return base.replace(algorithm=name, seed=seed, hyperparameters=hyper)


def run_comparison(base: RunConfig, algorithms: Sequence[str], seeds: Sequence[int], out_dir: str | Path, *,
                   resume: bool = True, progress_factory=None) -> list[dict[str, Any]]:
    """Run every (algorithm, seed) pair into ``out_dir/<algorithm>-s<seed>`` and summarise.

    The partition depends only on the seed, so algorithms compared at one seed see the same split.
    Finished runs are reused, interrupted ones resumed. The first algorithm is the reference for
    "rounds to reach the reference's final accuracy". An entry may carry settings, as in
    ``moon:mu=1``, to compare variants of one algorithm.
    """
    configs = {spec: variant_config(base, spec, base.seed) for spec in algorithms}
    for config in configs.values():  # bad names or settings fail before any run starts
        build_algorithm(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[list[float]]] = {}
    summaries: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, list[float]] = {}
    from .ray_executor import make_executor, site_progress

    executor = make_executor(base, progress=site_progress() if progress_factory else None)  # one for every run
    total, began = len(algorithms) * len(seeds), time.monotonic()
    try:
        for done, (algorithm, seed) in enumerate((a, s) for a in algorithms for s in seeds):
            config = configs[algorithm].replace(seed=seed)
            progress: Progress | None = (progress_factory(f"{algorithm} seed {seed} (run {done + 1} of {total}"
                                                          + _eta(began, done, total) + ")")
                                         if progress_factory else None)
            run_name = algorithm.replace(":", "-").replace(",", "-").replace("=", "")
            summary = run_simulation(config, out / f"{run_name}-s{seed}", resume=resume, progress=progress,
                                     executor=executor)
            curves.setdefault(algorithm, []).append(summary["accuracy_curve"])
            summaries.setdefault(algorithm, []).append(summary)
            walls.setdefault(algorithm, []).append(summary["wall_time_s"])
    finally:
        executor.close()

    reference = algorithms[0]
    ref_final = statistics.fmean(c[-1] for c in curves[reference])
    table = []
    for algorithm in algorithms:
        finals = [c[-1] for c in curves[algorithm]]
        # the test accuracy of the round each run's validation curve picks (never the best test round)
        bests = [s["best_accuracy"] for s in summaries[algorithm] if s.get("best_accuracy") is not None]
        vals = [s["final_val_accuracy"] for s in summaries[algorithm] if s.get("final_val_accuracy") is not None]
        reach = [rounds_to_reach(c, ref_final) for c in curves[algorithm]]
        final_m, final_s = _mean_std(finals)
        best_m, best_s = _mean_std(bests) if bests else (None, None)
        val_m, val_s = _mean_std(vals) if vals else (None, None)
        table.append({
            "algorithm": algorithm, "seeds": len(finals),
            "final_accuracy_mean": final_m, "final_accuracy_std": final_s,
            "final_val_accuracy_mean": val_m, "final_val_accuracy_std": val_s,
            "best_accuracy_mean": best_m, "best_accuracy_std": best_s,
            f"rounds_to_{reference}_final": (statistics.fmean(cast(list[int], reach))
                                          if all(r is not None for r in reach) else None),
            "rounds_to_reference_per_seed": reach,
            "wall_time_s_mean": statistics.fmean(walls[algorithm]),
        })
    _write_table(out, table, reference, ref_final, rounds=base.rounds)
    mean_curves = {a: [statistics.fmean(v) for v in zip(*cs)] for a, cs in curves.items()}
    std_curves = {a: [statistics.stdev(v) if len(v) > 1 else 0.0 for v in zip(*cs)] for a, cs in curves.items()}
    plot_curves(out / "compare.png", mean_curves, bands=std_curves,
                title=f"{base.dataset}, {base.clients} sites, {base.partition} β={base.beta:g}, "
                      f"{len(seeds)} seed(s)")
    write_json(out / "compare.json", {"reference": reference, "reference_final_accuracy": ref_final,
                                      "table": table, "mean_curves": mean_curves})
    return table


def _eta(began: float, done: int, total: int) -> str:
    """``; about 3 min left`` from the runs done so far (nothing before the first ends)."""
    if done == 0:
        return ""
    left = (time.monotonic() - began) / done * (total - done)
    return f"; about {left / 60:.0f} min left" if left >= 90 else f"; about {left:.0f} s left"


def _write_table(out: Path, table: list[dict[str, Any]], reference: str, ref_final: float, *, rounds: int) -> None:
    key = f"rounds_to_{reference}_final"
    with (out / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in table[0] if k != "rounds_to_reference_per_seed"])
        writer.writeheader()
        writer.writerows({k: v for k, v in row.items() if k != "rounds_to_reference_per_seed"} for row in table)
    lines = [f"| algorithm | final test accuracy | final validation accuracy | test accuracy at the round validation "
             f"picks | rounds to {reference}'s final ({ref_final:.4f}) | wall time / run |",
             "|---|---|---|---|---|---|"]

    def cell(row: dict[str, Any], key: str) -> str:
        mean = row[f"{key}_mean"]
        return "n/a (no validation split)" if mean is None else f"{100 * mean:.2f} ± {100 * row[f'{key}_std']:.2f} %"

    for row in table:
        reach = row[key]
        reach_s = f"{reach:.1f}" if reach is not None else (
            f">{rounds} (per seed: "
            f"{', '.join('-' if r is None else str(r) for r in row['rounds_to_reference_per_seed'])})")
        lines.append(f"| {row['algorithm']} | {cell(row, 'final_accuracy')} | {cell(row, 'final_val_accuracy')} "
                     f"| {cell(row, 'best_accuracy')} | {reach_s} | {row['wall_time_s_mean']:.1f} s |")
    (out / "compare.md").write_text("\n".join(lines) + "\n")


def format_table(out_dir: str | Path) -> str:
    return (Path(out_dir) / "compare.md").read_text()
