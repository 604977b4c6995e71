"""The Flower engine vs the OpenFL engine vs the simulator on the same MOON job (3 sites, 20 rounds),
on localhost and across hosts (network namespaces).

    sudo .venv/bin/python benchmarks/flower_engine.py [--rounds 20] [--flower-venv .venv-flower]

Run from the OpenFL environment (`.venv`, the extra [test]); the Flower parties run from the Flower
environment (`--flower-venv`, the extra [flower]: the README's test command makes `.venv-flower`).
Both engines use exactly the documented commands (docs/cross-silo.md, docs/flower.md) on the same
image folders (the digits shards of a Dir(0.5) partition, each site's test/ held out) with the same
defaults; the operator holds no data. "localhost": every party a process of this host, talking to
localhost; "across hosts": each party on its own network namespace.

Figures: seconds per round (median of the gaps between consecutive rounds' records, each written
when the round is aggregated, on both engines), start-up (the engine's start command → first round aggregated), the peak
resident memory of each site's process tree (OpenFL: `fedcontrast site start` → fx collaborator;
Flower: `fedcontrast flower supernode` → its node (default), or its worker, flower-supernode,
flower-superexec and the ClientApp processes), the sites' held-out accuracy of the final model; the
simulator's seconds per round on the same configuration and shards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _results import machine, write_section

from fedcontrast.config import RunConfig
from fedcontrast.lab.deployment import OPERATOR, CrossSiloLab
from fedcontrast.lab.netns import netns_unavailable
from fedcontrast.sim import run_simulation
from fedcontrast.threads import choose_threads

SITES = ["hosp1", "hosp2", "hosp3"]
ISOLATION = {"node": "Flower, the site's process as its node", "process": "Flower",
             "subprocess": "Flower, a ClientApp process per message (before)"}
ROUND_LINE = re.compile(r"round (\d+)/(\d+) done in ([0-9.]+) s")


class LocalNet:
    """The lab's interface with every party a process of this host (no namespaces), at localhost."""

    def __init__(self, parties):
        self.procs = []

    def __enter__(self):
        return self

    def fqdn(self, host):
        return "localhost"

    def command(self, host, argv):
        return list(argv)

    def popen(self, host, argv, *, cwd, env=None, log_path=None):
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, host, argv, *, cwd, env=None, timeout=300):
        return subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def close(self):
        stop_process_trees(self.procs)
        self.procs = []


def stop_process_trees(procs, grace: float = 10.0) -> None:
    """Stops every process ``procs`` started, whatever group or session it moved to (``fedcontrast
    flower supernode`` runs flower-supernode in a session of its own, which starts flower-superexec and
    ClientApp processes): SIGTERM to each process group of the trees (so fedcontrast stops its
    children itself), SIGKILL to whatever is left after ``grace``; then checks that none remains."""
    tree = []
    for proc in procs:
        try:
            root = psutil.Process(proc.pid)
            tree += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups = set()
        for p in tree:
            try:
                groups.add(os.getpgid(p.pid))
            except ProcessLookupError:
                pass
        for group in groups - {os.getpgrp()}:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        for p in tree:  # one left in this process's own group: by itself
            try:
                if os.getpgid(p.pid) == os.getpgrp():
                    p.send_signal(sig)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        _, alive = psutil.wait_procs(tree, timeout=grace)
        if not alive:
            break
        tree = alive
    for proc in procs:
        proc.wait()
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes the benchmark started still run: {[(p.pid, p.name()) for p in left]}"


class PeakMemory:
    """Samples the resident memory of process trees every 0.25 s; the peak of each tree's sum."""

    def __init__(self, roots: dict[str, int]):
        self.roots, self.peak, self.stop = roots, dict.fromkeys(roots, 0), threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while not self.stop.is_set():
            for name, pid in self.roots.items():
                try:
                    root = psutil.Process(pid)
                    total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                except psutil.Error:
                    continue
                self.peak[name] = max(self.peak[name], total)
            self.stop.wait(0.25)

    def finish(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        return {k: v / 2**20 for k, v in self.peak.items()}


def openfl(lab, rounds: int, port: int) -> dict:
    exp = lab.deploy(f"ofl{port}", algorithm="moon", port=port, options=["--rounds", str(rounds)])
    lab.start(exp)
    memory = PeakMemory({s: exp.processes[s].pid for s in SITES})
    codes = lab.wait(exp, 3600)
    peaks = memory.finish()
    if any(code != 0 for code in codes.values()):
        raise SystemExit(f"the OpenFL federation failed: {codes}\n{lab.log(exp, OPERATOR)[-3000:]}")
    records = exp.records(lab)
    trained = [r["trained_at"] for r in records]
    return {"per_round": statistics.median([b - a for a, b in zip(trained, trained[1:])]),
            "startup": trained[0] - exp.started, "memory": peaks, "accuracy": records[-1]["site_accuracy"]}


def flower(lab, rounds: int, port: int, venv: Path, local: bool, isolation: str = "process") -> dict:
    fc = str(venv / "bin" / "fedcontrast")
    env = {**lab.env, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"}
    name = f"fl{port}"
    folder = lab.disk(OPERATOR) / name

    def run(party, *args, timeout=300):
        done = lab.net.run(party, [fc, *args], cwd=lab.disk(party), env=env, timeout=timeout)
        if done.returncode != 0:
            raise SystemExit(f"{party}: fedcontrast {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
        return done.stdout

    run(OPERATOR, "flower", "init", "--algorithm", "moon", "--sites", ",".join(SITES), "--input-shape", "1x32x32",
        "--classes", "10", "--rounds", str(rounds), "--address", lab.net.fqdn(OPERATOR), "--port", str(port), name)
    superlink = lab.net.popen(OPERATOR, [fc, "flower", "superlink", name], cwd=lab.disk(OPERATOR), env=env,
                              log_path=lab.disk(OPERATOR) / f"{name}_superlink.log")
    nodes = {}
    for site in SITES:
        if not (lab.disk(site) / f"{site}.key").exists():
            run(site, "flower", "site-key", "--name", site)
        shutil.copyfile(lab.disk(site) / f"{site}.pub", lab.disk(OPERATOR) / f"{site}.pub")
        shutil.copyfile(folder / "certs" / "ca.crt", lab.disk(site) / f"{name}_ca.crt")
    deadline = time.monotonic() + 60
    for site in SITES:
        while True:
            done = lab.net.run(OPERATOR, [fc, "flower", "register", name, f"{site}.pub", "--site", site],
                               cwd=lab.disk(OPERATOR), env=env)
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
    threads = choose_threads(parties=len(SITES) + 1).threads  # the ServerApp and the sites share this host
    for i, site in enumerate(SITES):
        nodes[site] = lab.net.popen(site, [fc, "flower", "supernode", "--superlink", f"{lab.net.fqdn(OPERATOR)}:{port}",
                                           "--ca", f"{name}_ca.crt", "--key", f"{site}.key", "--name", site,
                                           "--data", "images", "--workdir", name, "--threads", str(threads),
                                           "--port", str(9400 + i if local else 9094), "--isolation", isolation],
                                    cwd=lab.disk(site), env=env, log_path=lab.disk(site) / f"{name}.log")
    time.sleep(3)
    memory = PeakMemory({s: p.pid for s, p in nodes.items()})
    started = time.time()
    proc = subprocess.Popen(lab.net.command(OPERATOR, [fc, "flower", "run", name]), cwd=lab.disk(OPERATOR), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    for line in proc.stdout:
        if ROUND_LINE.search(line):
            first = first or time.time() - started
    code = proc.wait()
    peaks = memory.finish()
    for party in [*nodes.values(), superlink]:  # none of this run's processes into the next row
        try:
            os.killpg(party.pid, 15)
            party.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if code != 0:
        raise SystemExit(f"the Flower federation failed (exit {code}); see {folder}")
    summary = json.loads((folder / "run" / "summary.json").read_text())
    # as OpenFL's: between consecutive rounds' records (each written when the round is aggregated)
    done = [json.loads(line)["time"] for line in (folder / "run" / "rounds.jsonl").read_text().splitlines()]
    return {"per_round": statistics.median([b - a for a, b in zip(done, done[1:])]), "startup": first, "memory": peaks,
            "accuracy": summary["final_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--flower-venv", default=".venv-flower")
    parser.add_argument("--placements", nargs="+", choices=("localhost", "across hosts", "across"),
                        default=["localhost", "across hosts"])
    parser.add_argument("--isolation", nargs="+", choices=ISOLATION, default=list(ISOLATION),
                        help="the Flower rows: each SuperNode's --isolation (process: the default, the site's worker "
                             "takes its tasks; subprocess: a ClientApp process per message, as before issue 37)")
    parser.add_argument("--no-openfl", dest="openfl", action="store_false", help="only the Flower rows")
    parser.add_argument("--keep", action="store_true", help="keep the parties' folders and logs (printed)")
    args = parser.parse_args()
    placements = ["across hosts" if p == "across" else p for p in args.placements]
    cli = [f"--rounds {args.rounds}", *([] if set(placements) == {"localhost", "across hosts"} else
                                        [f"--placements {' '.join(p.split()[0] for p in placements)}"]),
           *([] if args.isolation == list(ISOLATION) else [f"--isolation {' '.join(args.isolation)}"]),
           *([] if args.openfl else ["--no-openfl"])]
    venv = Path(args.flower_venv).resolve()
    if not (venv / "bin" / "fedcontrast").exists():
        raise SystemExit(f"flower_engine benchmark: no Flower environment at {venv} (python3 -m venv .venv-flower && "
                         ".venv-flower/bin/pip install -e '.[flower]')")
    reason = netns_unavailable() if "across hosts" in placements else None
    if reason is not None:
        raise SystemExit(f"flower_engine benchmark: {reason}")
    results = {}
    tmp = Path(tempfile.mkdtemp())
    loads = []
    for placement, port in (("localhost", 9510), ("across hosts", 9520)):
        if placement not in placements:
            continue
        lab = CrossSiloLab(tmp / placement.replace(" ", "_"), SITES)
        if placement == "localhost":
            lab.net = LocalNet(lab.parties)
        with lab:
            if args.openfl:
                loads.append(os.getloadavg()[0])
                results[("OpenFL", placement)] = openfl(lab, args.rounds, port)
                print("OpenFL", placement, results[("OpenFL", placement)], flush=True)
            for i, isolation in enumerate(args.isolation):
                engine = ISOLATION[isolation]
                loads.append(os.getloadavg()[0])
                results[(engine, placement)] = flower(lab, args.rounds, port + 1 + i, venv, placement == "localhost",
                                                      isolation)
                print(engine, placement, results[(engine, placement)], flush=True)
    config = RunConfig(algorithm="moon", dataset="digits", clients=len(SITES), sites=tuple(SITES), rounds=args.rounds)
    stamps: list[float] = []
    run_simulation(config, tmp / "sim", progress=lambda d, t, row: stamps.append(time.time()))
    sim = statistics.median([b - a for a, b in zip(stamps, stamps[1:])][1:])
    if args.keep:
        print(f"the parties' folders and logs: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [f"## The Flower engine vs the OpenFL engine vs the simulator (moon, {len(SITES)} sites, "
             f"{args.rounds} rounds)",
             "", f"Command: `{'sudo ' if 'across hosts' in placements else ''}.venv/bin/python "
             f"benchmarks/flower_engine.py {' '.join(cli)}` on {machine()}, "
             f"{time.strftime('%Y-%m-%d')}; flwr 1.42 in `.venv-flower`, openfl 1.9 in `.venv`; the host's load "
             f"average (1 min) at the start of each row: {' / '.join(f'{x:.1f}' for x in loads)} "
             f"({os.cpu_count()} cores).", "",
             "The same job on the same image folders (digits shards of a Dir(0.5) partition; each site's test/ held "
             "out), with the documented commands of each engine; every round includes each site's evaluation of what "
             "it received. Flower: `fedcontrast flower supernode --isolation node` (the default: the site's one "
             "process is its Flower node, no flower-supernode), `--isolation process` (Flower's SuperNode; the site's "
             "worker takes its tasks, standby messages between rounds) and, as before issue 37, `--isolation "
             "subprocess` (a `flwr-clientapp` process per message that asks the worker). Memory: peak "
             "resident memory of each site's whole process tree (MiB; shared pages counted in each process).", "",
             "| engine | placement | s / round (median gap between rounds) | ÷ simulator | ÷ OpenFL (same placement) | "
             "start → round 1 aggregated | ÷ OpenFL | peak memory per site (MiB) | "
             "sites' held-out accuracy, final model |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (engine, placement), r in results.items():
        mem = " / ".join(f"{r['memory'][s]:.0f}" for s in SITES)
        base = results.get(("OpenFL", placement))
        ratio = f"{r['per_round'] / base['per_round']:.2f}" if base else ""
        start_ratio = f"{r['startup'] / base['startup']:.2f}" if base else ""
        lines.append(f"| {engine} | {placement} | {r['per_round']:.2f} | {r['per_round'] / sim:.2f} | {ratio} | "
                     f"{r['startup']:.1f} s | {start_ratio} | {mem} | {100 * r['accuracy']:.2f} % |")
    lines.append(f"| simulator (sequential, one process) | | {sim:.2f} | 1.00 | | | | | |")
    write_section("flower_engine", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
