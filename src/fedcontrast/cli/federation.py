"""The operator's commands: federation (all on this machine), workspace create/export, plan write, pki."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from .common import (
    _add_plugin_flag,
    _add_run_flags,
    _add_schema_flags,
    _free_port,
    _numbers,
    check_port,
    config_from_args,
    import_flag_plugins,
    parse_classes,
    parse_input_shape,
)


def deployment_config(args: argparse.Namespace) -> tuple[RunConfig, Path | None]:
    """The run configuration of ``workspace create``: the flags, plus the data schema (from
    ``--input-shape``/``--classes``, or read off ``--data-root``), the sites and the public folder
    (fingerprinted; the schema's normalisation is measured on it unless ``--mean``/``--std``). A plugin
    given as a file is recorded by its module name: every party imports it by name."""
    from ..config import DataSchema, PublicDataConfig
    from ..config.run import is_plugin_file

    import_flag_plugins(args)
    config = config_from_args(args)
    changes: dict[str, Any] = {}
    if any(is_plugin_file(p) for p in config.plugins):
        changes["plugins"] = tuple(dict.fromkeys(Path(p).stem if is_plugin_file(p) else p for p in config.plugins))
    if args.sites:
        changes["sites"] = tuple(n.strip() for n in args.sites.split(",") if n.strip())
    schema = None
    if args.input_shape or args.classes:
        if args.dataset not in (None, "imagefolder"):
            raise ConfigError(f"a data schema (--input-shape, --classes) describes the sites' image folders; drop "
                              f"--dataset {args.dataset}")
        if not (args.input_shape and args.classes):
            raise ConfigError("a data schema needs both --input-shape (e.g. 1x32x32) and --classes (e.g. 0,1,2 or 10)")
        schema = DataSchema(parse_input_shape(args.input_shape), parse_classes(args.classes),
                            _numbers(args.mean, "--mean"), _numbers(args.std, "--std"),
                            # DataSchema checks that the window is two numbers
                            _numbers(getattr(args, "dicom_window", None), "--dicom-window"))  # type: ignore[arg-type]
    elif config.dataset == "imagefolder":
        if config.data_root is None:
            raise ConfigError("imagefolder needs the sites' data schema: pass --input-shape C×H×W and --classes "
                              "(the operator needs no data), or --data-root FOLDER to read it off an example folder")
        from ..data.schema import infer_schema

        schema = infer_schema(config.data_root, image_size=config.image_size)
        if args.mean or args.std:
            schema = DataSchema(schema.input_shape, schema.classes, _numbers(args.mean, "--mean"),
                                _numbers(args.std, "--std"))
    public_source = Path(args.public_data).expanduser().resolve() if args.public_data else None
    if public_source is not None:
        if schema is None:
            raise ConfigError("--public-data is for deployments with a data schema (--input-shape and --classes)")
        from ..data.schema import folder_fingerprint, summarise_folder, with_statistics

        summarise_folder(public_source, schema)  # its classes and colours fit the schema
        if schema.mean is None:
            schema = with_statistics(schema, public_source)  # every party normalises alike
        changes["public_data"] = PublicDataConfig(sha256=folder_fingerprint(public_source))
    if schema is not None:
        changes.update(data_schema=schema, dataset="imagefolder")
    if changes:
        config = config.replace(**changes)
    return config, public_source


def cmd_workspace_create(args: argparse.Namespace) -> int:
    from ..config import site_names
    from ..openfl.fx import read_workspace_config
    from ..openfl.plan import DEFAULT_PORT, create_workspace

    check_port(args.port)
    config, public_source = deployment_config(args)
    if args.collaborators is None and not config.sites:
        raise ConfigError("say how many sites: --sites NAME,NAME,... (institutions) or --collaborators N")
    ws = create_workspace(args.directory, config, collaborators=args.collaborators, address=args.address,
                          port=args.port or DEFAULT_PORT, tls=not args.no_tls, round_timeout=args.round_timeout,
                          min_sites=args.min_sites, wait_for_aggregator=args.wait_for_aggregator,
                          public_source=public_source)
    if args.pki_from:
        from ..openfl.operator_flows import reuse_pki

        reuse_pki(ws, args.pki_from)
        print(f"reused the certificate authority and certificates of {args.pki_from}")
    config = read_workspace_config(ws)  # as written (e.g. FedPCL's backbone files added)
    names = site_names(config)
    print(f"workspace {ws}: {config.algorithm}, {len(names)} sites ({', '.join(names)}), {config.rounds} rounds, "
          f"TLS {'off' if args.no_tls else 'on (mutual)'}, aggregator {args.address}")
    if config.plugins:
        print(f"plugins: every party (the aggregator, each site, fx on this machine) imports "
              f"{', '.join(config.plugins)} by name: install it on every host, or put its folder on PYTHONPATH")
    if config.data_schema is not None:
        s = config.data_schema
        print(f"data schema: {s.in_channels}×{s.image_size}×{s.image_size} images, {s.num_classes} classes "
              f"({', '.join(s.classes[:10])}{', …' if s.num_classes > 10 else ''}); normalisation "
              + (f"mean {list(s.mean)} std {list(s.std)}" if s.mean and s.std else "each site's own statistics"))
        if config.public_data is not None:
            print(f"public data: {public_source} → {ws / config.public_data.folder} "
                  f"(fingerprint {config.public_data.sha256})")
        first = "" if args.pki_from else f"fedcontrast ca init {ws}; "
        print(f"next: {first}fedcontrast workspace export {ws}; send {ws.name}.zip to each site")
    else:
        print(f"next: fedcontrast pki {ws}   (local development PKI; see certs/README.md for real sites)")
        print(f"then, in {ws}: fx plan initialize; fx aggregator start; fx collaborator start -n site_0 ...")
    return 0


def cmd_workspace_export(args: argparse.Namespace) -> int:
    from ..openfl.fx import read_workspace_config
    from ..openfl.operator_flows import export_workspace

    archive = export_workspace(args.workspace)
    config = read_workspace_config(args.workspace)
    print(f"wrote {archive} (the plan, the initial model and what the sites need; no key, no data, no code)")
    join = f"fedcontrast site join {archive.name} --name NAME --data FOLDER"
    if config.public_data is not None:
        join += f" --public PUBLIC_FOLDER (fingerprint {config.public_data.sha256[:16]}…)"
    print(f"send it to every institution; each runs: {join}")
    chain = Path(args.workspace) / "cert" / "cert_chain.crt"
    if chain.is_file():  # in the package: each institution pins it at join, once it confirmed the fingerprint
        from .sites import print_ca_fingerprint

        print_ca_fingerprint(chain)
    enrolled = sorted((Path(args.workspace) / "cert" / "client").glob("col_*.crt"))
    if enrolled:  # the PKI of an earlier experiment: those sites keep their keys and certificates
        print(f"sites already enrolled in this federation ({', '.join(p.stem[4:] for p in enrolled)}) add "
              "--cert-from THEIR_EARLIER_WORKSPACE (no new request); the others send the request it makes")
    return 0


def cmd_plan_write(args: argparse.Namespace) -> int:
    from ..openfl.plan import plan_templates, write_plan_templates

    out = Path(args.directory)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a folder: name a folder for the plans")
    if args.collaborators < 1:
        raise ConfigError(f"--collaborators must be at least 1, got {args.collaborators}")
    existing = [out / f"{name}.yaml" for name in plan_templates(args.collaborators) if (out / f"{name}.yaml").exists()]
    if existing and not args.force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise ConfigError(f"{existing[0]}{more} already exists: write the plans into another folder, or pass --force "
                          "to replace them")
    for path in write_plan_templates(out, args.collaborators):
        print(f"wrote {path}")
    return 0


def cmd_pki(args: argparse.Namespace) -> int:
    from ..openfl.fx import collaborator_names
    from ..openfl.pki import ca_subject, dev_pki_commands, make_dev_pki

    ws = Path(args.workspace)
    if not (args.dry_run and args.collaborators) and not (ws / "plan" / "plan.yaml").is_file():
        raise ConfigError(f"{ws} is not a workspace (no plan/plan.yaml): make one with `fedcontrast workspace create`")
    names = args.collaborators or collaborator_names(ws)
    if args.dry_run:
        print(f"(the federation's CA, as fx workspace certify lays it out, named CN="
              f"{args.federation or ws.resolve().name} fedcontrast CA)")
        print("\n".join(" ".join(c) for c in dev_pki_commands(names, fqdn=args.fqdn)))
        return 0
    make_dev_pki(args.workspace, names, fqdn=args.fqdn, federation=args.federation)
    print(f"certificate authority ({ca_subject(ws / 'cert' / 'cert_chain.crt')}), aggregator and {len(names)} "
          "collaborator certificates in "
          f"{Path(args.workspace) / 'cert'}")
    return 0


def cmd_federation(args: argparse.Namespace) -> int:
    import shutil
    import time

    from ..openfl.pki import fx_executable, make_dev_pki

    fx_executable()  # OpenFL is an install extra: one sentence before anything is written, where it is missing
    from ..openfl.fx import collaborator_names, read_workspace_config
    from ..openfl.launch import export_results, federation_threads, format_round, initialize_plan, run_federation
    from ..openfl.plan import create_workspace

    check_port(args.port)
    config = config_from_args(args).replace(clients=args.collaborators)
    run_dir = Path(args.runs_dir) / (args.name or
                                     f"federation-{config.algorithm}-{config.dataset}-k{config.clients}-s{config.seed}")
    ws = run_dir / "workspace"
    if (run_dir / "summary.json").exists() and args.resume:
        print(f"{run_dir} already finished; its results:")
        print((run_dir / "summary.json").read_text())
        return 0
    if run_dir.exists() and not args.resume:
        if not args.overwrite:
            raise ConfigError(f"{run_dir} already holds a federation; continue it with --resume, choose another "
                              "--name, or replace it with --overwrite")
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    if not (ws / "save" / "init.pbuf").exists():
        if ws.exists():
            shutil.rmtree(ws)  # set-up never finished: nothing of value in it yet
        print(f"workspace {ws}: {config.algorithm} on {config.dataset}, {config.clients} collaborators, "
              f"{config.rounds} rounds, mutual TLS on localhost", file=sys.stderr)
        create_workspace(ws, config, port=args.port or _free_port())
        print("making the development PKI with fx (CA, aggregator and collaborator certificates):", file=sys.stderr)
        make_dev_pki(ws, collaborator_names(ws), log=lambda m: print(m, file=sys.stderr), federation=run_dir.name)
        print("fx plan initialize", file=sys.stderr)
        initialize_plan(ws)
    else:
        config = read_workspace_config(ws)
        print(f"resuming the federation in {ws}", file=sys.stderr)
    threads = federation_threads(config.clients, args.threads)
    print(f"starting fx aggregator start and {config.clients} × fx collaborator start ...; {threads.line()}",
          file=sys.stderr)

    def show(record):
        print(format_round(record), file=sys.stderr, flush=True)

    run_federation(ws, timeout=args.timeout, on_round=show, threads=threads)
    summary = export_results(ws, run_dir, {"threads": threads.record()})
    acc, sites = summary["final_accuracy"], summary["final_site_accuracy_mean"]
    final = (f"final model (torch state_dict): {summary['final_model']}" if summary["final_model"]
             else f"final global tensors: {summary['final_downlink']}")
    no_acc = f"n/a ({summary['why_null'].get('final_accuracy', 'no global model')})"
    val, best = summary.get("final_val_accuracy"), summary.get("best_round")
    picked = (f"; best round by validation {best} (test {summary['best_accuracy']:.4f})"
              if best is not None and summary.get("best_accuracy") is not None else "")
    released = sum(1 for v in summary["final_site_accuracy"].values() if v is not None)
    mean = ("1 site: its own held-out data, no mean" if released == 1 else "weighted mean of their own held-out data")
    print(f"final global test accuracy {no_acc if acc is None else f'{acc:.4f}'}, at the sites "
          f"{'n/a' if sites is None else f'{sites:.4f}'} ({mean}), validation "
          f"{'n/a' if val is None else f'{val:.4f}'} (the sites' validation parts){picked}, after "
          f"{summary['rounds_completed']} rounds ({time.perf_counter() - t0:.0f} s); {final}; results in {run_dir}")
    return 0


def _add_federation(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("federation", help="run a real OpenFL federation on this machine (fx, mutual TLS)")
    _add_run_flags(p, skip=("clients",))
    p.add_argument("--collaborators", type=int, default=3)
    p.add_argument("--name", help="run name (default: from the settings)")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--port", type=int, help="aggregator port (default: a free one)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the federation is stopped")
    p.add_argument("--threads", type=int, help="torch threads of each party (default: the cores this process may "
                                               "use, divided among the aggregator and the collaborators)")
    p.add_argument("--resume", action="store_true", help="restart the parties of an interrupted federation")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_federation)


def _add_workspace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workspace", help="OpenFL workspaces")
    wsub = p.add_subparsers(dest="workspace_command", required=True)
    w = wsub.add_parser("create", help="write an OpenFL workspace (plan, collaborators, data) for any plugin")
    _add_run_flags(w, skip=("clients",))
    _add_plugin_flag(w)
    w.add_argument("--collaborators", type=int, help="number of sites (default: those named by --sites)")
    w.add_argument("--sites", help="the institutions' names, comma-separated (lower case), e.g. hosp1,hosp2,hosp3")
    _add_schema_flags(w)
    w.add_argument("--round-timeout", type=float, default=1800.0,
                   help="seconds a round may take before the federation stops naming the silent sites (1800)")
    w.add_argument("--min-sites", type=int, help="go on without silent sites when at least this many answered "
                                                 "(default: every site is needed)")
    w.add_argument("--wait-for-aggregator", type=float, default=600.0, metavar="SECONDS",
                   help="how long a site keeps trying to reach the aggregator, at start or after losing it (e.g. "
                        "while it restarts), before it gives up (600)")
    w.add_argument("--address", default="localhost", help="the aggregator's host name (its certificate's name)")
    w.add_argument("--port", type=int)
    w.add_argument("--no-tls", action="store_true", help="plain gRPC (testing only)")
    w.add_argument("--pki-from", metavar="OLD_WORKSPACE", help="a new experiment of an existing federation: reuse "
                                                               "the CA and certificates of that workspace")
    w.add_argument("directory")
    w.set_defaults(func=cmd_workspace_create)
    w = wsub.add_parser("export", help="fx plan initialize + fx workspace export: the package for every institution")
    w.add_argument("workspace")
    w.set_defaults(func=cmd_workspace_export)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="OpenFL plan templates")
    psub = p.add_subparsers(dest="plan_command", required=True)
    w = psub.add_parser("write", help="write plan/defaults.yaml and one plan per registered algorithm")
    w.add_argument("directory", nargs="?", default="plan")
    w.add_argument("--collaborators", type=int, default=3)
    w.add_argument("--force", action="store_true", help="replace plans already in the folder")
    w.set_defaults(func=cmd_plan_write)


def _add_pki(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pki", help="make a local development PKI in a workspace with fx commands")
    p.add_argument("workspace")
    p.add_argument("--collaborators", nargs="+", help="names (default: plan/cols.yaml)")
    p.add_argument("--fqdn", default="localhost")
    p.add_argument("--federation", metavar="NAME", help="the federation's name, which its CA carries (CN=NAME "
                                                        "fedcontrast CA; default: the workspace folder's name)")
    p.add_argument("--dry-run", action="store_true", help="print the fx commands only")
    p.set_defaults(func=cmd_pki)


# command name → the function adding its sub-parser (build_parser orders them)
COMMANDS = {
    "federation": _add_federation,
    "workspace": _add_workspace,
    "plan": _add_plan,
    "pki": _add_pki,
}


def register(subparsers: argparse._SubParsersAction, names: Iterable[str] | None = None) -> None:
    """Add this group's sub-commands to ``subparsers`` (``names``: only those, in that order)."""
    for name in COMMANDS if names is None else names:
        COMMANDS[name](subparsers)
