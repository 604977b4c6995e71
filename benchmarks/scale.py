"""The simulator at 10, 100 and 1,000 sites: sequential, Ray on one machine, Ray on two lab nodes and
Flower's simulation runtime, side by side in one run (issue 38, "Measure").

    sudo .venv/bin/python benchmarks/scale.py [--sites 10 100 1000] [--algorithms fedavg moon]
        [--runs sequential ray cluster flower] [--rounds 3] [--large-rounds 2]

Root: the two-node Ray cluster runs on two hosts of the network-namespace lab
(:class:`fedcontrast.lab.netns.NetnsLab`). For each number of sites and algorithm, each run is a
process of its own (``--part``, which prints its timings as one JSON line), one after another:

* ``sequential``: the sequential engine, 1 thread per site;
* ``ray``: a local Ray on 2 CPUs (2 site slots, 1 thread each; site groups automatic), started in
  the run's process;
* ``cluster``: a Ray head and a Ray worker node, ``--num-cpus=1`` each, on two lab hosts with token
  authentication, the driver on the head's host (``executor.address``); started for the run and
  torn down after it;
* ``flower``: the simulator's round loop in a Flower ServerApp, the sites on Flower's simulation
  runtime (``.venv-flower``: flwr 1.42 and its Ray; one SuperNode per site, 1 CPU each, 2 at once).

Digits (Dirichlet 0.5, ``--min-samples 2``) below ``--synthetic-from`` sites (1,294 training images
are too few beyond), FedProx's Synthetic(α, β) (``fedprox_synthetic``, a site generator, partition
natural) from there. 1 local epoch, batch 32. Measured: s/round (median of rounds 2..), the driver's
share of it (the round less the time the driver waited for its sites: ``ray.wait``, Flower's
push/pull of the round's messages, or, sequential, the sites' training), peak PSS of the run's
driver with every process it started (its Ray or Flower processes; for the cluster, every process
on the two lab hosts), sampled from this process, and whether the run's metrics and final weights
equal the sequential run's. Writes the ``scale`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
FLOWER_PYTHON = ROOT / ".venv-flower" / "bin" / "python"
RUNS = {"sequential": "sequential, 1 thread", "ray": "Ray, one machine (2 CPUs)",
        "cluster": "Ray, two lab nodes (1 CPU each)", "flower": "Flower simulation (2 × 1 CPU)"}
MARK = "SCALE-PART "  # the line a --part prints its result on
PORT = 6391


# --- one run, in a process of its own ------------------------------------------------------------------
def make_config(spec: dict):
    from fedcontrast.config import RunConfig, TrainingConfig

    run = spec["run"]
    executor = {"kind": "sequential" if run == "sequential" else "ray" if run in ("ray", "cluster") else "flower",
                "site_cpus": 1, **({"cpus": 2} if run == "ray" else {}),
                **({"address": spec["address"]} if run == "cluster" else {})}
    data = ({"partition": "natural"} if spec["dataset"] == "fedprox_synthetic"
            else {"min_samples": spec["min_samples"]})
    return RunConfig(algorithm=spec["algorithm"], dataset=spec["dataset"], clients=spec["sites"],
                     rounds=spec["rounds"], device="cpu", executor=executor,
                     training=TrainingConfig(local_epochs=spec["local_epochs"], batch_size=32), **data)


def part_main(spec: dict) -> int:
    """One run as ``spec`` says; prints its timings as one JSON line (after :data:`MARK`)."""
    config, run_dir = make_config(spec), Path(spec["run_dir"])
    t0 = time.perf_counter()
    if spec["run"] == "flower":
        out = flower_timed(config, run_dir)
    else:
        from ray_executor import timed_run

        from fedcontrast.sim.ray_executor import RayExecutor

        executor = RayExecutor(config) if spec["run"] != "sequential" else None
        out = {"startup": time.perf_counter() - t0}
        try:
            out.update(timed_run(config, run_dir, executor))
        finally:
            if executor is not None:
                out["nodes"] = len(executor.nodes)
                executor.close()
        out.pop("per_site", None)
        out.pop("workers_cpu", None)  # counts every Ray worker on the machine, others' too: not this run's
    out["whole"] = time.perf_counter() - t0
    print(MARK + json.dumps(out), flush=True)
    return 0


def flower_timed(config, run_dir: Path) -> dict:
    """A run on Flower's simulation runtime: s/round, and the driver's part of it (the round less the
    time in the executor's exchange of messages: pushing the round's messages, waiting for and
    pulling the replies), medians of rounds 2..; CPU seconds of this process per round (the ServerApp
    and Flower's runtime; its Ray actors are other processes)."""
    from ray_executor import median_after_first

    from fedcontrast.sim import flower_executor
    from fedcontrast.sim.flower_executor import run_on_flower

    times: list[float] = []
    waited: list[float] = []
    cpu: list[float] = []
    waiting = [0.0]
    last = [time.perf_counter(), time.process_time()]

    def progress(done: int, total: int, row) -> None:
        now, used = time.perf_counter(), time.process_time()
        if row is not None:
            times.append(now - last[0])
            waited.append(waiting[0])
            cpu.append(used - last[1])
        waiting[0], last[0], last[1] = 0.0, now, used

    stock = flower_executor.FlowerExecutor._exchange

    def exchange(self, messages):
        t0 = time.perf_counter()
        try:
            return stock(self, messages)
        finally:
            waiting[0] += time.perf_counter() - t0

    flower_executor.FlowerExecutor._exchange = exchange
    try:
        run_on_flower(config, run_dir, progress=progress)
    finally:
        flower_executor.FlowerExecutor._exchange = stock
    return {"round": median_after_first(times), "driver": median_after_first([t - w for t, w in zip(times, waited)]),
            "driver_cpu": median_after_first(cpu)}


# --- the runs' processes, watched from here ------------------------------------------------------------
class Watch:
    """Samples, every ``interval`` seconds, the PSS of process ``pid`` alone (the driver) and with every
    process descended from it and every process in the network namespaces ``namespaces`` (its Ray or
    Flower processes); keeps the peaks, and every process seen (pid → start time) so that what the
    run left behind can be ended."""

    def __init__(self, pid: int, namespaces: list[str], interval: float, limit_mib: float) -> None:
        self.pid, self.interval, self.limit = pid, interval, limit_mib
        self.inodes = {os.stat(f"/run/netns/{ns}").st_ino for ns in namespaces}
        self.peak, self.peak_driver, self.over = 0.0, 0.0, False
        self.seen: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _pids(self) -> set[int]:
        import psutil

        pids = {self.pid}
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            for child in root.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(child.pid, child.create_time())
                    pids.add(child.pid)
        if self.inodes:
            for name in os.listdir("/proc"):
                if name.isdigit():
                    with contextlib.suppress(OSError):
                        if os.stat(f"/proc/{name}/ns/net").st_ino in self.inodes:
                            pids.add(int(name))
        return pids

    def _watch(self) -> None:
        from ray_executor import pss_mib

        while not self.stop.wait(self.interval):
            driver = pss_mib([self.pid])  # one sample: the driver, then the others, added
            self.peak_driver = max(self.peak_driver, driver)
            self.peak = max(self.peak, driver + pss_mib(sorted(self._pids() - {self.pid})))
            if self.peak > self.limit and not self.over:
                self.over = True
                with contextlib.suppress(OSError):
                    os.killpg(self.pid, signal.SIGKILL)

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def leftovers(self, grace: float = 10.0) -> list[int]:
        """Ends (SIGKILL) the processes this run started that are still there after ``grace`` seconds
        (the same pid and start time: never another's); their pids."""
        import psutil

        def alive() -> list[psutil.Process]:
            out = []
            for pid, started in self.seen.items():
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                        out.append(proc)
            return out

        deadline = time.monotonic() + grace
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive()
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return [p.pid for p in left]


def run_part(spec: dict, args, log: Path, *, command_prefix: list[str] | None = None, python: str | None = None,
             env: dict | None = None, namespaces: list[str] | None = None) -> dict:
    """Starts ``spec``'s run as a ``--part`` process (in a lab host's namespace: ``command_prefix``),
    watches its memory, waits for it (at most ``--part-timeout`` s); its result, or ``error``."""
    argv = [*(command_prefix or []), python or sys.executable, str(Path(__file__).resolve()), "--part",
            json.dumps(spec)]
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    watch = Watch(proc.pid, namespaces or [], args.memory_interval, args.max_pss_gib * 1024)
    error = None
    try:
        with watch:
            try:
                proc.wait(timeout=args.part_timeout)
            except subprocess.TimeoutExpired:
                error = f"stopped after --part-timeout {args.part_timeout:.0f} s"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        left = watch.leftovers(grace=10.0 if error is None and proc.returncode == 0 else 2.0)
        if left:
            print(f"  (ended {len(left)} process(es) the run left behind: {left})", flush=True)
    text = log.read_text(errors="replace")
    if watch.over:
        error = f"stopped: its processes' PSS passed --max-pss-gib {args.max_pss_gib:g}"
    result = next((json.loads(line[len(MARK):]) for line in text.splitlines() if line.startswith(MARK)), None)
    if result is None:
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])[-400:]
        error = error or f"failed (exit status {proc.returncode}): {tail}"
        result = {}
        if spec["run"] == "flower":  # how far it got: its bar of a round's sites (Flower's replies)
            bars = re.findall(r"(\d+)/(\d+) [\d.]+ s", text)
            error += (f" (the last round's bar: {bars[-1][0]} of {bars[-1][1]} sites answered)" if bars else
                      " (before any site's message went out)")
    result.update({"pss": watch.peak, "pss_driver": watch.peak_driver})
    if error:
        result["error"] = error
    return result


@contextlib.contextmanager
def ray_cluster(work: Path):
    """A Ray head and a Ray worker node (1 CPU each, token authentication) on two hosts of a
    network-namespace lab; yields (lab, head address, environment for the driver). Everything it
    started (namespaces, every process in them, the token) is gone afterwards, also on failure."""
    from fedcontrast.lab.deployment import executable
    from fedcontrast.lab.netns import NetnsLab

    short = Path(tempfile.mkdtemp(prefix="fcscale"))  # Ray's sockets need a short path
    token = short / "token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        with NetnsLab(["head", "worker"]) as lab:
            head = f"{lab.address('head')}:{PORT}"
            for host, extra in (("head", ["--head", f"--port={PORT}", "--include-dashboard=false"]),
                                ("worker", [f"--address={head}"])):
                done = lab.run(host, [executable("ray"), "start", f"--node-ip-address={lab.address(host)}",
                                      "--num-cpus=1", "--disable-usage-stats", f"--temp-dir={short / host}", *extra],
                               cwd=work, env=env, timeout=180)
                if done.returncode != 0:
                    raise RuntimeError(f"ray start on {host} failed: {(done.stderr or done.stdout)[-300:]}")
            yield lab, head, env
    finally:
        shutil.rmtree(short, ignore_errors=True)


def one_run(run: str, spec: dict, args, log: Path) -> dict:
    """``run`` of ``spec`` (its sites, algorithm, data set): its row."""
    if run == "flower":
        if spec["sites"] > args.flower_max_sites:
            return {"error": f"left out: above --flower-max-sites {args.flower_max_sites}"}
        if not FLOWER_PYTHON.exists():
            return {"error": f"left out: no {FLOWER_PYTHON.relative_to(ROOT)}"}
        return run_part(spec, args, log, python=str(FLOWER_PYTHON))
    if run != "cluster":
        return run_part(spec, args, log)
    from fedcontrast.lab.netns import netns_unavailable

    why = netns_unavailable()
    if why:
        return {"error": f"left out: {why}"}
    t0 = time.perf_counter()
    try:
        with ray_cluster(Path(spec["run_dir"]).parent) as (lab, head, env):
            started = time.perf_counter() - t0
            out = run_part({**spec, "address": head}, args, log, command_prefix=lab.command("head", []),
                           env=env, namespaces=[lab.namespace(h) for h in lab.hosts])
            out["cluster_startup"] = started
            return out
    except RuntimeError as exc:
        return {"error": f"failed: {exc}"}


# --- the whole benchmark ------------------------------------------------------------------------------
def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "moon"])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of a run on digits (s/round: median of 2..)")
    parser.add_argument("--large-rounds", type=int, default=2, help="rounds of a run on fedprox_synthetic")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--min-samples", type=int, default=2, help="digits: training samples a site needs at least")
    parser.add_argument("--synthetic-from", type=int, default=1000,
                        help="from this many sites on, fedprox_synthetic instead of digits")
    parser.add_argument("--flower-max-sites", type=int, default=1000,
                        help="Flower's simulation above this many sites is left out (stated in the table)")
    parser.add_argument("--part-timeout", type=float, default=900, help="seconds one run may take before it is stopped")
    parser.add_argument("--max-pss-gib", type=float, default=14, help="a run whose processes pass this PSS is stopped")
    parser.add_argument("--memory-interval", type=float, default=0.5, help="seconds between memory samples")
    parser.add_argument("--json", default=str(Path(tempfile.gettempdir()) / "fedcontrast-scale.json"),
                        help="the rows, written after every run")
    parser.add_argument("--merge", help="rows of an earlier --json: kept where this invocation does not rerun them")
    parser.add_argument("--logs", help="folder for each run's output (default: a temporary one, kept on failure)")
    parser.add_argument("--no-section", action="store_true", help="print only; leave RESULTS.md as it is")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: one run, as JSON
    return parser.parse_args(argv)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.part:
        return part_main(json.loads(args.part))
    try:
        return measure(args, argv)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'}): every run, Ray process and lab namespace it started is stopped; "
              f"the rows so far are in {args.json}", file=sys.stderr)
        return 130


def measure(args, argv: list[str] | None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a kill ends the runs and the lab as Ctrl-C does
    signal.signal(signal.SIGHUP, _interrupt)

    from _results import machine, write_section

    from fedcontrast import device_check

    args.command = " ".join(["python", "benchmarks/scale.py", *(sys.argv[1:] if argv is None else argv)])
    args.load = [os.getloadavg()[0]]
    args.started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: list[dict] = json.loads(Path(args.merge).read_text()) if args.merge else []
    work = Path(tempfile.mkdtemp(prefix="fcscale-runs"))
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="fcscale-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    failed = False
    print(f"runs in {work}, each run's output in {logs}; load average {args.load[0]:.2f}", flush=True)
    try:
        for sites in args.sites:
            dataset = "fedprox_synthetic" if sites >= args.synthetic_from else "digits"
            rounds = args.large_rounds if dataset == "fedprox_synthetic" else args.rounds
            for algorithm in args.algorithms:
                dirs = {}
                for run in args.runs:
                    dirs[run] = work / f"{algorithm}-{sites}-{run}"
                    spec = {"run": run, "algorithm": algorithm, "sites": sites, "dataset": dataset, "rounds": rounds,
                            "local_epochs": args.local_epochs, "min_samples": args.min_samples,
                            "run_dir": str(dirs[run])}
                    load = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    out = one_run(run, spec, args, logs / f"{algorithm}-{sites}-{run}.log")
                    row = {"algorithm": algorithm, "dataset": dataset, "sites": sites, "run": run, "rounds": rounds,
                           "load": load, "seconds": time.perf_counter() - t0, **out}
                    if "error" not in row and run != "sequential" and "sequential" in args.runs \
                            and (dirs["sequential"] / "checkpoint.pt").exists():
                        row["equal"] = device_check.differences(device_check._metrics(dirs["sequential"]),
                                                                device_check._metrics(dirs[run])) == []
                    failed |= ("error" in row and not row["error"].startswith("left out")) or row.get("equal") is False
                    rows = [r for r in rows if (r["algorithm"], r["sites"], r["run"]) != (algorithm, sites, run)]
                    rows.append(row)
                    Path(args.json).write_text(json.dumps(rows, indent=1))
                    print(progress_line(row, time.perf_counter() - t_start), flush=True)
                for path in dirs.values():
                    shutil.rmtree(path, ignore_errors=True)  # a 1,000-site run's checkpoints are large
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.logs and not failed:
            shutil.rmtree(logs, ignore_errors=True)
    args.load.append(os.getloadavg()[0])
    args.minutes = (time.perf_counter() - t_start) / 60
    body = report(args, rows, machine())
    print(body)
    if not args.no_section:
        write_section("scale", body)
    return 1 if failed else 0


def progress_line(r: dict, elapsed: float) -> str:
    head = f"[{elapsed / 60:5.1f} min] {r['algorithm']} {r['sites']} sites ({r['dataset']}), {RUNS[r['run']]}:"
    if "error" in r:
        return f"{head} {r['error']} ({r['seconds']:.0f} s)"
    equal = {None: "—", True: "yes", False: "NO"}[r.get("equal")]
    nodes = f", sites on {r['nodes']} Ray node(s)" if r.get("nodes") else ""
    return (f"{head} {r['round']:.3f} s/round, driver {r['driver']:.3f} s ({share(r)}), peak PSS {r['pss']:,.0f} MiB "
            f"(driver {r['pss_driver']:,.0f}), metrics equal to sequential: {equal}{nodes} "
            f"(run {r['seconds']:.0f} s, load {r['load']:.1f})")


def share(r: dict) -> str:
    return f"{100 * r['driver'] / r['round']:.0f} %" if r["round"] > 0 else "—"


def report(args, rows: list[dict], machine: str) -> str:
    def find(r: dict, run: str) -> dict | None:
        return next((x for x in rows if (x["algorithm"], x["sites"], x["run"]) == (r["algorithm"], r["sites"], run)
                     and "error" not in x), None)

    order = {run: i for i, run in enumerate(RUNS)}
    rows = sorted(rows, key=lambda r: (r["sites"], r["algorithm"], order[r["run"]]))
    loads = [r["load"] for r in rows if "load" in r]
    lines = ["## The simulator at scale: sequential, Ray, a Ray cluster and Flower's simulation: "
             "`benchmarks/scale.py`", "",
             f"Command: `sudo .venv/bin/{args.command}` on {machine}, {args.started}; total {args.minutes:.1f} min. "
             f"The machine's load average (1 min) was {args.load[0]:.2f} at the start and {args.load[-1]:.2f} at the "
             f"end ({min(loads, default=0):.2f}–{max(loads, default=0):.2f} at the runs' starts; 2 cores).", "",
             f"{args.local_epochs} local epoch(s), batch 32, one thread per site. Digits (Dirichlet 0.5, "
             f"`--min-samples {args.min_samples}`, {args.rounds} rounds) below {args.synthetic_from} sites; from "
             f"there FedProx's Synthetic(α, β) (`fedprox_synthetic`, partition natural, its default settings; "
             f"{args.large_rounds} rounds): digits' 1,294 training images cannot make 1,000 sites. Both data sets "
             "train the same model (`simple_cnn`), so MOON runs on both. Each run is a process of its own, one after "
             "another: sequential engine; a local Ray on 2 CPUs (2 site slots, site groups automatic); a Ray head "
             "and a Ray worker node on two hosts of the network-namespace lab, `--num-cpus=1` each, token "
             "authentication, the driver on the head's host (started for the run, its start-up not counted); the "
             "simulator's round loop in a Flower ServerApp with the sites on Flower's simulation runtime (flwr "
             "1.42, `.venv-flower`; a SuperNode per site, 1 CPU each, 2 at once).", "",
             "s/round: the median of rounds 2.. (round 1 builds each worker's data). ÷ sequential: the sequential "
             "round ÷ this run's (above 1: faster); ÷ Flower: Flower's round ÷ this run's (the peer comparison). "
             "Driver share: the round less the time the driver waited for its sites (`ray.wait`; Flower: pushing "
             "the round's messages and pulling the replies; sequential: the sites' training), i.e. the upload "
             "screen, aggregation, evaluation, checkpoint and records (and, Flower, building and reading the "
             "messages). Peak memory: the highest PSS of the driver with every process it started (its Ray or "
             f"Flower processes; for the cluster every process on the two lab hosts), sampled every "
             f"{args.memory_interval:g} s from outside; the driver alone in brackets. Metrics equal: the run's "
             "metrics.csv and final weights equal the sequential run's, bit for bit.", "",
             "| algorithm | data set | sites | run | s/round | ÷ sequential | ÷ Flower | driver share of the round "
             "| peak memory (PSS) | metrics equal to sequential |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['algorithm']} | {r['dataset']} | {r['sites']} | {RUNS[r['run']]} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | — | — | — | — | — |")
            continue
        seq, flower = find(r, "sequential"), find(r, "flower")
        by_seq = f"{seq['round'] / r['round']:.2f}×" if seq and r["run"] != "sequential" else "—"
        by_flower = f"{flower['round'] / r['round']:.2f}×" if flower and r["run"] != "flower" else "—"
        equal = {None: "—", True: "yes", False: "NO"}[r.get("equal")]
        nodes = f" ({r['nodes']} nodes ran sites)" if r["run"] == "cluster" and r.get("nodes") else ""
        lines.append(f"{head} {r['round']:.3f} s | {by_seq} | {by_flower} | {r['driver']:.3f} s ({share(r)}) | "
                     f"{r['pss']:,.0f} MiB ({r['pss_driver']:,.0f}) | {equal}{nodes} |")
    if args.merge:
        lines += ["", "Rows of runs this command did not make come from an earlier invocation of this script with "
                      "the same settings (`--merge`)."]
    lines += ["", *peer_lines(rows, find)]
    return "\n".join(lines)


def peer_lines(rows: list[dict], find) -> list[str]:
    """The Flower peer comparison at 100 sites against the goal (≥ 3×)."""
    out = []
    for r in rows:
        if r["sites"] != 100 or r["run"] != "flower" or "error" in r:
            continue
        ratios = {run: r["round"] / mine["round"] for run in ("sequential", "ray", "cluster")
                  if (mine := find(r, run))}
        if not ratios:
            continue
        best = max(ratios, key=ratios.get)
        listed = ", ".join(f"{RUNS[run]} {ratio:.2f}×" for run, ratio in ratios.items())
        out.append(f"- {r['algorithm']}: Flower's round ({r['round']:.3f} s) ÷ ours: {listed}; best "
                   f"{ratios[best]:.2f}× ({RUNS[best]}): the goal (≥ 3×) is "
                   f"{'met' if ratios[best] >= 3 else 'not met'}.")
    if not out and any(r["sites"] == 100 for r in rows):
        out = ["- not measured: Flower's simulation at 100 sites is not among the rows above (see its row)."]
    return ["**The Flower peer comparison at 100 sites** (issue 38: ≥ 3× per round):", "", *out] if out else []


if __name__ == "__main__":
    sys.exit(main())
