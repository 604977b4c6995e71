"""Start-up across hosts: seconds from `fx aggregator start` to the first aggregated round, and where they go.

    sudo .venv/bin/python benchmarks/startup.py [--sites 3] [--rounds 2] [--algorithm moon] [--repeat 3]
                                                [--section startup] [--note TEXT]

The cross-silo flow of docs/cross-silo.md in the network-namespace lab (:mod:`fedcontrast.lab.deployment`): an operator
and ``--sites`` hospitals, each on its own host with its own directory, set up with the documented
commands; then `fx aggregator start` on the operator's host and `fedcontrast site start` (its checks,
then `fx collaborator start` in the same process) on each hospital's, all at once. Digits, MOON by
default, ``--rounds`` rounds, the plan's default local epochs.

Figures:

* the timeline, from `fx aggregator start` (every party's log watched as it grows): the aggregator's
  plan parsed, listening, first task served, first round aggregated; each site's checks passed (`fx`
  takes the process over), its plan parsed, its first tasks received, its first results sent;
* the breakdown: each party's start-up again, one party at a time, in a fresh interpreter on its own
  host, on a copy of its workspace taken before the federation ran (median of ``--repeat`` runs):
  the interpreter, the `.pth` guard, the imports of `fx`'s command line, OpenFL's `Plan.parse`, the
  imports of the plan's components, and the construction of the aggregator / collaborator (each of
  fedcontrast's start-up checks timed on its own); for a site also `fedcontrast site start`'s checks
  (every doctor check, timed on its own).

Before each measurement the script waits until the 1-minute load average is below ``--max-load``
(polled every 30 s, for at most ``--max-wait`` seconds; then it measures anyway) and records it.
The recovery time of an aggregator restarted while the sites keep running is measured by
benchmarks/aggregator_restart.py.
"""

from __future__ import annotations

# Only the standard library at module level: the same file runs as the probe (``--probe``), whose
# imports are what it measures.
import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
BIN = Path(sys.executable).parent
HEAVY = ("torch", "torchvision", "openfl", "sklearn", "scipy", "pandas", "matplotlib", "tensorboardX", "PIL",
         "grpc", "cryptography")


# --- the probe: one party's start-up, step by step, in this fresh interpreter ------------------------------------
class Clock:
    """Consecutive phases (label, seconds) and timed calls inside them (label → seconds, calls, packages
    first imported during them)."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self.calls: dict[str, dict] = {}
        self.last = time.perf_counter()

    def phase(self, label: str) -> None:
        now = time.perf_counter()
        self.phases.append((label, now - self.last))
        self.last = now

    def wrap(self, owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            before = {p for p in HEAVY if p in sys.modules}
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = self.calls.setdefault(label, {"seconds": 0.0, "calls": 0, "imported": []})
                entry["seconds"] += time.perf_counter() - started
                entry["calls"] += 1
                entry["imported"] += [p for p in HEAVY if p in sys.modules and p not in before]

        setattr(owner, name, timed)


def _fx_command_line(cwd: str) -> None:
    """What `fx` does before it runs a command (openfl.interface.cli.entry): import every command module."""
    from importlib import import_module

    import openfl.interface.cli as cli
    from openfl.utilities.logging import setup_logger

    root = Path(cli.__file__).parent.resolve()
    sys.path.append(str(root))
    sys.path.insert(0, cwd)
    for module in root.glob("*.py"):
        name = module.name.split(".")[0]
        if not (name.count("__init__") or name.count("cli")):
            import_module(name, module.parent)
    setup_logger("info", None)


def _import_components(config: dict) -> None:
    from importlib import import_module

    from fedcontrast.deploy.templates import plan_templates

    for _, template in plan_templates(config):
        if isinstance(template, str) and "." in template:
            import_module(template.rsplit(".", 1)[0])


def probe(kind: str, name: str | None) -> dict:
    clock = Clock()
    cwd = os.getcwd()
    if kind == "preflight":  # `fedcontrast site start WS --name NAME`, up to the exec of fx
        sys.argv = [str(BIN / "fedcontrast"), "site", "start", cwd, "--name", name]
        import fedcontrast.cli as cli

        clock.phase("imports of the `fedcontrast` command")
        import torch  # noqa: F401 — the checks import it (fedcontrast.openfl.plan → construction); fx imports it again

        clock.phase("imports: torch (the checks need it; `fx` imports it again after the exec)")
        from fedcontrast.deploy import workspace as plan
        from fedcontrast.openfl import doctor
        from fedcontrast.site import trust as package_trust

        clock.phase("imports: the rest of the check modules (doctor, plan → fedcontrast's algorithms, models, data)")
        for fn, label in (("_check_name", "site name"), ("check_certificate", "own certificate"),
                          ("check_aggregator", "aggregator reachable, its certificate"), ("_check_data", "data folder"),
                          ("_check_policy", "site policy (audit)"), ("check_shared", "public folder / shared files"),
                          ("check_code", "code (workspace, components, versions, guard)"),
                          ("check_transport", "transport")):
            clock.wrap(doctor, fn, f"doctor: {label}")
        clock.wrap(package_trust, "check_workspace", "workspace check (no code, installed components, TLS)")
        clock.wrap(plan, "load_plan_file", "plan file read (YAML, consistency)")
        cli.site_start_command(Path(cwd), name)
        clock.phase("`site start` checks (every doctor check)")
    else:
        fx = str(BIN / "fx")
        sys.argv = [fx, "aggregator", "start"] if kind == "aggregator" else [fx, "collaborator", "start", "-n", name]
        from fedcontrast.openfl import guard as package_trust

        clock.phase("fx guard (.pth): `fedcontrast.openfl.guard`")
        import torch  # noqa: F401 — the guard's plan read imports it (fedcontrast.openfl.plan → construction)

        clock.phase("fx guard: torch (`fx` would import it a moment later)")
        import fedcontrast.openfl.plan  # noqa: F401

        clock.phase("fx guard: the rest of `fedcontrast.openfl.plan` (fedcontrast's algorithms, models, data)")
        if kind == "aggregator":
            package_trust.guard_aggregator_start(sys.argv, cwd)
        else:
            package_trust.guard_collaborator_start(sys.argv, cwd)
        clock.phase("fx guard: its checks (plan read" + ("" if kind == "aggregator" else
                                                         "; no code, components, TLS, policy, site files") + ")")
        _fx_command_line(cwd)
        clock.phase("`fx` command line: imports of click, OpenFL and every command module")
        from openfl.federated import Plan

        if kind == "aggregator":
            parsed = Plan.parse(plan_config_path=Path("plan/plan.yaml").absolute(),
                                cols_config_path=Path("plan/cols.yaml").absolute())
        else:
            parsed = Plan.parse(plan_config_path=Path("plan/plan.yaml").absolute(),
                                data_config_path=Path("plan/data.yaml").absolute())
        clock.phase("OpenFL's Plan.parse")
        _import_components(parsed.config)
        clock.phase("imports of the plan's components (fedcontrast's classes, OpenFL's aggregator/collaborator)")
        from openfl.federated.plan.plan import Plan as PlanClass

        from fedcontrast.deploy import workspace as plan
        from fedcontrast.openfl import aggregator as agg_module
        from fedcontrast.openfl import collaborator as col_module
        from fedcontrast.openfl import startup_checks

        clock.wrap(plan, "load_plan_file", "plan file read (fedcontrast: YAML, consistency)")
        clock.wrap(startup_checks, "load_plan_file", "plan file read (fedcontrast: YAML, consistency)")
        if kind == "aggregator":
            from openfl.component.aggregator.aggregator import Aggregator

            from fedcontrast.openfl import aggregation

            clock.wrap(PlanClass, "get_assigner", "OpenFL: assigner and tasks (builds each aggregation function)")
            clock.wrap(aggregation.PluginAggregation, "__init__", "  of which fedcontrast's aggregation functions")
            clock.wrap(agg_module, "check_aggregator_plan", "check: plan consistency, port free, server certificate")
            clock.wrap(startup_checks, "check_server_files", "  of which: server certificate, key, chain")
            clock.wrap(startup_checks, "check_port_free", "  of which: port free")
            clock.wrap(agg_module, "_check_collaborators", "check: cols.yaml = the plan's sites")
            clock.wrap(agg_module.EnrolledCertificates, "__init__", "check: enrolment and revocation records")
            clock.wrap(agg_module.EnrolledCertificates, "revoked", "check: enrolment and revocation records")
            clock.wrap(agg_module.RoundReport, "__init__", "round report (test data, model specs)")
            clock.wrap(agg_module, "check_initial_model", "check: save/init.pbuf is this plan's model")
            clock.wrap(agg_module, "check_tensor_db", "check: checkpoint database")
            clock.wrap(agg_module, "upload_limit", "upload bound (plugin's declared upload)")
            clock.wrap(Aggregator, "__init__", "OpenFL Aggregator.__init__ (tensor DB, initial model)")
            clock.wrap(agg_module.SafeAggregator, "_serve_personal_downlinks", "per-site initial downlinks")
            clock.wrap(agg_module.SafeAggregator, "_explain_refused_connections",
                       "check: every enrolled site's certificate; TLS log")
            clock.wrap(PlanClass, "get_aggregator", "Plan.get_aggregator (all of the above)")
            parsed.get_server()
            clock.phase("aggregator construction (Plan.get_server, not yet listening)")
        else:
            from openfl.component.collaborator.collaborator import Collaborator

            from fedcontrast.openfl import loader, runner

            clock.wrap(loader, "check_running_plan", "check: the loader has the plan's settings")
            clock.wrap(loader, "enforce_site_policy", "check: site policy (audit of the plan)")
            clock.wrap(loader.SiteDataLoader, "_load", "image folder read and decoded")
            clock.wrap(PlanClass, "get_data_loader", "data loader (all of the above)")
            clock.wrap(runner.PluginTaskRunner, "__init__", "task runner (plugin, model)")
            clock.wrap(col_module, "check_own_certificate", "check: own certificate, key, chain")
            clock.wrap(col_module, "check_certificate_name", "check: certificate for this site's name")
            clock.wrap(col_module, "check_settings_in_effect", "check: settings in effect")
            clock.wrap(Collaborator, "__init__", "OpenFL Collaborator.__init__")
            clock.wrap(PlanClass, "get_client", "gRPC/TLS client")
            parsed.get_collaborator(name)
            clock.phase("collaborator construction (Plan.get_collaborator, not yet connected)")
    return {"phases": clock.phases, "calls": clock.calls}


# --- the orchestration ------------------------------------------------------------------------------------------
def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_quiet(max_load: float, max_wait: float, what: str) -> dict:
    """Wait until the 1-minute load average is below ``max_load`` (polled every 30 s, at most ``max_wait`` s)."""
    started = time.monotonic()
    while load1() >= max_load and time.monotonic() - started < max_wait:
        print(f"  waiting for a quiet machine before {what}: load {load1():.2f} ≥ {max_load}", flush=True)
        time.sleep(30)
    load = load1()
    quiet = load < max_load
    if not quiet:
        print(f"  gave up waiting after {max_wait:.0f} s: measuring {what} at load {load:.2f}", flush=True)
    return {"load": load, "quiet": quiet, "waited": time.monotonic() - started}


class LogWatch:
    """When each awaited phrase first appeared in a growing log (rich wraps long lines: read flat)."""

    def __init__(self, path: Path) -> None:
        self.path, self.text, self.seen = path, "", {}

    def poll(self, phrases: list[str], start: float) -> None:
        if self.path.exists():
            self.text = self.path.read_text(errors="replace")
        flat = " ".join(self.text.split())
        for phrase in phrases:
            if phrase not in self.seen and phrase in flat:
                self.seen[phrase] = time.monotonic() - start


def timeline(lab, exp, sites: list[str], rounds: int, limit: float) -> dict:
    from fedcontrast.lab.deployment import OPERATOR

    def log(party: str) -> Path:
        return exp.workspace(lab, party) / "logs" / ("aggregator.log" if party == OPERATOR else f"{party}.log")

    aggregated = f"round 1/{rounds} aggregated"
    phrases = {OPERATOR: ["Starting the Aggregator Service", "Starting Aggregator gRPC Server",
                          "Sending tasks to collaborator", aggregated,
                          *[f"Collaborator {s} is sending task results" for s in sites]],
               **{s: ["passed the checks", "Starting a Collaborator Service", "Round: 0 Received Tasks"]
                  for s in sites}}
    watches = {party: LogWatch(log(party)) for party in phrases}
    start = time.monotonic()
    lab.start(exp)
    while True:
        for party, watch in watches.items():
            watch.poll(phrases[party], start)
        if aggregated in watches[OPERATOR].seen or time.monotonic() - start > limit \
                or exp.processes[OPERATOR].poll() is not None:
            break
        time.sleep(0.05)
    codes = lab.wait(exp, 600)
    records = exp.records(lab)
    if aggregated not in watches[OPERATOR].seen or not records:
        raise SystemExit(f"startup benchmark: no round was aggregated (exit codes {codes})\n"
                         f"{lab.log(exp, OPERATOR)[-3000:]}")
    seen = {party: watch.seen for party, watch in watches.items()}
    return {"seen": seen, "record": records[0]["trained_at"] - exp.started, "codes": codes}


def run_probes(lab, party: str, pristine: Path, workspace: str, kind: str, name: str | None, repeat: int,
               scratch: Path) -> dict:
    """``repeat`` probes of ``kind`` on ``party``'s host, each in a fresh interpreter on a fresh copy of its disk."""
    runs, interpreter = [], []
    for i in range(repeat):
        disk = scratch / f"{party}-{kind}-{i}"
        shutil.copytree(pristine, disk, symlinks=True)
        t = time.perf_counter()
        done = lab.net.run(party, [sys.executable, "-c", "pass"], cwd=disk, env=lab.env)
        interpreter.append(time.perf_counter() - t)
        out = disk / "probe.json"
        argv = [sys.executable, str(HERE), "--probe", kind, "--out", str(out)] + (["--name", name] if name else [])
        done = lab.net.run(party, argv, cwd=disk / workspace, env=lab.env, timeout=600)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"startup benchmark: the {kind} probe on {party} failed ({done.returncode}):\n"
                             f"{(done.stdout + done.stderr)[-3000:]}")
        runs.append(json.loads(out.read_text()))
        shutil.rmtree(disk, ignore_errors=True)
    # `ip netns exec` itself is in the interpreter figure; it is small next to Python's start-up
    phases = [(label, statistics.median(r["phases"][k][1] for r in runs)) for k, (label, _) in
              enumerate(runs[0]["phases"])]
    calls = {label: {"seconds": statistics.median(r["calls"].get(label, {}).get("seconds", 0.0) for r in runs),
                     "calls": runs[0]["calls"][label]["calls"],
                     "imported": sorted({p for r in runs for p in r["calls"].get(label, {}).get("imported", [])})}
             for label in runs[0]["calls"]}
    return {"interpreter": statistics.median(interpreter), "phases": phases, "calls": calls}


def pyc_note() -> str:
    """Whether fedcontrast's own modules are imported from bytecode here (PYTHONDONTWRITEBYTECODE)."""
    import fedcontrast

    src = Path(fedcontrast.__file__).parent
    cached = len(list(src.rglob("__pycache__/*.pyc")))
    sources = len(list(src.rglob("*.py")))
    return (f"fedcontrast's {sources} modules have {cached} cached bytecode files here"
            + (" (PYTHONDONTWRITEBYTECODE is set: every process compiles them again)"
               if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))


def fmt_breakdown(title: str, result: dict) -> list[str]:
    lines = [f"**{title}** (sum of the steps: "
             f"{result['interpreter'] + sum(s for _, s in result['phases']):.2f} s)", "",
             "| step | seconds |", "|---|---|", f"| Python interpreter start-up (`python -c pass`, incl. `ip netns "
             f"exec`) | {result['interpreter']:.2f} |"]
    for label, seconds in result["phases"]:
        lines.append(f"| {label} | {seconds:.2f} |")
    if result["calls"]:
        lines += ["", "| of which (timed calls) | seconds | calls | first imported there |", "|---|---|---|---|"]
        for label, entry in result["calls"].items():
            lines.append(f"| {label} | {entry['seconds']:.3f} | {entry['calls']} | "
                         f"{', '.join(entry['imported']) or '–'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--algorithm", default="moon")
    parser.add_argument("--local-epochs", type=int, default=None, help="the plan's default when left out")
    parser.add_argument("--repeat", type=int, default=3, help="probes per party (median)")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--max-wait", type=float, default=2400.0)
    parser.add_argument("--section", default="startup", help="the RESULTS.md section written (startup)")
    parser.add_argument("--note", default="", help="a few words for the section's title, e.g. 'before the cuts'")
    parser.add_argument("--print-only", action="store_true", help="print the figures, leave RESULTS.md as it is")
    parser.add_argument("--probe", choices=["aggregator", "preflight", "collaborator"], help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        Path(args.out).write_text(json.dumps(probe(args.probe, args.name)))
        return

    from _results import machine, write_section

    from fedcontrast.lab.deployment import OPERATOR, CrossSiloLab
    from fedcontrast.lab.netns import netns_unavailable

    reason = netns_unavailable()
    if reason is not None:
        raise SystemExit(f"startup benchmark: {reason}")
    sites = [f"hosp{i + 1}" for i in range(args.sites)]
    options = ["--rounds", str(args.rounds)]
    if args.local_epochs is not None:
        options += ["--local-epochs", str(args.local_epochs)]
    tmp = Path(tempfile.mkdtemp())
    with CrossSiloLab(tmp / "lab", sites) as lab:
        exp = lab.deploy("fed", algorithm=args.algorithm, port=50581, options=options)
        pristine = tmp / "pristine"
        for party in (OPERATOR, sites[0]):  # each party's disk as it is before anything ran
            shutil.copytree(lab.disk(party), pristine / party, symlinks=True)
        fed_load = wait_quiet(args.max_load, args.max_wait, "the federation")
        print(f"federation: load {fed_load['load']:.2f}", flush=True)
        run = timeline(lab, exp, sites, args.rounds, 900)
        fed_load["after"] = load1()
        probe_load = wait_quiet(args.max_load, args.max_wait, "the breakdown")
        print(f"breakdown: load {probe_load['load']:.2f}", flush=True)
        scratch = tmp / "scratch"
        breakdown = {
            "aggregator": run_probes(lab, OPERATOR, pristine / OPERATOR, exp.name, "aggregator", None, args.repeat,
                                     scratch),
            "preflight": run_probes(lab, sites[0], pristine / sites[0], exp.name, "preflight", sites[0], args.repeat,
                                    scratch),
            "collaborator": run_probes(lab, sites[0], pristine / sites[0], exp.name, "collaborator", sites[0],
                                       args.repeat, scratch),
        }
        probe_load["after"] = load1()
    shutil.rmtree(tmp, ignore_errors=True)

    seen = run["seen"]
    agg = seen[OPERATOR]
    aggregated = agg[f"round 1/{args.rounds} aggregated"]
    rows = [("aggregator: plan parsed (`Starting the Aggregator Service`)", agg.get("Starting the Aggregator Service")),
            ("aggregator: listening (`Starting Aggregator gRPC Server`)", agg.get("Starting Aggregator gRPC Server")),
            ("aggregator: first task served (`Sending tasks to collaborator`)",
             agg.get("Sending tasks to collaborator"))]
    for s in sites:
        rows += [(f"{s}: `site start` checks passed, `fx collaborator start` takes over",
                  seen[s].get("passed the checks")),
                 (f"{s}: plan parsed (`Starting a Collaborator Service`)",
                  seen[s].get("Starting a Collaborator Service")),
                 (f"{s}: first tasks received (`Round: 0 Received Tasks`)", seen[s].get("Round: 0 Received Tasks")),
                 (f"{s}: first results sent (aggregator's log)", agg.get(f"Collaborator {s} is sending task results"))]
    rows.append(("**first round aggregated**", aggregated))

    def show(v: float | None) -> str:
        return "–" if v is None else f"{v:.1f}"

    print(f"`fx aggregator start` → first round aggregated: {aggregated:.1f} s (round record: {run['record']:.1f} s); "
          f"load {fed_load['load']:.2f} before, {fed_load['after']:.2f} after")
    for label, value in rows:
        print(f"  {show(value):>6} s  {label}")
    for key, title in (("aggregator", "aggregator"), ("preflight", "site pre-flight"),
                       ("collaborator", "collaborator")):
        b = breakdown[key]
        print(f"{title}: interpreter {b['interpreter']:.2f} s; "
              + "; ".join(f"{phase} {s:.2f} s" for phase, s in b["phases"]))
        for label, entry in b["calls"].items():
            imports = " imports " + ", ".join(entry["imported"]) if entry["imported"] else ""
            print(f"    {entry['seconds']:.3f} s  {label} ({entry['calls']}×){imports}")

    title = f"## Start-up across hosts ({args.algorithm}, {args.sites} sites{', ' + args.note if args.note else ''})"
    local = f" --local-epochs {args.local_epochs}" if args.local_epochs is not None else ""
    lines = [title, "",
             f"Command: `.venv/bin/python benchmarks/startup.py --sites {args.sites} --rounds {args.rounds} "
             f"--algorithm {args.algorithm}{local} --repeat {args.repeat} --section {args.section}"
             + (f" --note '{args.note}'" if args.note else "") + f"` (as root) on {machine()}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} cores.", "",
             f"Load average (1 min) when the federation started: {fed_load['load']:.2f} (after it: "
             f"{fed_load['after']:.2f}){'' if fed_load['quiet'] else ' — not quiet, measured anyway'}; when the "
             f"breakdown started: {probe_load['load']:.2f} (after it: {probe_load['after']:.2f})"
             f"{'' if probe_load['quiet'] else ' — not quiet, measured anyway'}. {pyc_note()}.", "",
             "The documented flow: `fx aggregator start` on the operator's host and `fedcontrast site start` on each "
             "site's, started together; seconds from `fx aggregator start`, as each party's log showed them.", "",
             "| event | seconds after `fx aggregator start` |", "|---|---|"]
    lines += [f"| {label} | {show(value)} |" for label, value in rows]
    lines += ["", f"(The first round's record says {run['record']:.1f} s.) The restart of an aggregator while the "
              "sites keep running: see the aggregator_restart section.", "",
              "Breakdown: each party's start-up again, alone on the machine, in a fresh interpreter on its own host, "
              f"on a copy of its workspace taken before the federation ran; median of {args.repeat}.", ""]
    lines += fmt_breakdown("Aggregator (`fx aggregator start`, up to listening)", breakdown["aggregator"]) + [""]
    lines += fmt_breakdown(f"Site pre-flight (`fedcontrast site start`, {sites[0]}, up to the exec of fx)",
                           breakdown["preflight"]) + [""]
    lines += fmt_breakdown(f"Collaborator (`fx collaborator start -n {sites[0]}`, up to connecting)",
                           breakdown["collaborator"])
    if args.print_only:
        print("\n".join(lines))
    else:
        write_section(args.section, "\n".join(lines))


if __name__ == "__main__":
    main()
