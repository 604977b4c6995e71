"""CUDA correctness in one command: every device-sensitive path on the GPU, against the CPU.

    .venv/bin/python benchmarks/gpu_check.py [--device cuda[:N]] [--rounds 2] [--seeds 10] [--control] [--write]
    .venv/bin/python benchmarks/gpu_check.py --stand-in [--seeds 2] [--write]      # on a machine without a GPU

Items, one line each (PASS/FAIL, seconds), exit status 1 if any fails:

* ``tests``: the test suite's device-sensitive tests (:data:`DEVICE_TESTS`), run by pytest in a fresh
  interpreter (``--test-workers`` N: pytest-xdist with N processes) — with CUDA present the runs whose
  device is ``auto`` take the GPU; with ``--stand-in``: ``tests/test_devices.py``, which runs every
  item through the stand-in;
* ``run:NAME``: every item of :func:`fedcontrast.device_check.items` (each registered algorithm,
  DP-SGD, representation DP, FLESD's similarity upload, FedPCL pre-training, resume equal to the
  uninterrupted run, ``compare``, the linear probe, one OpenFL task-runner round) for ``--rounds``
  rounds on the device;
* ``cpu-vs-device:NAME``: each algorithm on digits where the models learn (2 sites, 2 rounds of 20
  local epochs, lr 0.01: 60-90 %), on the CPU and on the device, paired by seed over ``--seeds`` seeds
  (default 10). Criterion, stated here and in the output: the 95 % interval (Student's t) of the mean
  paired difference device − CPU, in points of accuracy, includes 0 or lies within ±``--bound`` points
  (default 1). One seed cannot tell a bug from noise: CPU and GPU float sums differ in their last bits,
  and training amplifies that into another trajectory whose accuracy differs by several points either way;
* ``repeat:NAME``: each algorithm run twice on the device for every one of those seeds (two jobs of
  the pool, each in whichever worker process is free): every pair bit-identical (deterministic kernels);
* with ``--control``, for reading the above: the same paired statistic between the CPU with 1 and with
  2 torch threads — a perturbation of the last bits alone, no device involved.

The seeded runs go to process pools (``--cpu-workers``, ``--device-workers``; 1 torch thread each), seed
by seed, within ``--agreement-budget`` seconds: fewer than ``--min-seeds`` finished pairs fail the item.

``--stand-in`` runs the same items on the CPU inside :func:`fedcontrast.devices.cpu_stand_in`
(torch's default device ``meta``: anything created without a device fails as it would on CUDA);
there the CPU-vs-device comparison must be exact (every seed bit-identical), so it needs no statistic:
its seeded runs are a smaller setting (:data:`STAND_IN`: 2 rounds of 2 local epochs; ``--seeds``
default 2), sized for a 2-core machine, in one pool of ``--cpu-workers`` (default: every core), and
every one of them runs to its end (no budget; every seed must pair; the pytest item's limit, 3600 s, is
only against a hang). ``--write`` records the run in benchmarks/RESULTS.md (section
``gpu_check_stand_in`` or ``gpu_check_cuda``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


# The stand-in's seeded setting: bit-identity to the CPU needs the device paths (2 rounds: aggregation
# and the next round's downlink), not models that learn.
STAND_IN = {"rounds": 2, "local_epochs": 2, "lr": 0.01}

DEVICE_TESTS = ["tests/algorithms", "tests/losses", "tests/models", "tests/privacy", "tests/test_devices.py",
                "tests/test_aggregation.py", "tests/test_dual_aggregation.py", "tests/test_linear_probe.py",
                "tests/test_nearest_prototype.py", "tests/robust/test_robust.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the GPU to check (default cuda)")
    parser.add_argument("--stand-in", action="store_true", help="run the items on the CPU through the stand-in")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the run: items")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds of the CPU-vs-device and repeat items (default 10; --stand-in: 2)")
    parser.add_argument("--min-seeds", type=int, default=None,
                        help="fewer finished seeds fail an item (default 5; --stand-in: every seed)")
    parser.add_argument("--bound", type=float, default=1.0, help="points: the criterion's bound (see above)")
    parser.add_argument("--control", nargs="*", default=None, metavar="ALGORITHM",
                        help="also the CPU with 1 against 2 threads, for these algorithms (none named: every one)")
    parser.add_argument("--cpu-workers", type=int, default=None,
                        help="processes of the CPU pool (default half the cores; --stand-in: every core)")
    parser.add_argument("--device-workers", type=int, default=4)
    parser.add_argument("--agreement-budget", type=float, default=None,
                        help="seconds for the seeded runs on the GPU (default 300; the stand-in's all finish)")
    parser.add_argument("--agreement-algorithms", nargs="*", default=None, help="default: every algorithm")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the pytest item")
    parser.add_argument("--test-workers", type=int, default=0, help="pytest-xdist processes (0: none)")
    parser.add_argument("--test-timeout", type=float, default=None,
                        help="seconds for the pytest item (default 600; --stand-in: 3600, only against a hang)")
    parser.add_argument("--only", nargs="*", default=None, help="run only items whose name contains one of these")
    parser.add_argument("--write", action="store_true", help="record the run in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.stand_in and args.agreement_budget is not None:
        parser.error("--agreement-budget is for the GPU run: the stand-in's seeded runs all run to their end")
    cores = os.cpu_count() or 2
    if args.seeds is None:
        args.seeds = 2 if args.stand_in else 10
    if args.min_seeds is None:
        args.min_seeds = args.seeds if args.stand_in else 5
    if args.cpu_workers is None:
        args.cpu_workers = cores if args.stand_in else max(1, cores // 2)
    if args.agreement_budget is None and not args.stand_in:
        args.agreement_budget = 300.0
    if args.test_timeout is None:
        args.test_timeout = 3600.0 if args.stand_in else 600.0
    if args.rounds < 1 or args.seeds < 2 or not 2 <= args.min_seeds <= args.seeds or args.bound < 0:
        parser.error("--rounds must be >= 1, --seeds >= 2, --min-seeds between 2 and --seeds, --bound >= 0")
    if (args.cpu_workers < 1 or args.device_workers < 1 or args.test_workers < 0
            or args.agreement_budget is not None and args.agreement_budget <= 0):
        parser.error("--cpu-workers and --device-workers must be >= 1, --agreement-budget > 0, --test-workers >= 0")

    import torch

    from fedcontrast import device_check
    from fedcontrast.algorithms import available_algorithms
    from fedcontrast.devices import cpu_stand_in, make_cuda_deterministic

    unknown = sorted((set(args.agreement_algorithms or []) | set(args.control or [])) - set(available_algorithms()))
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(available_algorithms())}")
    if args.stand_in:
        device, where = "cpu", cpu_stand_in
    else:
        if not torch.cuda.is_available():
            print("gpu_check: error: CUDA is not available on this machine; run it where a GPU is, or use --stand-in "
                  "to run the same items through the CPU stand-in", file=sys.stderr)
            return 2
        make_cuda_deterministic()  # before any CUDA work, as the engines do
        device, where = args.device, contextlib.nullcontext
    torch.set_num_threads(1)  # explicit: every item and every pooled run uses one torch thread
    results: list[tuple[str, bool, float, str]] = []

    def wanted(name: str) -> bool:
        return args.only is None or any(part in name for part in args.only)

    def check(name: str, job: Callable[[], str]) -> None:
        if not wanted(name):
            return
        start = time.perf_counter()
        try:
            note, ok = job(), True
        except Exception as exc:  # every failure is one line; the traceback goes to stderr
            traceback.print_exc(file=sys.stderr)
            note, ok = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}", False
        seconds = time.perf_counter() - start
        results.append((name, ok, seconds, note))
        print(f"{'PASS' if ok else 'FAIL'}  {name:<32} {seconds:7.1f} s  {note}", flush=True)

    if not args.skip_tests:
        check("tests", lambda: _pytest(args))
    on_device = device_check.items(device, rounds=args.rounds)
    for name, run in on_device.items():
        def job(run=run) -> str:
            with where():
                outcome = run()
            return "" if outcome.accuracy is None else f"accuracy {100 * outcome.accuracy:.2f} %"
        check(f"run:{name}", job)

    if args.write:  # what is measured so far, in case a time limit stops the rest
        _write(args, device, results, sum(r[2] for r in results), {}, {})
    algorithms = [a for a in (args.agreement_algorithms or available_algorithms())
                  if wanted(f"cpu-vs-device:{a}") or wanted(f"repeat:{a}")]
    runs, seconds = _seeded_runs(args, device, algorithms) if algorithms else ({}, 0.0)
    if algorithms:
        pools = (f"one pool of {args.cpu_workers} worker processes" if args.stand_in
                 else f"{args.cpu_workers} CPU and {args.device_workers} device worker processes")
        print(f"seeded runs: {sum(len(v) for v in runs.values())} in {seconds:.0f} s ({pools})", flush=True)
    stats: dict[str, device_check.Paired] = {}
    for name in algorithms:
        check(f"cpu-vs-device:{name}", lambda name=name: _versus(args, runs, name, stats))
    for name in algorithms:
        check(f"repeat:{name}", lambda name=name: _repeat(args, runs, name))
    control = {}
    if args.control is not None:
        for name in [a for a in algorithms if not args.control or a in args.control]:
            pairs = _pairs(runs, name, "cpu", "cpu-2threads")
            if len(pairs) >= 2:
                control[name] = device_check.paired(*zip(*[(a[0], b[0]) for a, b in pairs]))
                print(f"control  {name:<24} CPU 2 threads − CPU 1 thread: {control[name]}", flush=True)

    failed = [r for r in results if not r[1]]
    total = sum(r[2] for r in results)
    print(f"{len(results) - len(failed)} of {len(results)} items passed in {total:.0f} s"
          + (f"; failed: {', '.join(r[0] for r in failed)}" if failed else ""))
    if args.write:
        _write(args, device, results, total, stats, control)
    return 1 if failed else 0


ARMS = ("cpu", "device", "device-again", "cpu-2threads")


def _setting(args) -> dict[str, Any]:
    """The seeded runs' setting: :data:`STAND_IN` through the stand-in, else the models that learn."""
    from fedcontrast import device_check

    return STAND_IN if args.stand_in else device_check.AGREEMENT


def _seeded_run(algorithm: str, arm: str, seed: int, device: str, stand_in: bool, setting: dict[str, Any]):
    """One pooled run (in a worker process): (accuracy, fingerprint, seconds)."""
    from fedcontrast import device_check

    start = time.perf_counter()
    on_device = arm.startswith("device")
    accuracy, digest = device_check.seeded_run(algorithm, device if on_device else "cpu", seed,
                                               threads=2 if arm == "cpu-2threads" else 1,
                                               stand_in=stand_in and on_device, **setting)
    return accuracy, digest, time.perf_counter() - start


def _seeded_runs(args, device: str, algorithms: list[str]):
    """Every (algorithm, arm, seed) run, seed by seed, in two process pools (CPU arms; device arms),
    within ``--agreement-budget`` seconds (the stand-in: one pool, every run to its end); returns
    ``{(algorithm, arm): {seed: result or error}}``."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    controlled = set(algorithms if args.control == [] else args.control or [])
    spawn = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    cpu_pool = ProcessPoolExecutor(args.cpu_workers, mp_context=spawn)
    dev_pool = cpu_pool if args.stand_in else ProcessPoolExecutor(args.device_workers, mp_context=spawn)
    futures = {}
    start = time.perf_counter()
    for seed in range(args.seeds):
        for name in algorithms:
            for arm in ARMS if name in controlled else ARMS[:3]:
                pool = dev_pool if arm.startswith("device") else cpu_pool
                futures[pool.submit(_seeded_run, name, arm, seed, device, args.stand_in,
                                    _setting(args))] = (name, arm, seed)
    runs: dict[tuple[str, str], dict[int, Any]] = {}
    pending = set(futures)
    while pending:
        left = None if args.agreement_budget is None else args.agreement_budget - (time.perf_counter() - start)
        if left is not None and left <= 0:
            break
        done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        for future in done:
            name, arm, seed = futures[future]
            try:
                runs.setdefault((name, arm), {})[seed] = future.result()
            except Exception as exc:  # the run's error, kept as its result
                runs.setdefault((name, arm), {})[seed] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    for pool in {cpu_pool, dev_pool}:
        processes = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # runs past the budget: stopped
            if process.is_alive():
                process.terminate()
    return runs, time.perf_counter() - start


def _pairs(runs, name: str, a: str, b: str) -> list[tuple[tuple, tuple]]:
    """The seeds where both arms finished, as (a's result, b's result); an arm's error is raised."""
    first, second = runs.get((name, a), {}), runs.get((name, b), {})
    for arm, got in ((a, first), (b, second)):
        errors = [f"seed {s}: {r}" for s, r in sorted(got.items()) if isinstance(r, str)]
        if errors:
            raise RuntimeError(f"{arm} run failed: {errors[0]}")
    return [(first[s], second[s]) for s in sorted(set(first) & set(second))]


def _versus(args, runs, name: str, stats: dict) -> str:
    from fedcontrast import device_check

    pairs = _pairs(runs, name, "cpu", "device")
    if len(pairs) < args.min_seeds:
        raise AssertionError(f"only {len(pairs)} of {args.seeds} seeds finished on both (at least {args.min_seeds} "
                             "needed): raise --agreement-budget or the workers")
    if args.stand_in:  # the stand-in is the CPU: every seed must be bit-identical
        differing = [i for i, (a, b) in enumerate(pairs) if a[1] != b[1]]
        if differing:
            raise AssertionError(f"{len(differing)} of {len(pairs)} seeds differ between the CPU and the stand-in")
        return f"{len(pairs)} of {len(pairs)} seeds bit-identical to the CPU run"
    p = stats[name] = device_check.paired([a[0] for a, _ in pairs], [b[0] for _, b in pairs])
    print(f"seeds    {name}: CPU {' '.join(f'{100 * a[0]:.2f}' for a, _ in pairs)}; device "
          f"{' '.join(f'{100 * b[0]:.2f}' for _, b in pairs)}", flush=True)
    cpu = sum(a[0] for a, _ in pairs) / len(pairs)
    line = f"device − CPU {p} (CPU mean {100 * cpu:.1f} %)"
    if not device_check.agree(p, args.bound):
        raise AssertionError(f"{line}: the interval excludes 0 and leaves ±{args.bound:g} points")
    return line


def _repeat(args, runs, name: str) -> str:
    pairs = _pairs(runs, name, "device", "device-again")
    if len(pairs) < args.min_seeds:
        raise AssertionError(f"only {len(pairs)} of {args.seeds} seeds finished twice "
                             f"(at least {args.min_seeds} needed)")
    differing = [i for i, (a, b) in enumerate(pairs) if a[1] != b[1]]
    if differing:
        raise AssertionError(f"{len(differing)} of {len(pairs)} seeds differ between two runs on the device")
    return f"{len(pairs)} of {len(pairs)} seeds bit-identical (two pool jobs each)"


def _pytest(args) -> str:
    targets = ["tests/test_devices.py"] if args.stand_in else DEVICE_TESTS
    workers = ["-n", str(args.test_workers)] if args.test_workers else []
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *targets],
                              cwd=ROOT, capture_output=True, text=True, timeout=args.test_timeout)
    except subprocess.TimeoutExpired as exc:
        sys.stderr.write((exc.stdout or b"")[-6000:].decode(errors="replace") if isinstance(exc.stdout, bytes)
                         else (exc.stdout or "")[-6000:])
        raise AssertionError(f"pytest did not finish within {args.test_timeout:g} s") from None
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-12000:])
        raise AssertionError(f"pytest {' '.join(targets)}: {last}")
    return last.strip("= ")


def _write(args, device: str, results, total: float, stats: dict, control: dict) -> None:
    import torch
    from _results import machine, write_section

    name = "gpu_check_stand_in" if args.stand_in else "gpu_check_cuda"
    what = ("through the CPU stand-in (torch's default device `meta`; generators must be placed)" if args.stand_in
            else f"on {torch.cuda.get_device_name(torch.device(device))}")
    command = ("benchmarks/gpu_check.py" + (" --stand-in" if args.stand_in else f" --device {device}")
               + f" --rounds {args.rounds} --seeds {args.seeds}"
               + ("" if args.control is None else " --control" + "".join(f" {a}" for a in args.control))
               + (f" --test-workers {args.test_workers}" if args.test_workers else "") + " --write")
    setting = _setting(args)
    criterion = ("every seed bit-identical to the CPU run" if args.stand_in else
                 f"the 95 % interval of the mean paired difference (device − CPU) includes 0 or lies within "
                 f"±{args.bound:g} points")
    lines = [f"## CUDA correctness: `benchmarks/gpu_check.py{' --stand-in' if args.stand_in else ''}` "
             f"({datetime.date.today().isoformat()})", "",
             f"Command: `python {command}` — {what}; {machine()}.", "",
             f"{sum(r[1] for r in results)} of {len(results)} items passed in {total:.0f} s.", "",
             f"CPU against the device: digits, 2 sites, {setting['rounds']} rounds of {setting['local_epochs']} local "
             f"epochs, lr {setting['lr']}, seeds 0–{args.seeds - 1}, each run a job of a process pool, 1 torch "
             f"thread{', every run to its end' if args.stand_in else ''}. Criterion: {criterion}. Repeat: every "
             f"seed run twice on the device, bit-identical.", "",
             "| item | result | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {n} | {'PASS' if ok else 'FAIL'} | {s:.1f} | {note} |" for n, ok, s, note in results]
    if control:
        lines += ["", "Control (no device involved): the same paired statistic between the CPU with 2 and with 1 torch "
                      "thread, whose float sums differ only in their last bits:", "",
                  "| algorithm | CPU 2 threads − CPU 1 thread | device − CPU |", "|---|---|---|"]
        lines += [f"| {n} | {c} | {stats.get(n, '—')} |" for n, c in control.items()]
    if args.stand_in:
        lines += ["", "The same items on a real GPU: section `gpu_check_cuda` (`benchmarks/gpu_all.sh`)."]
    write_section(name, "\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
