"""Sites in parallel on one GPU, side by side in one run: GPU parallel ÷ GPU sequential, and GPU ÷ CPU.

    python benchmarks/gpu_speed.py [--sites 10 50] [--algorithm moon] [--rounds 4] [--slots N] [--write]

For each number of sites (digits, Dirichlet 0.5, ``--local-epochs`` 2, batch 32), the median time of a
round after the first (the first builds each Ray worker's data and CUDA context) of

* ``cpu, 2 threads``: the sequential engine on the CPU with 2 torch threads (what the 2-core development
  machines give; measured here, on the GPU machine's CPU);
* ``gpu, sequential``: the sequential engine on the GPU (1 torch thread): one site after another;
* ``gpu, ray``: the Ray executor on the same GPU, ``--slots`` sites at once (default: the CPU cores less
  one for the driver, at most 16), each site task 1 CPU and ``1/slots`` of the GPU (``executor.site_gpus``:
  Ray's fractional GPUs; every worker process has its own CUDA context on the one GPU). Without NVIDIA's
  MPS the GPU runs one process's kernels at a time; with it (``nvidia-cuda-mps-control -d``, which
  ``benchmarks/gpu_all.sh`` starts where it exists) the sites' kernels run side by side. The report
  says which.

The goal: GPU parallel ÷ GPU sequential ≥ 5× at 50 sites. The ray run's metrics must equal the
sequential GPU run's (deterministic kernels; the same work per site): the exit status is 1 otherwise.
``--write`` records the ``gpu_speed`` section of benchmarks/RESULTS.md (after each row, so that a run
stopped early keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--algorithm", default="moon")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--slots", type=int, default=None, help="sites at once on the GPU under Ray")
    parser.add_argument("--device", default="cuda", help="the GPU (cpu: a dry run of this script, never written)")
    parser.add_argument("--write", action="store_true", help="record the gpu_speed section of RESULTS.md")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    slots = args.slots if args.slots is not None else max(1, min(16, cores - 1))
    if args.rounds < 2 or args.local_epochs < 1 or slots < 1 or any(n < 2 for n in args.sites):
        parser.error("--rounds must be >= 2 (the first is not timed), --local-epochs and --slots >= 1, --sites >= 2")

    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_speed: error: CUDA is not available on this machine; this measures sites on a GPU (--device cpu: "
              "a dry run of the script on the CPU)", file=sys.stderr)
        return 2
    args.write = args.write and args.device != "cpu"
    from _results import write_section
    from ray_executor import timed_run

    from fedcontrast import device_check
    from fedcontrast.algorithms import available_algorithms
    from fedcontrast.config import RunConfig, TrainingConfig
    from fedcontrast.devices import make_cuda_deterministic
    from fedcontrast.sim.ray_executor import RayExecutor

    if args.algorithm not in available_algorithms():
        parser.error(f"unknown algorithm {args.algorithm!r}; known: {', '.join(available_algorithms())}")
    if args.device != "cpu":
        make_cuda_deterministic()
    share = int(10_000 / slots) / 10_000  # Ray counts GPU fractions to 1e-4: slots × share ≤ 1

    def config(sites: int, device: str, kind: str, threads: int) -> RunConfig:
        executor = {"kind": kind, "site_cpus": threads,
                    **({"cpus": slots, "site_gpus": share} if kind == "ray" else {})}
        return RunConfig(algorithm=args.algorithm, dataset="digits", clients=sites, rounds=args.rounds, min_samples=5,
                         device=device, executor=executor,
                         training=TrainingConfig(local_epochs=args.local_epochs, batch_size=32))

    rows: list[dict] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for sites in args.sites:  # the sequential runs first, while no Ray worker starts beside them
            torch.set_num_threads(2)
            cpu = timed_run(config(sites, "cpu", "sequential", 2), tmp / f"cpu{sites}")
            torch.set_num_threads(1)
            gpu = timed_run(config(sites, args.device, "sequential", 1), tmp / f"gpu{sites}")
            rows.append({"sites": sites, "cpu": cpu["round"], "gpu": gpu["round"], "gpu_train": gpu["train"]})
            print(f"{args.algorithm} {sites:3d} sites: round cpu 2 threads {cpu['round']:.3f} s, gpu sequential "
                  f"{gpu['round']:.3f} s (gpu {cpu['round'] / gpu['round']:.2f}× faster)", flush=True)
        t0 = time.perf_counter()
        executor = RayExecutor(config(args.sites[0], args.device, "ray", 1))
        startup = time.perf_counter() - t0
        try:
            for row in rows:
                sites = row["sites"]
                par = timed_run(config(sites, args.device, "ray", 1), tmp / f"ray{sites}", executor)
                equal = device_check.differences(device_check._metrics(tmp / f"gpu{sites}"),
                                                 device_check._metrics(tmp / f"ray{sites}")) == []
                ok &= equal
                row.update(ray=par["round"], ray_train=par["train"], equal=equal)
                print(f"{args.algorithm} {sites:3d} sites: gpu ray {slots} at once {row['ray']:.3f} s → parallel ÷ "
                      f"sequential {row['gpu'] / row['ray']:.2f}× (training part "
                      f"{row['gpu_train'] / max(row['ray_train'], 1e-9):.2f}×); gpu ray {row['cpu'] / row['ray']:.2f}× "
                      f"faster than the cpu; metrics equal: {equal}", flush=True)
                if args.write:
                    write_section("gpu_speed", report(args, [r for r in rows if "ray" in r], slots, share, startup))
        finally:
            executor.close()
    return 0 if ok else 1


def mps_running() -> bool:
    """Whether an MPS control daemon answers at this process's pipe folder (NVIDIA's default or
    ``CUDA_MPS_PIPE_DIRECTORY``)."""
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control").exists()


def report(args, rows: list[dict], slots: int, share: float, startup: float) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0)
    lines = [f"## Sites in parallel on one GPU: `benchmarks/gpu_speed.py` ({datetime.date.today().isoformat()})", "",
             f"Command: `python benchmarks/gpu_speed.py --sites {' '.join(map(str, args.sites))} --algorithm "
             f"{args.algorithm} --rounds {args.rounds} --write` on one {gpu} ({os.cpu_count()} CPU cores, torch "
             f"{torch.__version__}).", "",
             f"{args.algorithm}, digits, Dirichlet 0.5, {args.local_epochs} local epochs, batch 32. A round's time is "
             f"the median of rounds 2–{args.rounds}. GPU ray: {slots} sites at once, each 1 CPU and {share:g} of the "
             f"GPU (`--executor ray --site-gpus {share:g}`), NVIDIA MPS {'on' if mps_running() else 'off'}; Ray's "
             f"start-up {startup:.1f} s. CPU: the sequential engine with 2 torch threads, on this machine's CPU. "
             "Goal: GPU parallel ÷ GPU sequential ≥ 5× at 50 sites.", "",
             "| sites | CPU, 2 threads | GPU, sequential | GPU, ray | GPU parallel ÷ sequential (training part) "
             "| GPU sequential ÷ CPU | GPU ray ÷ CPU | ray metrics equal to sequential |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['sites']} | {r['cpu']:.3f} s | {r['gpu']:.3f} s | {r['ray']:.3f} s | {r['gpu'] / r['ray']:.2f}× "
              f"({r['gpu_train'] / max(r['ray_train'], 1e-9):.2f}×) | "
              f"{r['cpu'] / r['gpu']:.2f}× faster | {r['cpu'] / r['ray']:.2f}× faster | "
              f"{'yes' if r['equal'] else 'NO'} |"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
