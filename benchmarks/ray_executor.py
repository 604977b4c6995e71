"""The simulator's sites on Ray against the sequential engine, side by side in one run.

    .venv/bin/python benchmarks/ray_executor.py [--sites 10 50] [--algorithms fedavg moon] [--rounds 4]

For each algorithm and number of sites (digits, Dirichlet 0.5, 2 local epochs): the median time of a
round after the first (the first warms each worker's data up), and of its training part, for

* ``sequential`` with 1 torch thread, and with 2;
* ``ray`` with 2 sites at once, 1 thread each (a local Ray on 2 CPUs, started once: its start-up
  is measured on its own);

whether the ray run's metrics equal the 1-thread sequential run's (they must), the whole run's peak
memory (PSS of the driver, and of it with every Ray process for a ray run, sampled every 0.2 s), Ray's
start-up and cost per task, and the cost model's parameters with its prediction for 1,000 sites on 64
cores. Writes the ``ray_executor`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _is_worker(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::")  # Ray renames its workers
    except OSError:
        return False


def run_pids(with_ray: bool) -> list[int]:
    """This process, and every Ray process on the machine (only this run's Ray runs here) when the
    run uses Ray."""
    import psutil

    pids = [os.getpid()]
    if not with_ray:
        return pids
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != os.getpid() and any(part in cmd for part in ("ray::", "/ray/", "raylet", "gcs_server")):
            pids.append(proc.info["pid"])
    return pids


class PeakMemory:
    """Peak PSS of this process (``peak_driver``), and of it with every Ray process (``peak``); the
    most Ray worker processes seen (``workers``)."""

    def __init__(self, with_ray: bool) -> None:
        self.peak, self.peak_driver, self.workers = 0.0, 0.0, 0
        self.stop, self.with_ray = threading.Event(), with_ray

    def __enter__(self) -> PeakMemory:
        def watch() -> None:
            while not self.stop.wait(0.2):
                pids = run_pids(self.with_ray)
                self.peak = max(self.peak, pss_mib(pids))
                self.peak_driver = max(self.peak_driver, pss_mib([os.getpid()]))
                self.workers = max(self.workers, sum(1 for pid in pids if _is_worker(pid)))
        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def timed_run(config, run_dir: Path, executor=None, *, memory: bool = False) -> dict:
    """One run: per-round seconds, the seconds its sites' training took per round (the executor's
    part), each site's (samples, seconds) in the sequential engine; with ``memory``, peak PSS instead
    (the driver alone, and the driver with every Ray process): sampling it takes CPU, so it is
    measured in runs of its own."""
    from fedcontrast.sim import federation as fed
    from fedcontrast.sim.simulator import run_simulation

    times: list[float] = []
    train: list[float] = []
    waited: list[float] = []  # per round: seconds the driver spent waiting for the sites (ray.wait)
    waiting = [0.0]
    per_site: list[tuple[int, float]] = []
    last = [time.perf_counter()]
    cpu: list[tuple[float, float]] = []  # per round: CPU seconds of the driver, and of every Ray worker
    last_cpu = [cpu_seconds(executor is not None)]

    def progress(done: int, total: int, row) -> None:
        now = time.perf_counter()
        used = cpu_seconds(executor is not None)
        if row is not None:
            times.append(now - last[0])
            waited.append(waiting[0])
            cpu.append((used[0] - last_cpu[0][0], used[1] - last_cpu[0][1]))
        waiting[0] = 0.0
        last[0], last_cpu[0] = now, used

    stock_sites, stock_site = fed.SequentialExecutor.train_sites, fed.Federation.train_site

    def train_sites(self, federation, sites, round_num):
        t0 = time.perf_counter()
        out = stock_sites(self, federation, sites, round_num)
        train.append(time.perf_counter() - t0)
        return out

    def train_site(self, site, round_num, received, *rest):
        t0 = time.perf_counter()
        out = stock_site(self, site, round_num, received, *rest)
        if round_num > 0:
            per_site.append((len(site.data), time.perf_counter() - t0))
        return out

    fed.SequentialExecutor.train_sites, fed.Federation.train_site = train_sites, train_site
    collect = None
    if executor is not None:
        collect = type(executor).collect
        executor.ray = TimedWait(executor.ray, waiting)

        def timed_collect(self, handle):
            out = collect(self, handle)
            train.append(self.last_round["seconds"])  # from sending the sites to their last outcome
            return out
        type(executor).collect = timed_collect
    try:
        with PeakMemory(executor is not None) if memory else contextlib.nullcontext() as peak:
            run_simulation(config, run_dir, progress=progress, executor=executor)
    finally:
        fed.SequentialExecutor.train_sites, fed.Federation.train_site = stock_sites, stock_site
        if collect is not None:
            type(executor).collect = collect
            executor.ray = executor.ray.module
    if memory:
        return {"pss": peak.peak, "pss_driver": peak.peak_driver, "workers": peak.workers}
    driver = [t - (w if executor is not None else s) for t, w, s in zip(times, waited, train)]
    return {"round": median_after_first(times), "train": median_after_first(train), "per_site": per_site,
            "rounds": times, "trains": train,  # every round's, for benchmarks/long_runs.py
            "driver": median_after_first(driver), "driver_cpu": median_after_first([c[0] for c in cpu]),
            "workers_cpu": median_after_first([c[1] for c in cpu])}


def cpu_seconds(with_ray: bool) -> tuple[float, float]:
    """(CPU seconds this process used so far, CPU seconds every Ray worker process used so far): a
    round's CPU, unlike its wall time, does not depend on what else runs on the machine."""
    import psutil

    workers = 0.0
    if with_ray:
        for proc in psutil.process_iter(["pid"]):
            if _is_worker(proc.info["pid"]):
                try:
                    workers += sum(proc.cpu_times()[:2])
                except psutil.Error:
                    pass
    return time.process_time(), workers


class TimedWait:
    """The ``ray`` module as the executor sees it, adding the seconds spent in ``ray.wait`` (the driver
    idle, waiting for sites) to ``total[0]``."""

    def __init__(self, module, total: list[float]) -> None:
        self.module, self.total = module, total

    def __getattr__(self, name: str):
        return getattr(self.module, name)

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.module.wait(*args, **kwargs)
        finally:
            self.total[0] += time.perf_counter() - t0


def median_after_first(values: list[float]) -> float:
    """The median of rounds 2.. (round 1 builds each worker's data; a median resists this shared
    machine's pauses)."""
    import statistics

    return statistics.median(values[1:] or values)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y ≈ a + b·x``."""
    import numpy as np

    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    b, a = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(y.mean()))
    return float(a), float(b)


def task_overhead(executor, config, repeats: int = 40) -> float:
    """Seconds a Ray task of no site costs, round trip (its arguments as a round's are)."""
    import ray

    from fedcontrast.sim.ray_executor import pack

    ref = ray.put(config.to_dict())
    received = ray.put(pack({"w": __import__("torch").zeros(92_326)}))
    ray.get([executor.remote.remote(ref, 0, received, [], 1) for _ in range(4)])  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        ray.get(executor.remote.remote(ref, 0, received, [], 1))
    return (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "moon"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--predict-sites", type=int, default=1000)
    parser.add_argument("--predict-cores", type=int, default=64)
    parser.add_argument("--driver", action="store_true",
                        help="the driver's part and site groups instead: FedAvg, sequential vs ray with a task per "
                             "site vs ray with groups of sites (the ray_executor_driver section)")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--min-samples", type=int, default=5)
    parser.add_argument("--runs", nargs="+", default=list(DRIVER_RUNS), choices=list(DRIVER_RUNS))
    parser.add_argument("--json", help="--driver: also write the rows to this JSON file")
    parser.add_argument("--before", help="--driver: rows of an earlier --json (e.g. the code before a change), "
                                         "shown beside these")
    parser.add_argument("--before-label", default="the code before",
                        help="--driver: what the --before rows ran, for the report")
    parser.add_argument("--no-section", action="store_true", help="print only; leave RESULTS.md as it is")
    parser.add_argument("--section", help="--driver: the RESULTS.md section to write (default ray_executor_driver, "
                                          "with _DATASET beyond digits)")
    args = parser.parse_args(argv)
    if args.driver:
        return driver_main(args)

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
        overhead = task_overhead(executor, config("fedavg", 10, "ray", 1))
        print(f"Ray start-up {startup:.1f} s; a task of no site {1000 * overhead:.1f} ms round trip", flush=True)
        for sites in args.sites:
            for algorithm in args.algorithms:
                with tempfile.TemporaryDirectory() as tmp:
                    tmp = Path(tmp)
                    seq1 = timed_run(config(algorithm, sites, "sequential", 1), tmp / "seq1")
                    seq2 = timed_run(config(algorithm, sites, "sequential", 2), tmp / "seq2")
                    ray_r = timed_run(config(algorithm, sites, "ray", 1), tmp / "ray", executor)
                    seq1.update(timed_run(config(algorithm, sites, "sequential", 1), tmp / "m1", memory=True))
                    ray_r.update(timed_run(config(algorithm, sites, "ray", 1), tmp / "m2", executor, memory=True))
                    equal = device_check.differences(device_check._metrics(tmp / "seq1"),
                                                     device_check._metrics(tmp / "ray")) == []
                site_fit = fit_line(seq1["per_site"])
                work = sum(s for _, s in seq1["per_site"]) / max(args.rounds - 1, 1)  # site-seconds per round
                row = {"algorithm": algorithm, "sites": sites, "seq1": seq1, "seq2": seq2, "ray": ray_r,
                       "equal": equal, "site_fit": site_fit, "work": work,
                       "driver": seq1["round"] - seq1["train"],  # aggregation, evaluation, checkpoint, outputs
                       "samples": sum(n for n, _ in seq1["per_site"]) / max(len(seq1["per_site"]), 1),
                       # dispatch cost per site: the ray round's training part beyond its ideal (the work
                       # spread over the 2 slots)
                       "per_site_overhead": max(ray_r["train"] - work / 2, 0.0) / sites}
                rows.append(row)
                print(f"{algorithm:7s} {sites:3d} sites: round sequential 1 thread {seq1['round']:.3f} s, 2 threads "
                      f"{seq2['round']:.3f} s, ray 2×1 {ray_r['round']:.3f} s → {seq1['round'] / ray_r['round']:.2f}× "
                      f"(vs 2 threads {seq2['round'] / ray_r['round']:.2f}×); metrics equal: {equal}; driver part "
                      f"{row['driver']:.3f} s; overhead {1000 * row['per_site_overhead']:.2f} ms/site; peak PSS "
                      f"sequential {seq1['pss']:.0f} MiB, ray driver {ray_r['pss_driver']:.0f} MiB, ray all "
                      f"{ray_r['pss']:.0f} MiB ({ray_r['workers']} Ray workers)", flush=True)
    finally:
        executor.close()
    write_section("ray_executor", report(args, rows, startup, overhead, machine()))
    return 0 if all(r["equal"] for r in rows) else 1


DRIVER_RUNS = {"sequential": "sequential, 1 thread", "ray1": "ray, a task per site",
               "ray": "ray, groups of sites (automatic)"}


def driver_main(args) -> int:
    """Sequential vs ray with a task per site vs ray with groups of sites (``--sites-per-task``
    automatic), FedAvg: s per round and the driver's part of it (ms per site), side by side."""
    import json

    from _results import machine, write_section

    from fedcontrast import device_check
    from fedcontrast.config import RunConfig, TrainingConfig
    from fedcontrast.sim.ray_executor import RayExecutor

    def config(sites: int, run: str) -> RunConfig:
        executor = ({"kind": "sequential", "site_cpus": 1} if run == "sequential" else
                    {"kind": "ray", "site_cpus": 1, "cpus": 2, **({"sites_per_task": 1} if run == "ray1" else {})})
        data = ({"min_samples": args.min_samples} if args.dataset != "fedprox_synthetic"
                else {"partition": "natural"})
        return RunConfig(algorithm="fedavg", dataset=args.dataset, clients=sites, rounds=args.rounds, device="cpu",
                         executor=executor, training=TrainingConfig(local_epochs=args.local_epochs, batch_size=32),
                         **data)

    args.load = [os.getloadavg()[0]]  # other work on the machine, at the start and at the end
    executor = RayExecutor(config(2, "ray")) if any(r != "sequential" for r in args.runs) else None
    rows = []
    try:
        for sites in args.sites:
            with tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                for run in args.runs:
                    t0 = time.perf_counter()
                    timing = timed_run(config(sites, run), tmp / run, None if run == "sequential" else executor)
                    row = {"dataset": args.dataset, "sites": sites, "run": run, "round": timing["round"],
                           "driver": timing["driver"], "whole": time.perf_counter() - t0,
                           "driver_cpu": timing["driver_cpu"], "workers_cpu": timing["workers_cpu"],
                           "equal": None if run == "sequential" or "sequential" not in args.runs else
                           device_check.differences(device_check._metrics(tmp / "sequential"),
                                                    device_check._metrics(tmp / run)) == []}
                    rows.append(row)
                    print(f"{args.dataset} {sites} sites, {DRIVER_RUNS[run]}: {row['round']:.3f} s/round, driver "
                          f"{row['driver']:.3f} s ({1000 * row['driver'] / sites:.3f} ms/site); CPU per round: "
                          f"driver {row['driver_cpu']:.3f} s, Ray workers {row['workers_cpu']:.3f} s; metrics equal "
                          f"to sequential: {row['equal']}", flush=True)
    finally:
        if executor is not None:
            executor.close()
    args.load.append(os.getloadavg()[0])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    before = json.loads(Path(args.before).read_text()) if args.before else []
    if not args.no_section:
        name = args.section or ("ray_executor_driver" + ("" if args.dataset == "digits" else f"_{args.dataset}"))
        write_section(name, driver_report(args, rows, before, machine()))
    return 0 if all(r["equal"] is not False for r in rows) else 1


def driver_report(args, rows: list[dict], before: list[dict], machine: str) -> str:
    seq = {(r["dataset"], r["sites"]): r["round"] for r in rows if r["run"] == "sequential"}  # now's, beside
    lines = [f"## The simulator's driver and site groups on Ray ({args.dataset}): `benchmarks/ray_executor.py "
             "--driver`", "",
             f"Command: `.venv/bin/python benchmarks/ray_executor.py --driver --dataset {args.dataset} --sites "
             f"{' '.join(map(str, args.sites))} --rounds {args.rounds} --local-epochs {args.local_epochs}"
             f"{f' --min-samples {args.min_samples}' if args.dataset != 'fedprox_synthetic' else ''} --runs "
             f"{' '.join(args.runs)}{' --before BEFORE.json' if before else ''}"
             f"{f' --section {args.section}' if args.section else ''}` ({machine}).", "",
             f"FedAvg on {args.dataset}, {args.local_epochs} local epoch(s), batch 32, one thread per site; a local "
             "Ray on 2 CPUs (2 site slots), started once. A round's time is the median of rounds "
             f"2–{args.rounds}. The driver's part: the round's time less the time the driver waited for sites "
             "(in `ray.wait`; sequential: less the sites' training, which now includes each site measuring its "
             "upload for the screen) — validation, the upload screen, aggregation, the abnormal-move check, "
             "evaluation, checkpoint and records. The machine's load average (1 min) was "
             f"{args.load[0]:.1f} at the start and {args.load[-1]:.1f} at the end (2 cores; above 2: other work "
             "ran beside these runs and slowed the two Ray workers more than the one sequential process)."
             + (f" Rows `before`: {args.before_label}, measured by this script with `--runs sequential ray --json "
                "BEFORE.json --no-section` just before." if before else ""), "",
             "Beside the wall times, each round's CPU seconds: the driver process's, and the Ray workers' (all "
             "of them together). CPU does not depend on what else runs on the machine: on two free cores a "
             "ray round takes about max(workers' CPU ÷ 2, the driver's CPU) — the `free cores` column, an "
             "estimate — against the sequential round's CPU (its driver's CPU: the sites train in it).", "",
             "| code | sites | run | s per round | ÷ sequential | driver per round | driver per site "
             "| CPU per round: driver, Ray workers | free cores: round, ÷ sequential CPU "
             "| metrics equal to sequential |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, group in (("before", before), ("now", rows)):
        for r in group:
            base = seq.get((r["dataset"], r["sites"])) if label == "now" else next(
                (b["round"] for b in before if b["run"] == "sequential" and b["sites"] == r["sites"]), None)
            ratio = f"{base / r['round']:.2f}×" if base and r["run"] != "sequential" else "—"
            equal = {None: "—", True: "yes", False: "NO"}[r["equal"]]
            seq_cpu = next((b.get("driver_cpu") for b in group
                            if b["run"] == "sequential" and b["sites"] == r["sites"]), None)
            cpu = (f"{r['driver_cpu']:.3f} s, {r['workers_cpu']:.3f} s" if r.get("driver_cpu") is not None else "—")
            free = "—"
            if r.get("driver_cpu") is not None and r["run"] != "sequential" and seq_cpu:
                estimate = max(r["workers_cpu"] / 2, r["driver_cpu"])
                free = f"{estimate:.3f} s, {seq_cpu / estimate:.2f}×"
            lines.append(f"| {label} | {r['sites']} | {DRIVER_RUNS[r['run']]} | {r['round']:.3f} s | {ratio} | "
                         f"{r['driver']:.3f} s | {1000 * r['driver'] / r['sites']:.3f} ms | {cpu} | {free} | {equal} |")
    return "\n".join(lines)


def report(args, rows: list[dict], startup: float, overhead: float, machine: str) -> str:
    lines = ["## The simulator on Ray: `benchmarks/ray_executor.py`", "",
             f"Command: `.venv/bin/python benchmarks/ray_executor.py --sites {' '.join(map(str, args.sites))} "
             f"--algorithms {' '.join(args.algorithms)} --rounds {args.rounds}` ({machine}).", "",
             f"Digits, Dirichlet 0.5, {args.local_epochs} local epochs, batch 32. A round's time is the median of "
             f"rounds 2–{args.rounds} (round 1 warms each Ray worker's data up). Ray: a local Ray on 2 CPUs, 2 sites "
             f"at once, 1 thread each; its start-up: {startup:.1f} s; a Ray task of no site costs "
             f"{1000 * overhead:.1f} ms round trip. All runs are in one process, side by side.", "",
             "| algorithm | sites | sequential, 1 thread | sequential, 2 threads | ray, 2 × 1 thread "
             "| ray ÷ seq. 1 thread | ray ÷ seq. 2 threads | metrics equal | driver part of a round "
             "| ray overhead per site |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['sites']} | {r['seq1']['round']:.3f} s | {r['seq2']['round']:.3f} s | "
              f"{r['ray']['round']:.3f} s | {r['seq1']['round'] / r['ray']['round']:.2f}× | "
              f"{r['seq2']['round'] / r['ray']['round']:.2f}× | {'yes' if r['equal'] else 'NO'} | "
              f"{r['driver']:.3f} s | {1000 * r['per_site_overhead']:.2f} ms |" for r in rows]
    lines += ["", "Memory, peak PSS over the whole run (sampled every 0.2 s):", "",
              "| algorithm | sites | sequential (one process) | ray: driver | ray: driver + every Ray process "
              "| Ray workers |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['sites']} | {r['seq1']['pss']:.0f} MiB | {r['ray']['pss_driver']:.0f} MiB | "
              f"{r['ray']['pss']:.0f} MiB | {r['ray']['workers']} |" for r in rows]
    lines += cost_model(args, rows, overhead)
    return "\n".join(lines)


def cost_model(args, rows: list[dict], overhead: float) -> list[str]:
    """The cost model, its parameters from the rows, and what it predicts for ``--predict-sites`` on
    ``--predict-cores``."""
    import math

    n, cores = args.predict_sites, args.predict_cores
    bounds: list[tuple[float, float]] = []
    out = ["", "### Cost model", "",
           "A round on the ray executor with `S` site slots (cores ÷ `site_cpus`) and `n` selected sites, sent as "
           "`2S` balanced tasks:", "",
           "    round ≈ max(driver(n), max over slots of Σ its sites' (train(site) + transfer)) + 2·task",
           "    train(site) ≈ a + b·samples(site)        driver(n) ≈ c + d·n",
           "",
           "`driver(n)` is the driver's own part (aggregation, evaluation, checkpoint, metrics): it overlaps the next "
           "round's training, because the executor sends the next round's sites as soon as the aggregate exists. "
           "`task` is a Ray task's round trip; `transfer` (packing the site's downlink, state and uploads as numpy "
           "arrays, Ray's object store) is measured inside the overhead per site above.", "",
           "| algorithm | a (ms) | b (ms/sample) | c (s) | d (ms/site) | overhead per site (ms), 50 sites "
           f"| predicted round, {n} sites on {cores} cores |",
           "|---|---|---|---|---|---|---|"]
    for algorithm in args.algorithms:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        if not mine:
            continue
        a, b = fit_line([p for r in mine for p in r["seq1"]["per_site"]])
        c, d = fit_line([(r["sites"], r["driver"]) for r in mine]) if len(mine) > 1 else (mine[0]["driver"], 0.0)
        biggest = max(mine, key=lambda r: r["sites"])
        o = biggest["per_site_overhead"]
        samples = biggest["samples"]
        per_slot = math.ceil(n / cores)
        train = per_slot * (a + b * samples + o)
        driver = c + d * n
        predicted = max(driver, train) + 2 * overhead
        bounds.append((train, driver))
        out.append(f"| {algorithm} | {1000 * a:.1f} | {1000 * b:.3f} | {c:.3f} | {1000 * d:.2f} | {1000 * o:.2f} | "
                   f"{predicted:.2f} s (training {train:.2f} s: {per_slot} sites per slot of "
                   f"{samples:.0f} samples; driver {driver:.2f} s) |")
    bound = ("the driver's part is the larger: the round is bound by the driver (its upload screen — digests, "
             "bounds, the abnormal-move check — aggregation, evaluation and checkpoint, all linear in the sites), not "
             "by the cores; spreading that work is what would pay next" if any(r[1] > r[0] for r in bounds)
             else "training is the larger: the round is bound by the cores")
    out += ["", f"The prediction takes each of the {n} sites as large as a site of the largest run above (its mean "
            f"samples), one thread per site, all {cores} cores as site slots and the driver's line extrapolated. There "
            f"{bound}. The overhead per site is the ray round's training part beyond the sites' sequential work "
            "spread over the 2 slots, divided by the sites: it also holds the slowdown of two processes sharing two "
            "cores with the driver and Ray, so it is an upper bound on dispatch and transfer. The inputs are "
            "measured here on 2 cores; a 64-core server's per-core speed, memory bandwidth and disk change `a`, `b` "
            "and `driver`: treat the prediction as the shape, not a promise."]
    return out


if __name__ == "__main__":
    sys.exit(main())
