"""Runs on this machine: simulate, probe, compare, partition, pretrain, algorithms."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError
from .common import _add_executor_flags, _add_plugin_flag, _add_run_flags, config_from_args, import_flag_plugins


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..sim.simulator import print_progress, run_simulation

    import_flag_plugins(args)
    config = config_from_args(args)
    run_dir = Path(args.runs_dir) / (args.name or config.default_name())
    header = (f"fedcontrast simulate: {config.algorithm} on {config.dataset}, {config.clients} sites, "
              f"{config.partition} β={config.beta:g}, {config.rounds} rounds → {run_dir}")
    run = run_simulation
    if config.executor.kind == "flower":  # the same round loop, inside a Flower ServerApp
        from ..sim.flower_executor import run_on_flower as run
    summary = run(config, run_dir, resume=args.resume, overwrite=args.overwrite,
                  progress=None if args.quiet else print_progress(header),
                  local_evaluation=True if args.local_eval else None, linear_probe=args.linear_probe)
    print(accuracy_line(summary) + f"; {summary['wall_time_s']:.1f} s; results in {run_dir}")
    final = summary.get("final_metrics", {})
    if "local_accuracy" in final:  # personalised plugins (FedPCL) report no balanced accuracy
        spread = f" ± {final['local_accuracy_std']:.4f}" if "local_accuracy_std" in final else ""
        balanced = (f", {final['local_balanced_accuracy']:.4f} on the balanced test split"
                    if "local_balanced_accuracy" in final else "")
        print(f"sites' local models: {final['local_accuracy']:.4f}{spread} on their own label distributions{balanced}")
    if args.linear_probe and "probe_accuracy" in final:
        print(f"linear probe of the global encoder: {final['probe_accuracy']:.4f}")
    return 0


def accuracy_line(summary: dict) -> str:
    """The three splits of a finished run in one line: test, validation, the sites' training accuracy
    (labelled when it is one site's, not a mean), and the round the validation curve picks."""
    from ..outputs import one_site

    def fmt(key: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value:.4f}"

    best = (f"best round by validation {summary['best_round']} (validation {fmt('best_val_accuracy')}, test "
            f"{fmt('best_accuracy')})" if summary.get("best_round") is not None else
            "no validation split (validation_fraction 0): no best round")
    return (f"final test accuracy {fmt('final_accuracy')}, validation {fmt('final_val_accuracy')}, the sites' "
            f"training {fmt('final_train_accuracy')}{one_site(summary.get('final_train_sites'))}; {best}")


def cmd_probe(args: argparse.Namespace) -> int:
    import torch

    from ..construction import initial_model, load_splits
    from ..devices import resolve_device
    from ..evaluation import linear_probe

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
    from ..sim.compare import format_table, run_comparison
    from ..sim.simulator import print_progress

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
    from ..construction import load_splits, partition
    from ..data import format_partition_table, partition_counts, write_partition_report
    from ..data.report import format_partition_summary

    config = config_from_args(args)
    splits = load_splits(config)
    labels = splits.train.y.numpy()
    counts = partition_counts(labels, partition(config, splits), splits.num_classes)
    print(format_partition_table(counts) if len(counts) <= 100 else "(more than 100 sites: the table is in the CSV)")
    print(format_partition_summary(counts))
    if config.partition == "natural":  # the generator's own sites: its settings, not a partition's β
        how = ", ".join(f"{k}={v}" for k, v in sorted(config.dataset_settings.items())) or "default settings"
        name = config.default_name().split("-", 1)[1]
        title = f"{config.dataset} ({how}), split seed {config.split_seed}"
    else:
        name = f"{config.dataset}-k{config.clients}-{config.partition}{config.beta:g}-s{config.seed}"
        title = f"{config.dataset}: {config.partition} β={config.beta:g}, seed {config.seed}"
    out = Path(args.out or Path(args.runs_dir) / f"partition-{name}")
    paths = write_partition_report(counts, out, title=title)
    print(f"wrote {paths['csv']} and {paths['png']}")
    if args.write_folders:
        from ..data.folders import write_site_folders

        if args.sites:
            config = config.replace(sites=tuple(n.strip() for n in args.sites.split(",") if n.strip()))
        folders = write_site_folders(config, args.write_folders)
        print("image folders (train/ = the site's shard, test/ = held out with its own label distribution): "
              + ", ".join(f"{name} {path}" for name, path in folders.items()))
    return 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    import dataclasses

    from ..algorithms import available_algorithms, get_algorithm

    for name in available_algorithms():
        cls = get_algorithm(name)
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Hyperparameters))
        print(f"{name:10s} tasks: {', '.join(cls.tasks):24s} settings: {fields or '-'}")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    import torch

    from ..construction import load_splits
    from ..models.backbones import pretrain_backbone

    config = config_from_args(args)
    public = load_splits(config).public
    if public is None:
        raise ConfigError("pretrain trains on the data set's public split, and this configuration's public_fraction "
                          "is 0")
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


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run a federation in one process")
    _add_run_flags(p)
    _add_plugin_flag(p)
    _add_executor_flags(p)
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


def _add_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="linear-probe accuracy of a saved model's encoder (e.g. save/final_model.pt)")
    _add_run_flags(p)
    p.add_argument("model_file", metavar="MODEL.pt", help="a torch state_dict of the run's model")
    p.set_defaults(func=cmd_probe)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="several algorithms on the same partitions and seeds")
    _add_run_flags(p, skip=("algorithm",))
    _add_executor_flags(p)
    p.add_argument("--algorithms", nargs="+", default=["fedavg", "fedprox", "moon"],
                   help="algorithms, or variants such as moon:mu=1,temperature=0.2; the first is the reference")
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--name")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_compare)


def _add_partition(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("partition", help="show and save how a data set is split among sites")
    _add_run_flags(p)
    p.add_argument("--out", help="folder for partition.csv and partition.png")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--write-folders", metavar="DIR", help="also write each site's share as an image folder (one "
                                                          "per site, plus public/): data to try a deployment with")
    p.add_argument("--sites", help="the sites' names for --write-folders, comma-separated (default site_0, ...)")
    p.set_defaults(func=cmd_partition)


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretrain", help="pre-train FedPCL backbones on the public split and save their weights")
    _add_run_flags(p)
    p.add_argument("--backbones", nargs="+", default=["simple_cnn"],
                   help="architectures (simple_cnn, resnet18, resnet50)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--out", default="runs/backbones")
    p.set_defaults(func=cmd_pretrain)


def _add_algorithms(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("algorithms", help="list the registered algorithms and their settings")
    p.set_defaults(func=cmd_algorithms)


# command name → the function adding its sub-parser (build_parser orders them)
COMMANDS = {
    "simulate": _add_simulate,
    "probe": _add_probe,
    "compare": _add_compare,
    "partition": _add_partition,
    "pretrain": _add_pretrain,
    "algorithms": _add_algorithms,
}


def register(subparsers: argparse._SubParsersAction, names: Iterable[str] | None = None) -> None:
    """Add this group's sub-commands to ``subparsers`` (``names``: only those, in that order)."""
    for name in COMMANDS if names is None else names:
        COMMANDS[name](subparsers)
