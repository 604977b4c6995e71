"""Secure aggregation's cost in the simulator: rounds with and without it (FedAvg, MOON and the
secure-sum variants of FedSSC, FedPCL, FLESD; digits).

    .venv/bin/python benchmarks/secure_aggregation.py [--sites 3 10 50] [--rounds 5] [--seeds 0 1 2]
        [--algorithms fedavg moon | fedssc fedpcl flesd] [--threads 2] [--neighbours auto full]

Per configuration, the same run twice (same seed, threads, shards), plain and with
`secure_aggregation` (32-bit ring, default clip and threshold ⌊2n/3⌋ + 1; the deployments' own relay
and site steps in one process, consistency round included): seconds per round (median of rounds
2 …), bytes one site sends per round (its advert, encrypted shares, masked vector, consistency
signature and reveals, as the messages' payloads; plain: its float32 upload), the protocol's CPU time
per site and at the aggregator, and the final accuracy over the seeds. A plugin runs in its secure-summable variant
(``SECURE_VARIANTS``: FedSSC ``class_reps: pooled``, FedPCL ``local_sets: global``); where that is
not its default, its default runs too, without secure aggregation, so the table shows what the
variant costs in accuracy. FedAvg/FedProx/MOON write the section ``secure_aggregation``, the other
plugins ``secure_aggregation_plugins``. ``--neighbours``: the graphs to run secure aggregation with
(``secure_aggregation.neighbours``: ``auto`` is SecAgg+'s neighbourhood graph above ~80 sites, ``full``
every pair of sites; one row each, column k). ``--protocol-only WORDS``: no training, the protocol alone
on random vectors of WORDS values (every party in this process, one round, no dropouts), for as many
sites as ``--sites`` (e.g. 1000): the section ``secure_aggregation_protocol``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _results import machine, write_section

from fedcontrast.config import RunConfig, TrainingConfig
from fedcontrast.privacy.secagg_graph import neighbourhood_size
from fedcontrast.sim import run_simulation

# The settings under which a plugin is secure-summable (empty: its default already is).
SECURE_VARIANTS = {"fedavg": {}, "fedprox": {}, "moon": {}, "flesd": {},
                   "fedssc": {"class_reps": "pooled"}, "fedpcl": {"local_sets": "global"}}
WEIGHT_PLUGINS = ("fedavg", "fedprox", "moon")


DATA = {"dataset": "digits", "min_samples": 5, "local_epochs": 10, "bits": 32}  # set by main's flags


def one(algorithm: str, settings: dict, sites: int, rounds: int, seed: int, secure: bool | str, out: Path) -> dict:
    """One run; ``secure``: False, or the graph (``auto``, ``full`` or k) to run secure aggregation with."""
    neighbours = int(secure) if isinstance(secure, str) and secure.isdigit() else secure
    data = ({"min_samples": DATA["min_samples"]} if DATA["dataset"] != "fedprox_synthetic"
            else {"partition": "natural"})
    config = RunConfig(algorithm=algorithm, dataset=DATA["dataset"], clients=sites, rounds=rounds, seed=seed,
                       training=TrainingConfig(local_epochs=DATA["local_epochs"]), **data,
                       hyperparameters={algorithm: settings} if settings else {},
                       secure_aggregation={"neighbours": neighbours, "bits": DATA["bits"]} if secure else None)
    stamps: list[float] = []
    summary = run_simulation(config, out, progress=lambda d, t, row: stamps.append(time.perf_counter()))
    with open(out / "metrics.csv") as f:
        cost = [json.loads(r["extra"]) for r in csv.DictReader(f) if r["task"] == "secure_aggregation"]
    per_round = statistics.median([b - a for a, b in zip(stamps, stamps[1:])][1:])
    return {"round_s": per_round, "accuracy": summary["final_accuracy"], "cost": cost[-1] if cost else None}


def protocol_only(args) -> None:
    """The protocol's CPU alone (:func:`~fedcontrast.privacy.secagg_sim.secure_sum`) per site count and graph."""
    import numpy as np

    from fedcontrast.config.sections import SecureAggregationConfig
    from fedcontrast.privacy.secagg_sim import secure_sum

    lines = ["## Secure aggregation's protocol alone: `benchmarks/secure_aggregation.py --protocol-only`", "",
             f"Command: `.venv/bin/python benchmarks/secure_aggregation.py --protocol-only {args.protocol_only} "
             f"--sites {' '.join(map(str, args.sites))} --neighbours {' '.join(args.neighbours)}` on {machine()}, "
             f"{time.strftime('%Y-%m-%d')}. One round, every party in one process, vectors of {args.protocol_only} "
             "values in [-1, 1], 32-bit ring, default threshold, no dropouts.", "",
             "| sites | k | t_k | CPU per site (keys, shares, masking, signatures, reveal) | "
             "at the aggregator (unmask) | all, wall | bytes / site |", "|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for sites in args.sites:
        vectors = {f"site_{i:04d}": rng.uniform(-1, 1, args.protocol_only) for i in range(sites)}
        for graph in args.neighbours:
            settings = SecureAggregationConfig(neighbours=int(graph) if graph.isdigit() else graph)
            began = time.perf_counter()
            _, cost = secure_sum(vectors, settings, 1, session=b"benchmark")
            wall = time.perf_counter() - began
            from fedcontrast.privacy.secagg_graph import neighbourhood_threshold

            k = cost.neighbours
            t_k = cost.threshold if k >= sites - 1 else neighbourhood_threshold(k)
            full = " (full)" if k >= sites - 1 else ""
            line = (f"| {sites} | {k}{full} | {t_k} | {cost.site_seconds * 1000:.0f} ms | "
                    f"{cost.aggregator_seconds:.2f} s | {wall:.1f} s | {cost.bytes_per_site:.0f} |")
            print(line, flush=True)
            lines.append(line)
    lines += ["", "In a deployment each site does its own work at once; here the sites' work adds up in one process."]
    write_section("secure_aggregation_protocol", "\n".join(lines))


def accuracy(runs: list[dict]) -> str:
    values = [100 * r["accuracy"] for r in runs]
    return f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[3, 10, 50])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "moon"], choices=sorted(SECURE_VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a shared machine)")
    parser.add_argument("--neighbours", nargs="+", default=["auto"],
                        help="secure_aggregation.neighbours to run with: auto, full or an even k")
    parser.add_argument("--protocol-only", type=int, default=0, metavar="WORDS",
                        help="time the protocol alone on vectors of WORDS values (no training)")
    parser.add_argument("--section", default=None, help="the RESULTS.md section to write (default: "
                        "secure_aggregation, or secure_aggregation_plugins for FedSSC/FedPCL/FLESD)")
    parser.add_argument("--dataset", default="digits", help="digits, or fedprox_synthetic for 1,000 sites")
    parser.add_argument("--local-epochs", type=int, default=10)
    parser.add_argument("--min-samples", type=int, default=5)
    parser.add_argument("--bits", type=int, default=32, choices=[32, 64],
                        help="the ring (64 for ~1,000 sites: 32 bits leave too few fractional bits)")
    args = parser.parse_args()
    DATA.update(dataset=args.dataset, local_epochs=args.local_epochs, min_samples=args.min_samples, bits=args.bits)
    torch.set_num_threads(args.threads)
    if args.protocol_only:
        protocol_only(args)
        return
    default_data = {"dataset": "digits", "min_samples": 5, "local_epochs": 10, "bits": 32}
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    plugins = not set(args.algorithms) <= set(WEIGHT_PLUGINS)
    title = ("## Secure aggregation of FedSSC, FedPCL and FLESD in the simulator" if plugins else
             "## Secure aggregation in the simulator")
    lines = [f"{title}: `benchmarks/secure_aggregation.py`", "",
             f"Command: `.venv/bin/python benchmarks/secure_aggregation.py --sites {' '.join(map(str, args.sites))} "
             f"--rounds {args.rounds} --seeds {' '.join(map(str, args.seeds))} "
             f"--algorithms {' '.join(args.algorithms)} --threads {args.threads} "
             f"--neighbours {' '.join(args.neighbours)}"
             + "".join(f" --{k.replace('_', '-')} {v}" for k, v in DATA.items() if v != default_data[k])
             + (f" --section {args.section}" if args.section else "")
             + f"` on {machine()}, {time.strftime('%Y-%m-%d')}. "
             + ("Digits, Dir(0.5)" if args.dataset == "digits" else args.dataset)
             + f", {args.local_epochs} local epochs, {args.bits}-bit ring, default threshold ⌊2n/3⌋ + 1, the "
             "consistency round (five messages per site). Load average (1 min) at the start: "
             f"{os.getloadavg()[0]:.1f}.", "",
             "| algorithm | secure variant | sites | k | s / round plain | s / round secure | ratio "
             "| bytes / site / round plain | secure | ratio | protocol CPU per site | at the aggregator "
             "| final accuracy: default, plain | variant, plain | variant, secure |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def runs(algorithm, sites, settings, secure):
        """:func:`one` for each seed, each in its own folder."""
        return [one(algorithm, settings, sites, args.rounds, seed, secure,
                    tmp / f"{algorithm}{sites}{seed}{secure}{bool(settings)}") for seed in args.seeds]

    for algorithm in args.algorithms:
        variant = SECURE_VARIANTS[algorithm]
        label = ", ".join(f"{k}: {v}" for k, v in variant.items()) or "(the default)"
        for sites in args.sites:
            plain = runs(algorithm, sites, variant, False)
            default = accuracy(runs(algorithm, sites, {}, False)) if variant else "(same)"
            r_plain = statistics.median(r["round_s"] for r in plain)
            graphs = {neighbourhood_size(sites, int(g) if g.isdigit() else g): g for g in reversed(args.neighbours)}
            for graph in reversed(list(graphs.values())):  # one run per distinct k (auto is full at 50 sites)
                secure = runs(algorithm, sites, variant, graph)
                r_secure = statistics.median(r["round_s"] for r in secure)
                cost = secure[0]["cost"]
                k = int(cost.get("neighbours") or sites - 1)
                full = " (full)" if k >= sites - 1 else ""
                line = (f"| {algorithm} | {label} | {sites} | {k}{full} | {r_plain:.3f} | "
                        f"{r_secure:.3f} | {r_secure / r_plain:.2f}× | "
                        f"{cost['plain_bytes_per_site']:.0f} | {cost['bytes_per_site']:.0f} | "
                        f"{cost['bytes_per_site'] / cost['plain_bytes_per_site']:.3f}× | "
                        f"{cost['site_cpu_s'] * 1000:.0f} ms | {cost['aggregator_cpu_s'] * 1000:.0f} ms | {default} | "
                        f"{accuracy(plain)} | {accuracy(secure)} |")
                print(line, flush=True)
                lines.append(line)
    lines += ["", f"Total {(time.perf_counter() - t0) / 60:.1f} min; load average (1 min) at the end "
              f"{os.getloadavg()[0]:.1f} (2 cores: above 2, other work ran beside). Times are wall-clock of the "
              "simulator's round (sites one after another in one process), so the protocol's work of every site adds "
              "up in one round "
              "here; in a deployment each site does its own share. Accuracy: mean ± std over the seeds (FedPCL: "
              "personalised, by nearest global prototype; FLESD: linear probe)."]
    if not plugins:
        lines.append("Goal (issues 26, 33): under 1.3× the round time and 1.2× the bytes at 10 sites for FedAvg; "
                     "issue 38: at most 2× at 100 sites. k: each site's neighbours (SecAgg+, "
                     "`secure_aggregation.neighbours`; full: every other site).")
    write_section(args.section or ("secure_aggregation_plugins" if plugins else "secure_aggregation"), "\n".join(lines))


if __name__ == "__main__":
    main()
