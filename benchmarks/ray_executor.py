"""The simulator's sites on Ray against the sequential engine, side by side in one run.

    .venv/bin/python benchmarks/ray_executor.py [--sites 10 50] [--algorithms fedavg moon] [--rounds 4]

For each algorithm and number of sites (digits, Dirichlet 0.5, 2 local epochs): the mean time of a
round after the first (the first warms each worker's data up) for

* ``sequential`` with 1 torch thread, and with 2;
* ``ray`` with 2 sites at once, 1 thread each (a local Ray on 2 CPUs, started once: its start-up
  is measured on its own);

whether the ray run's metrics equal the 1-thread sequential run's (they must), and the whole run's
peak memory (PSS of the driver, plus every Ray process for a ray run, sampled every 0.2 s). Writes the
``ray_executor`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def run_pids(with_ray: bool) -> list[int]:
    """This process, and every Ray process on the machine (only this run's Ray runs here) when the
    run uses Ray."""
    import psutil

    pids = [os.getpid()]
    if not with_ray:
        return pids
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != os.getpid() and ("ray::" in cmd or "/ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd):
            pids.append(proc.info["pid"])
    return pids


class PeakMemory:
    def __init__(self, with_ray: bool) -> None:
        self.peak, self.stop, self.with_ray = 0.0, threading.Event(), with_ray

    def __enter__(self) -> PeakMemory:
        def watch() -> None:
            while not self.stop.wait(0.2):
                self.peak = max(self.peak, pss_mib(run_pids(self.with_ray)))
        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def timed_run(config, run_dir: Path, executor=None) -> tuple[list[float], float]:
    """Per-round seconds and peak PSS of one run."""
    from fedcontrast.sim.simulator import run_simulation

    times: list[float] = []
    last = [time.perf_counter()]

    def progress(done: int, total: int, row) -> None:
        now = time.perf_counter()
        if row is not None:
            times.append(now - last[0])
        last[0] = now

    with PeakMemory(executor is not None) as memory:
        run_simulation(config, run_dir, progress=progress, executor=executor)
    return times, memory.peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "moon"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-epochs", type=int, default=2)
    args = parser.parse_args(argv)

    from _results import machine, write_section

    from fedcontrast import device_check
    from fedcontrast.config import RunConfig, TrainingConfig
    from fedcontrast.sim.ray_executor import RayExecutor

    def config(algorithm: str, sites: int, kind: str, threads: int) -> RunConfig:
        executor = {"kind": kind, "site_cpus": threads, **({"cpus": 2} if kind == "ray" else {})}
        return RunConfig(algorithm=algorithm, dataset="digits", clients=sites, rounds=args.rounds, min_samples=5,
                         device="cpu", executor=executor,
                         training=TrainingConfig(local_epochs=args.local_epochs, batch_size=32))

    t0 = time.perf_counter()
    executor = RayExecutor(config("fedavg", 2, "ray", 1))
    startup = time.perf_counter() - t0
    rows = []
    try:
        for sites in args.sites:
            for algorithm in args.algorithms:
                with tempfile.TemporaryDirectory() as tmp:
                    tmp = Path(tmp)
                    seq1, mem_seq = timed_run(config(algorithm, sites, "sequential", 1), tmp / "seq1")
                    seq2, _ = timed_run(config(algorithm, sites, "sequential", 2), tmp / "seq2")
                    ray_t, mem_ray = timed_run(config(algorithm, sites, "ray", 1), tmp / "ray", executor)
                    equal = device_check.differences(device_check._metrics(tmp / "seq1"),
                                                     device_check._metrics(tmp / "ray")) == []
                mean = {k: sum(v[1:]) / max(len(v) - 1, 1) for k, v in (("seq1", seq1), ("seq2", seq2), ("ray", ray_t))}
                row = {"algorithm": algorithm, "sites": sites, **mean, "equal": equal, "mem_seq": mem_seq,
                       "mem_ray": mem_ray, "per_site_ms": 1000 * mean["seq1"] / sites}
                rows.append(row)
                print(f"{algorithm:7s} {sites:3d} sites: round sequential 1 thread {mean['seq1']:.2f} s, 2 threads "
                      f"{mean['seq2']:.2f} s, ray 2×1 {mean['ray']:.2f} s → speed-up {mean['seq1'] / mean['ray']:.2f}× "
                      f"(vs 2 threads {mean['seq2'] / mean['ray']:.2f}×); metrics equal: {equal}; peak PSS "
                      f"sequential {mem_seq:.0f} MiB, ray {mem_ray:.0f} MiB", flush=True)
    finally:
        executor.close()
    lines = ["## The simulator on Ray: `benchmarks/ray_executor.py`", "",
             f"Command: `.venv/bin/python benchmarks/ray_executor.py --sites {' '.join(map(str, args.sites))} "
             f"--algorithms {' '.join(args.algorithms)} --rounds {args.rounds}` ({machine()}).", "",
             f"Digits, Dirichlet 0.5, {args.local_epochs} local epochs, batch 32; a round's time is the mean of rounds "
             f"2–{args.rounds} (round 1 warms each Ray worker's data up). Ray: a local Ray on 2 CPUs, 2 sites at once, "
             f"1 thread each; its start-up: {startup:.1f} s. Memory: peak PSS of the driver (sequential), of the driver and every Ray process (ray).", "",
             "| algorithm | sites | sequential, 1 thread | sequential, 2 threads | ray, 2 × 1 thread | ray speed-up vs 1 thread | vs 2 threads | metrics equal | peak PSS sequential | peak PSS ray |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['sites']} | {r['seq1']:.2f} s | {r['seq2']:.2f} s | {r['ray']:.2f} s | "
              f"{r['seq1'] / r['ray']:.2f}× | {r['seq2'] / r['ray']:.2f}× | {'yes' if r['equal'] else 'NO'} | "
              f"{r['mem_seq']:.0f} MiB | {r['mem_ray']:.0f} MiB |" for r in rows]
    write_section("ray_executor", "\n".join(lines))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
