"""The plugins on Flower's simulation runtime against the in-process simulator, side by side in one run.

    .venv-flower/bin/python benchmarks/flower_simulation.py [--sites 10 50] [--algorithms moon] [--rounds 6]

Runs in the Flower environment (the extra ``[flower]``; it cannot share one with OpenFL). For each
algorithm and number of sites (digits, Dirichlet 0.5, 2 local epochs, one thread per site): the
median time of a round after the first, for

* the in-process simulator, sequential engine, 1 thread;
* the simulator's Ray executor (2 sites at once, 1 thread each; the Ray that flwr[simulation] brings);
* the simulator's round loop in a Flower ServerApp with the sites on Flower's simulation runtime
  (``--executor flower``; one SuperNode per site, 1 CPU each, so 2 at once on 2 cores),

whether each run's metrics equal the sequential run's, and each runtime's start-up (from the call to
the first round's end, less the sequential engine's first round). Writes the ``flower_simulation``
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(run, config, out: Path) -> tuple[float, list[float]]:
    """``run(config, out, progress=...)``: (seconds from the call to the end of round 1, each round's seconds)."""
    marks: list[float] = []

    def progress(done: int, total: int, row) -> None:
        if row is not None:
            marks.append(time.perf_counter())

    t0 = time.perf_counter()
    run(config, out, progress=progress)
    rounds = [b - a for a, b in zip(marks, marks[1:])]
    return marks[0] - t0, rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--algorithms", nargs="+", default=["moon"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-epochs", type=int, default=2)
    args = parser.parse_args(argv)

    from _results import machine, write_section

    from fedcontrast import device_check
    from fedcontrast.config import RunConfig, TrainingConfig
    from fedcontrast.sim.flower_executor import run_on_flower
    from fedcontrast.sim.ray_executor import RayExecutor
    from fedcontrast.sim.simulator import run_simulation

    def config(algorithm: str, sites: int, kind: str) -> RunConfig:
        executor = {"kind": kind, "site_cpus": 1, **({"cpus": 2} if kind == "ray" else {})}
        return RunConfig(algorithm=algorithm, dataset="digits", clients=sites, rounds=args.rounds, min_samples=5,
                         device="cpu", executor=executor,
                         training=TrainingConfig(local_epochs=args.local_epochs, batch_size=32))

    rows = []
    for sites in args.sites:
        for algorithm in args.algorithms:
            with tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                first_seq, seq = timed(run_simulation, config(algorithm, sites, "sequential"), tmp / "seq")
                first_ray, ray_rounds = timed(run_simulation, config(algorithm, sites, "ray"), tmp / "ray")
                first_fl, fl = timed(run_on_flower, config(algorithm, sites, "flower"), tmp / "flower")
                reference = device_check._metrics(tmp / "seq")
                equal = {k: device_check.differences(reference, device_check._metrics(tmp / k)) == []
                         for k in ("ray", "flower")}
            med = {k: statistics.median(v) for k, v in (("seq", seq), ("ray", ray_rounds), ("flower", fl))}
            row = {"algorithm": algorithm, "sites": sites, **med, "equal": equal,
                   "startup_ray": first_ray - first_seq, "startup_flower": first_fl - first_seq}
            rows.append(row)
            print(f"{algorithm} {sites} sites: round sequential {med['seq']:.3f} s, ray {med['ray']:.3f} s, flower "
                  f"{med['flower']:.3f} s; start-up beyond the simulator's ray {row['startup_ray']:.1f} s, flower "
                  f"{row['startup_flower']:.1f} s; metrics equal {equal}", flush=True)
    del RayExecutor  # imported only to fail early where Ray is missing
    lines = ["## The plugins on Flower's simulation runtime: `benchmarks/flower_simulation.py`", "",
             f"Command: `.venv-flower/bin/python benchmarks/flower_simulation.py --sites "
             f"{' '.join(map(str, args.sites))} --algorithms {' '.join(args.algorithms)} --rounds {args.rounds}` "
             f"({machine()}; flwr 1.42 with its Ray).", "",
             f"Digits, Dirichlet 0.5, {args.local_epochs} local epochs, one thread per site; a round's time is the "
             f"median of rounds 2–{args.rounds}. Ray and Flower run 2 sites at once on the 2 cores. Start-up: the "
             "time to the end of round 1 beyond the sequential engine's.", "",
             "| algorithm | sites | simulator, sequential | simulator, ray executor | Flower simulation runtime | "
             "Flower round time ÷ sequential (above 1: slower) | metrics equal (ray, Flower) | start-up: ray, Flower |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['sites']} | {r['seq']:.3f} s | {r['ray']:.3f} s | {r['flower']:.3f} s | "
              f"{r['flower'] / r['seq']:.2f}× | {'yes' if r['equal']['ray'] else 'NO'}, "
              f"{'yes' if r['equal']['flower'] else 'NO'} | {r['startup_ray']:.1f} s, {r['startup_flower']:.1f} s |"
              for r in rows]
    write_section("flower_simulation", "\n".join(lines))
    return 0 if all(all(r["equal"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
