"""The ``fedcontrast`` command line: simulate, compare, partition, audit, algorithms.

Errors caused by the user's input print one sentence and exit with code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from .config import RunConfig, load_yaml
from .errors import ConfigError, FedContrastError

# flag name → config key (None default = "not given": the YAML file or the default applies)
RUN_FLAGS = {
    "algorithm": str, "dataset": str, "data_root": str, "image_size": int, "test_fraction": float,
    "public_fraction": float, "split_seed": int, "partition": str, "clients": int, "beta": float,
    "shards_per_client": int, "min_samples": int, "model": str, "projection_dim": int, "rounds": int,
    "sample_fraction": float, "seed": int, "target_accuracy": float, "device": str,
}
TRAINING_FLAGS = {"local_epochs": int, "batch_size": int, "lr": float, "momentum": float,
                  "weight_decay": float, "augmentation": str}


def _add_run_flags(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    p.add_argument("--config", help="YAML file of settings; flags given on the command line override it")
    for key, typ in {**RUN_FLAGS, **TRAINING_FLAGS}.items():
        if key not in skip:
            p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None)
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="[ALG.]KEY=VALUE",
                   help="an algorithm hyper-parameter, e.g. --set mu=1 or --set moon.temperature=0.2")


def _parse_setting(text: str, default_algorithm: str | None) -> tuple[str, str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE or ALGORITHM.KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    if "." in key:
        algorithm, key = key.split(".", 1)
    elif default_algorithm is None:
        raise ConfigError(f"--set {text!r} must name its algorithm here, e.g. --set moon.{key}=...")
    else:
        algorithm = default_algorithm
    return algorithm, key, yaml.safe_load(value)


def config_from_args(args: argparse.Namespace, *, default_algorithm_for_set: bool = True) -> RunConfig:
    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    data = dict(data)
    training = dict(data.get("training") or {})
    for key in RUN_FLAGS:
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    for key in TRAINING_FLAGS:
        if getattr(args, key, None) is not None:
            training[key] = getattr(args, key)
    data["training"] = training
    hyper = {k: dict(v) for k, v in (data.get("hyperparameters") or {}).items()}
    default_alg = data.get("algorithm", RunConfig.algorithm) if default_algorithm_for_set else None
    for text in args.settings:
        algorithm, key, value = _parse_setting(text, default_alg)
        hyper.setdefault(algorithm, {})[key] = value
    data["hyperparameters"] = hyper
    return RunConfig.from_dict(data)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim.simulator import print_progress, run_simulation

    config = config_from_args(args)
    run_dir = Path(args.runs_dir) / (args.name or config.default_name())
    header = (f"fedcontrast simulate: {config.algorithm} on {config.dataset}, {config.clients} sites, "
              f"{config.partition} β={config.beta:g}, {config.rounds} rounds → {run_dir}")
    summary = run_simulation(config, run_dir, resume=args.resume, overwrite=args.overwrite,
                             progress=None if args.quiet else print_progress(header),
                             local_evaluation=True if args.local_eval else None, linear_probe=args.linear_probe)
    print(f"final test accuracy {summary['final_accuracy']:.4f} (best {summary['best_accuracy']:.4f} "
          f"at round {summary['best_round']}), {summary['wall_time_s']:.1f} s; results in {run_dir}")
    final = summary.get("final_metrics", {})
    if "local_accuracy" in final:
        print(f"sites' local models: {final['local_accuracy']:.4f} ± {final['local_accuracy_std']:.4f} on their own "
              f"label distributions, {final['local_balanced_accuracy']:.4f} on the balanced test split")
    if args.linear_probe and "probe_accuracy" in final:
        print(f"linear probe of the global encoder: {final['probe_accuracy']:.4f}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    import torch

    from .construction import initial_model, load_splits, resolve_device
    from .evaluation import linear_probe

    config = config_from_args(args)
    path = Path(args.model_file)
    if not path.is_file():
        raise ConfigError(f"model file {path} does not exist (a federation exports save/final_model.pt)")
    splits = load_splits(config)
    model = initial_model(config, in_channels=splits.in_channels, image_size=splits.image_size,
                          num_classes=splits.num_classes)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    except Exception as exc:  # wrong file, wrong architecture
        raise ConfigError(f"{path} is not a {config.model} state_dict for {config.dataset} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
    device = resolve_device(config.device)
    result = linear_probe(model.to(device).encoder, splits.train, splits.test, device, module=model)
    print(f"linear probe of {path} ({config.model} encoder, frozen; logistic regression on the {len(splits.train)} "
          f"training images of {config.dataset}): test accuracy {result['probe_accuracy']:.4f} "
          f"(train {result['probe_train_accuracy']:.4f})")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .sim.compare import format_table, run_comparison
    from .sim.simulator import print_progress

    base = config_from_args(args, default_algorithm_for_set=False)
    seeds = args.seeds or [base.seed]
    out = Path(args.runs_dir) / (args.name or f"compare-{base.dataset}-k{base.clients}-{base.partition}{base.beta:g}")

    def factory(label: str):
        return None if args.quiet else print_progress(f"== {label}")

    run_comparison(base, args.algorithms, seeds, out, progress_factory=factory)
    print(format_table(out), end="")
    print(f"table: {out / 'compare.md'}, plot: {out / 'compare.png'}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from .data import format_partition_table, load_dataset, partition_counts, partition_indices, write_partition_report

    config = config_from_args(args)
    splits = load_dataset(config.dataset, root=config.data_root, image_size=config.image_size,
                          test_fraction=config.test_fraction, public_fraction=config.public_fraction,
                          split_seed=config.split_seed)
    labels = splits.train.y.numpy()
    parts = partition_indices(labels, config.clients, method=config.partition, beta=config.beta,
                              shards_per_client=config.shards_per_client, min_samples=config.min_samples,
                              seed=config.seed)
    counts = partition_counts(labels, parts, splits.num_classes)
    print(format_partition_table(counts))
    out = Path(args.out or Path(args.runs_dir) / f"partition-{config.dataset}-k{config.clients}-{config.partition}{config.beta:g}-s{config.seed}")
    paths = write_partition_report(counts, out, title=f"{config.dataset}: {config.partition} "
                                   f"β={config.beta:g}, seed {config.seed}")
    print(f"wrote {paths['csv']} and {paths['png']}")
    return 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    import dataclasses

    from .algorithms import available_algorithms, get_algorithm

    for name in available_algorithms():
        cls = get_algorithm(name)
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Hyperparameters))
        print(f"{name:10s} tasks: {', '.join(cls.tasks):24s} settings: {fields or '-'}")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_workspace_create(args: argparse.Namespace) -> int:
    from .openfl.plan import DEFAULT_PORT, create_workspace

    config = config_from_args(args)
    ws = create_workspace(args.directory, config, collaborators=args.collaborators, address=args.address,
                          port=args.port or DEFAULT_PORT, tls=not args.no_tls)
    print(f"workspace {ws}: {config.algorithm} on {config.dataset}, {args.collaborators or config.clients} "
          f"collaborators, TLS {'off' if args.no_tls else 'on (mutual)'}")
    print(f"next: fedcontrast pki {ws}   (local development PKI; see certs/README.md for real sites)")
    print(f"then, in {ws}: fx plan initialize; fx aggregator start; fx collaborator start -n site_0 ...")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    import torch

    from .construction import load_splits
    from .models.backbones import pretrain_backbone

    config = config_from_args(args)
    public = load_splits(config).public
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for k, arch in enumerate(args.backbones):
        encoder = pretrain_backbone(arch, public, seed=config.seed + k, epochs=args.epochs)
        path = out / f"backbone_{k}_{arch}.pt"
        torch.save(encoder.state_dict(), path)
        files.append(str(path))
        print(f"pre-trained {arch} (supervised, Adam, {args.epochs} epochs on the {len(public)}-sample public "
              f"split of {config.dataset}) → {path}")
    print("use them with:  --set fedpcl.backbones=" + repr(list(args.backbones)).replace(" ", "")
          + " --set fedpcl.backbone_files=" + repr(files).replace(" ", ""))
    return 0


def cmd_plan_write(args: argparse.Namespace) -> int:
    from .openfl.plan import write_plan_templates

    for path in write_plan_templates(args.directory, args.collaborators):
        print(f"wrote {path}")
    return 0


def cmd_pki(args: argparse.Namespace) -> int:
    from .openfl.pki import dev_pki_commands, make_dev_pki
    from .openfl.plan import collaborator_names

    names = args.collaborators or collaborator_names(args.workspace)
    if args.dry_run:
        print("\n".join(" ".join(c) for c in dev_pki_commands(names, fqdn=args.fqdn)))
        return 0
    make_dev_pki(args.workspace, names, fqdn=args.fqdn)
    print(f"certificate authority, aggregator and {len(names)} collaborator certificates in {Path(args.workspace) / 'cert'}")
    return 0


def cmd_federation(args: argparse.Namespace) -> int:
    import shutil
    import time

    from .openfl.launch import export_results, initialize_plan, run_federation
    from .openfl.pki import make_dev_pki
    from .openfl.plan import collaborator_names, create_workspace, read_workspace_config

    config = config_from_args(args).replace(clients=args.collaborators)
    run_dir = Path(args.runs_dir) / (args.name or f"federation-{config.algorithm}-{config.dataset}-k{config.clients}-s{config.seed}")
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
        make_dev_pki(ws, collaborator_names(ws), log=lambda m: print(m, file=sys.stderr))
        print("fx plan initialize", file=sys.stderr)
        initialize_plan(ws)
    else:
        config = read_workspace_config(ws)
        print(f"resuming the federation in {ws}", file=sys.stderr)
    print(f"starting fx aggregator start and {config.clients} × fx collaborator start ...", file=sys.stderr)

    def show(record):
        acc = record.get("accuracy")
        print(f"round {record['round']}/{record['rounds']}  global test accuracy "
              f"{'n/a' if acc is None else f'{acc:.4f}'}", file=sys.stderr, flush=True)

    run_federation(ws, timeout=args.timeout, on_round=show)
    summary = export_results(ws, run_dir)
    acc = summary["final_accuracy"]
    final = (f"final model (torch state_dict): {summary['final_model']}" if summary["final_model"]
             else f"final global tensors: {summary['final_downlink']}")
    print(f"final global test accuracy {'n/a (no global model)' if acc is None else f'{acc:.4f}'} after "
          f"{summary['rounds_completed']} rounds ({time.perf_counter() - t0:.0f} s); {final}; results in {run_dir}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    import json

    from .privacy.audit import audit_plan, format_report, load_plan
    from .privacy.policy import SitePolicy, check_policy

    plan, workspace = load_plan(args.target)
    report = audit_plan(plan, source=str(args.target), workspace=workspace)
    violations = check_policy(report, SitePolicy.from_yaml(args.policy)) if args.policy else []
    if args.json:
        print(json.dumps({**report.to_dict(), "policy": args.policy, "violations": violations}, indent=2))
    else:
        print(format_report(report), end="")
        if args.policy:
            print(f"\npolicy {args.policy}: " + ("compliant" if not violations else f"{len(violations)} violation(s)"))
            for v in violations:
                print(f"  VIOLATION: {v}")
    if violations:
        print(f"fedcontrast: policy violated: {violations[0]}" + (f" (and {len(violations) - 1} more)"
                                                                  if len(violations) > 1 else ""), file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedcontrast", description="Contrastive federated learning on OpenFL.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="run a federation in one process")
    _add_run_flags(p)
    p.add_argument("--name", help="run name (default: from the settings)")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--resume", action="store_true", help="continue the run from its last finished round")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run of the same name")
    p.add_argument("--quiet", action="store_true", help="no per-round progress")
    p.add_argument("--local-eval", action="store_true",
                   help="also evaluate every site's local model each round (on its own label distribution)")
    p.add_argument("--linear-probe", action="store_true",
                   help="also report the linear-probe accuracy of the global model's encoder each round")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("probe", help="linear-probe accuracy of a saved model's encoder (e.g. save/final_model.pt)")
    _add_run_flags(p)
    p.add_argument("model_file", metavar="MODEL.pt", help="a torch state_dict of the run's model")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("compare", help="several algorithms on the same partitions and seeds")
    _add_run_flags(p, skip=("algorithm",))
    p.add_argument("--algorithms", nargs="+", default=["fedavg", "fedprox", "moon"],
                   help="algorithms, or variants such as moon:mu=1,temperature=0.2; the first is the reference")
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--name")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("partition", help="show and save how a data set is split among sites")
    _add_run_flags(p)
    p.add_argument("--out", help="folder for partition.csv and partition.png")
    p.add_argument("--runs-dir", default="runs")
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser("federation", help="run a real OpenFL federation on this machine (fx, mutual TLS)")
    _add_run_flags(p, skip=("clients",))
    p.add_argument("--collaborators", type=int, default=3)
    p.add_argument("--name", help="run name (default: from the settings)")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--port", type=int, help="aggregator port (default: a free one)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the federation is stopped")
    p.add_argument("--resume", action="store_true", help="restart the parties of an interrupted federation")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_federation)

    p = sub.add_parser("workspace", help="OpenFL workspaces")
    wsub = p.add_subparsers(dest="workspace_command", required=True)
    w = wsub.add_parser("create", help="write an OpenFL workspace (plan, collaborators, data) for any plugin")
    _add_run_flags(w, skip=("clients",))
    w.add_argument("--collaborators", type=int, required=True)
    w.add_argument("--address", default="localhost", help="the aggregator's host name (its certificate's name)")
    w.add_argument("--port", type=int)
    w.add_argument("--no-tls", action="store_true", help="plain gRPC (testing only)")
    w.add_argument("directory")
    w.set_defaults(func=cmd_workspace_create)

    p = sub.add_parser("pretrain", help="pre-train FedPCL backbones on the public split and save their weights")
    _add_run_flags(p)
    p.add_argument("--backbones", nargs="+", default=["simple_cnn"], help="architectures (simple_cnn, resnet18, resnet50)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--out", default="runs/backbones")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("plan", help="OpenFL plan templates")
    psub = p.add_subparsers(dest="plan_command", required=True)
    w = psub.add_parser("write", help="write plan/defaults.yaml and one plan per registered algorithm")
    w.add_argument("directory", nargs="?", default="plan")
    w.add_argument("--collaborators", type=int, default=3)
    w.set_defaults(func=cmd_plan_write)

    p = sub.add_parser("pki", help="make a local development PKI in a workspace with fx commands")
    p.add_argument("workspace")
    p.add_argument("--collaborators", nargs="+", help="names (default: plan/cols.yaml)")
    p.add_argument("--fqdn", default="localhost")
    p.add_argument("--dry-run", action="store_true", help="print the fx commands only")
    p.set_defaults(func=cmd_pki)

    p = sub.add_parser("audit", help="what leaves each site under a plan, its DP guarantee and transport; "
                                     "optionally checked against a policy (exit 1 on a violation)")
    p.add_argument("target", metavar="WORKSPACE_OR_PLAN")
    p.add_argument("--policy", help="a site policy YAML file (see policies/example-site.yaml)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("algorithms", help="list the registered algorithms and their settings")
    p.set_defaults(func=cmd_algorithms)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FedContrastError as exc:
        print(f"fedcontrast: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("fedcontrast: interrupted; finished rounds are saved, continue with --resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
