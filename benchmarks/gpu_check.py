"""CUDA correctness in one command: every device-sensitive path on the GPU, against the CPU.

    .venv/bin/python benchmarks/gpu_check.py [--device cuda[:N]] [--rounds 2] [--skip-tests] [--write]
    .venv/bin/python benchmarks/gpu_check.py --stand-in [--write]      # on a machine without a GPU

Items, one line each (PASS/FAIL, seconds), exit status 1 if any fails:

* ``tests``: the test suite's device-sensitive tests, run by pytest in a fresh interpreter — with
  CUDA present the runs whose device is ``auto`` take the GPU (every test outside ``tests/openfl``;
  with ``--stand-in``: ``tests/test_devices.py``, which runs every item through the stand-in);
* ``run:NAME``: every item of :func:`fedcontrast.device_check.items` (each registered algorithm,
  DP-SGD, representation DP, FLESD's similarity upload, FedPCL pre-training, resume equal to the
  uninterrupted run, ``compare``, the linear probe, one OpenFL task-runner round) for ``--rounds``
  rounds on the device;
* ``repeat:NAME``: each algorithm run twice on the device, bit-identical (deterministic kernels);
* ``cpu-vs-device:NAME``: each algorithm on digits (2 sites, ``--rounds`` rounds of 20 local epochs) on the CPU and on
  the device, same seed: final test accuracy within ``--tolerance`` points (float sums differ in the
  last bits between devices, so the runs are not bit-identical).

``--stand-in`` runs the same items on the CPU inside :func:`fedcontrast.devices.cpu_stand_in`
(torch's default device ``meta``: anything created without a device fails as it would on CUDA);
there the CPU-vs-device comparison must be exact. ``--write`` records the run in benchmarks/RESULTS.md
(section ``gpu_check_stand_in`` or ``gpu_check_cuda``).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the GPU to check (default cuda)")
    parser.add_argument("--stand-in", action="store_true", help="run the items on the CPU through the stand-in")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=2.0, help="points of accuracy, CPU vs device")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the pytest item")
    parser.add_argument("--only", nargs="*", default=None, help="run only items whose name contains one of these")
    parser.add_argument("--write", action="store_true", help="record the run in benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.tolerance < 0:
        parser.error("--rounds must be >= 1 and --tolerance >= 0")

    import torch

    from fedcontrast import device_check
    from fedcontrast.devices import cpu_stand_in, make_cuda_deterministic

    if args.stand_in:
        device, where = "cpu", cpu_stand_in
    else:
        if not torch.cuda.is_available():
            print("gpu_check: error: CUDA is not available on this machine; run it where a GPU is, or use --stand-in "
                  "to run the same items through the CPU stand-in", file=sys.stderr)
            return 2
        make_cuda_deterministic()  # before any CUDA work, as the engines do
        device, where = args.device, contextlib.nullcontext
    results: list[tuple[str, bool, float, str]] = []

    def check(name: str, job: Callable[[], str]) -> None:
        if args.only is not None and not any(part in name for part in args.only):
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
        check("tests", lambda: _pytest(args.stand_in))
    on_device = device_check.items(device, rounds=args.rounds)
    for name, run in on_device.items():
        def job(run=run) -> str:
            with where():
                outcome = run()
            return "" if outcome.accuracy is None else f"accuracy {100 * outcome.accuracy:.2f} %"
        check(f"run:{name}", job)
    from fedcontrast.algorithms import available_algorithms

    for name in available_algorithms():
        def repeat(name=name) -> str:
            with where():
                first, second = (device_check.simulate(device_check.config(name, device, rounds=args.rounds))
                                 for _ in range(2))
            differing = device_check.differences(first.values, second.values)
            if differing:
                raise AssertionError(f"two runs with one seed differ in {', '.join(differing[:4])}")
            return "bit-identical"
        check(f"repeat:{name}", repeat)
    for name in available_algorithms():
        def versus(name=name) -> str:
            from fedcontrast.config import TrainingConfig

            def digits(on: str):  # 20 local epochs: the models learn (60-85 % after 2 rounds), not chance
                return device_check.config(name, on, rounds=args.rounds, dataset="digits", image_size=16,
                                           training=TrainingConfig(local_epochs=20, batch_size=32))
            cpu = device_check.simulate(digits("cpu"))
            with where():
                dev = device_check.simulate(digits(device))
            if cpu.accuracy is None or dev.accuracy is None:
                raise AssertionError("a run reported no final accuracy")
            gap = 100 * abs(cpu.accuracy - dev.accuracy)
            allowed = 0.0 if args.stand_in else args.tolerance
            if gap > allowed:
                raise AssertionError(f"CPU {100 * cpu.accuracy:.2f} % vs {device} {100 * dev.accuracy:.2f} %: "
                                     f"{gap:.2f} points apart (allowed {allowed:g})")
            return f"CPU {100 * cpu.accuracy:.2f} % vs {'stand-in' if args.stand_in else device} {100 * dev.accuracy:.2f} %"
        check(f"cpu-vs-device:{name}", versus)

    failed = [r for r in results if not r[1]]
    total = sum(r[2] for r in results)
    print(f"{len(results) - len(failed)} of {len(results)} items passed in {total:.0f} s"
          + (f"; failed: {', '.join(r[0] for r in failed)}" if failed else ""))
    if args.write:
        _write(args, device, results, total)
    return 1 if failed else 0


def _pytest(stand_in: bool) -> str:
    targets = ["tests/test_devices.py"] if stand_in else ["tests", "--ignore=tests/openfl"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
                          cwd=ROOT, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:])
        raise AssertionError(f"pytest {' '.join(targets)}: {last}")
    return last.strip("= ")


def _write(args, device: str, results, total: float) -> None:
    import torch
    from _results import machine, write_section

    name = "gpu_check_stand_in" if args.stand_in else "gpu_check_cuda"
    what = ("through the CPU stand-in (torch's default device `meta`; generators must be placed)" if args.stand_in
            else f"on {torch.cuda.get_device_name(torch.device(device))}")
    command = "benchmarks/gpu_check.py" + (" --stand-in" if args.stand_in else f" --device {device}")
    lines = [f"## CUDA correctness: `{command}` ({datetime.date.today().isoformat()})", "",
             f"Command: `.venv/bin/python {command} --rounds {args.rounds} --write` — {what}; {machine()}.", "",
             f"{sum(r[1] for r in results)} of {len(results)} items passed in {total:.0f} s.", "",
             "| item | result | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {n} | {'PASS' if ok else 'FAIL'} | {s:.1f} | {note} |" for n, ok, s, note in results]
    if args.stand_in:
        lines += ["", "No run on a real GPU exists yet: no GPU was lent to this project's developers. On a machine "
                      "with CUDA, `.venv/bin/python benchmarks/gpu_check.py --write` runs the same items on the GPU "
                      "and records them in a section of their own."]
    write_section(name, "\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
