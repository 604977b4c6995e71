"""The ``fedcontrast`` command line: simulate, compare, partition, audit, algorithms.

Errors caused by the user's input print one sentence and exit with code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .config import RunConfig, load_yaml
from .errors import ConfigError, FedContrastError
from .yamlio import loads_yaml

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
    p.add_argument("--robustness", dest="robustness_settings", action="append", default=[], metavar="KEY=VALUE",
                   help="what the aggregator accepts from a site, e.g. --robustness rule=median, "
                        "--robustness max_update_ratio=1, --robustness 'max_samples={hosp1: 900, hosp2: 400}', "
                        "--robustness on_rejected=exclude (README: Hostile sites)")


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
    return algorithm, key, loads_yaml(value, f"--set {text!r}")


def _mapping(value: Any, name: str) -> dict[str, Any]:
    """A copy of the YAML section ``name`` (empty when left out); anything but a mapping is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping of settings, got {value!r}")
    return dict(value)


def config_from_args(args: argparse.Namespace, *, default_algorithm_for_set: bool = True) -> RunConfig:
    data: dict[str, Any] = load_yaml(args.config) if args.config else {}
    data = dict(data)
    training = _mapping(data.get("training"), "training")
    for key in RUN_FLAGS:
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    for key in TRAINING_FLAGS:
        if getattr(args, key, None) is not None:
            training[key] = getattr(args, key)
    data["training"] = training
    hyper = {k: _mapping(v, f"hyperparameters.{k}") for k, v in _mapping(data.get("hyperparameters"),
                                                                          "hyperparameters").items()}
    default_alg = data.get("algorithm", RunConfig.algorithm) if default_algorithm_for_set else None
    for text in args.settings:
        algorithm, key, value = _parse_setting(text, default_alg)
        hyper.setdefault(algorithm, {})[key] = value
    data["hyperparameters"] = hyper
    robustness = _mapping(data.get("robustness"), "robustness")
    for text in getattr(args, "robustness_settings", []):
        key, value = text.split("=", 1) if "=" in text else (text, None)
        if value is None or not key:
            raise ConfigError(f"--robustness expects KEY=VALUE, got {text!r}")
        robustness[key.strip()] = loads_yaml(value, f"--robustness {text!r}")
    if robustness:
        data["robustness"] = robustness
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
    if "local_accuracy" in final:  # personalised plugins (FedPCL) report no balanced accuracy
        spread = f" ± {final['local_accuracy_std']:.4f}" if "local_accuracy_std" in final else ""
        balanced = (f", {final['local_balanced_accuracy']:.4f} on the balanced test split"
                    if "local_balanced_accuracy" in final else "")
        print(f"sites' local models: {final['local_accuracy']:.4f}{spread} on their own label distributions{balanced}")
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
    if args.write_folders:
        from .data.folders import write_site_folders

        if args.sites:
            config = config.replace(sites=tuple(n.strip() for n in args.sites.split(",") if n.strip()))
        folders = write_site_folders(config, args.write_folders)
        print("image folders (train/ = the site's shard, test/ = held out with its own label distribution): "
              + ", ".join(f"{name} {path}" for name, path in folders.items()))
    return 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    import dataclasses

    from .algorithms import available_algorithms, get_algorithm

    for name in available_algorithms():
        cls = get_algorithm(name)
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Hyperparameters))
        print(f"{name:10s} tasks: {', '.join(cls.tasks):24s} settings: {fields or '-'}")
    return 0


def check_port(port: int | None) -> None:
    """A TCP port given with --port (None: the default) must be one: 1 … 65535."""
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"--port must be a TCP port from 1 to 65535, got {port}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_input_shape(text: str) -> tuple[int, int, int]:
    """``1x32x32`` (channels × height × width) → ``(1, 32, 32)``."""
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--input-shape must be CHANNELSxHEIGHTxWIDTH, e.g. 1x32x32, got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def parse_classes(text: str) -> tuple[str, ...]:
    """``cat,dog,bird`` (folder names in label order), or a number N for the folders ``0`` … ``N-1``."""
    text = text.strip()
    if text.isdigit():
        return tuple(str(i) for i in range(int(text)))
    return tuple(c.strip() for c in text.split(",") if c.strip())


def _numbers(text: str | None, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} must be numbers separated by commas (one per channel), got {text!r}") from None


def deployment_config(args: argparse.Namespace) -> tuple[RunConfig, Path | None]:
    """The run configuration of ``workspace create``: the flags, plus the data schema (from
    ``--input-shape``/``--classes``, or read off ``--data-root``), the sites and the public folder
    (fingerprinted; the schema's normalisation is measured on it unless ``--mean``/``--std``)."""
    from .config import DataSchema, PublicDataConfig

    config = config_from_args(args)
    changes: dict[str, Any] = {}
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
                            _numbers(args.mean, "--mean"), _numbers(args.std, "--std"))
    elif config.dataset == "imagefolder":
        if config.data_root is None:
            raise ConfigError("imagefolder needs the sites' data schema: pass --input-shape C×H×W and --classes "
                              "(the operator needs no data), or --data-root FOLDER to read it off an example folder")
        from .data.schema import infer_schema

        schema = infer_schema(config.data_root, image_size=config.image_size)
        if args.mean or args.std:
            schema = DataSchema(schema.input_shape, schema.classes, _numbers(args.mean, "--mean"),
                                _numbers(args.std, "--std"))
    public_source = Path(args.public_data).expanduser().resolve() if args.public_data else None
    if public_source is not None:
        if schema is None:
            raise ConfigError("--public-data is for deployments with a data schema (--input-shape and --classes)")
        from .data.schema import folder_fingerprint, summarise_folder, with_statistics

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
    from .config import site_names
    from .openfl.plan import DEFAULT_PORT, create_workspace, read_workspace_config

    check_port(args.port)
    config, public_source = deployment_config(args)
    if args.collaborators is None and not config.sites:
        raise ConfigError("say how many sites: --sites NAME,NAME,... (institutions) or --collaborators N")
    ws = create_workspace(args.directory, config, collaborators=args.collaborators, address=args.address,
                          port=args.port or DEFAULT_PORT, tls=not args.no_tls, round_timeout=args.round_timeout,
                          min_sites=args.min_sites, wait_for_aggregator=args.wait_for_aggregator,
                          public_source=public_source)
    if args.pki_from:
        from .openfl.deploy import reuse_pki

        reuse_pki(ws, args.pki_from)
        print(f"reused the certificate authority and certificates of {args.pki_from}")
    config = read_workspace_config(ws)  # as written (e.g. FedPCL's backbone files added)
    names = site_names(config)
    print(f"workspace {ws}: {config.algorithm}, {len(names)} sites ({', '.join(names)}), {config.rounds} rounds, "
          f"TLS {'off' if args.no_tls else 'on (mutual)'}, aggregator {args.address}")
    if config.data_schema is not None:
        s = config.data_schema
        print(f"data schema: {s.in_channels}×{s.image_size}×{s.image_size} images, {s.num_classes} classes "
              f"({', '.join(s.classes[:10])}{', …' if s.num_classes > 10 else ''}); normalisation "
              + (f"mean {list(s.mean)} std {list(s.std)}" if s.mean else "each site's own statistics"))
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
    from .openfl.deploy import export_workspace

    from .openfl.plan import read_workspace_config

    archive = export_workspace(args.workspace)
    config = read_workspace_config(args.workspace)
    print(f"wrote {archive} (the plan, the initial model and what the sites need; no key, no data, no code)")
    join = f"fedcontrast site join {archive.name} --name NAME --data FOLDER"
    if config.public_data is not None:
        join += f" --public PUBLIC_FOLDER (fingerprint {config.public_data.sha256[:16]}…)"
    print(f"send it to every institution; each runs: {join}")
    enrolled = sorted((Path(args.workspace) / "cert" / "client").glob("col_*.crt"))
    if enrolled:  # the PKI of an earlier experiment: those sites keep their keys and certificates
        print(f"sites already enrolled in this federation ({', '.join(p.stem[4:] for p in enrolled)}) add "
              "--cert-from THEIR_EARLIER_WORKSPACE (no new request); the others send the request it makes")
    return 0


def cmd_ca_init(args: argparse.Namespace) -> int:
    from .openfl.deploy import init_ca

    chain = init_ca(args.workspace, fqdn=args.fqdn)
    print(f"certificate authority in {Path(args.workspace) / 'cert' / 'ca'} (its private keys never leave this "
          f"machine) and the aggregator's certificate in {Path(args.workspace) / 'cert' / 'server'}; CA chain {chain}")
    return 0


def cmd_ca_sign(args: argparse.Namespace) -> int:
    from .openfl.deploy import sign_request

    def confirm(site: str, csr_hash: str) -> bool:  # `site`: the name read from the CSR itself
        print(f"request {Path(args.request).name}: its CSR is for CN={site} (the site {args.site} you sign for); "
              f"SHA-384 hash {csr_hash}")
        if args.yes:
            return True
        try:
            answer = input(f"Is this the hash {site} read out to you (by phone or another channel)? [y/N] ")
        except EOFError:  # no terminal to ask on
            raise ConfigError("no one to confirm the request's hash (no terminal): compare it with the site's, then "
                              "pass --yes") from None
        return answer.strip().lower() in ("y", "yes")

    signed = sign_request(args.workspace, args.request, confirm=confirm, site=args.site)
    print(f"signed the certificate of {signed.site} (CN={signed.site}, serial {signed.serial}, SHA-256 "
          f"{signed.sha256}); {signed.site} is admitted in plan/cols.yaml with this certificate only")
    print(f"send {signed.signed} back to {signed.site} (it holds their certificate and the CA chain; no key)")
    return 0


def cmd_ca_revoke(args: argparse.Namespace) -> int:
    from .openfl.deploy import revoke_site

    record = revoke_site(args.workspace, args.name, reason=args.reason)
    cert = Path(args.workspace) / "cert"
    print(f"revoked {record['name']}'s certificate (serial {record['serial']}, SHA-256 {record['sha256']}): recorded "
          f"in {cert / 'revoked.jsonl'}, the certificate kept as {record['kept']}; the aggregator refuses it from its "
          "next connection on")
    name = record["name"]
    print(f"to let {name} back in: it makes a new request (`fedcontrast site join ... --name {name}`), you sign it "
          f"(`fedcontrast ca sign {args.workspace} REQUEST.zip --site {name}`)")
    return 0


def cmd_site_join(args: argparse.Namespace) -> int:
    from .openfl.deploy import join, package_plan

    joined = join(args.package, name=args.name, data=args.data, public=args.public, into=args.into,
                  cert_from=args.cert_from, policy=args.policy)
    s = joined.summary
    present = {c: n for c, n in s.counts.items() if n}
    print(f"workspace {joined.workspace}: {args.name} reads {s.folder} ({s.total} images; training images per "
          "class: " + ", ".join(f"{c}={n}" for c, n in present.items())
          + (f"; absent: {', '.join(s.missing_classes())}" if s.missing_classes() else "")
          + ("; test/ folder held out" if s.split_folders else "; a stratified test split is held out") + ")")
    network = (package_plan(Path(args.package).resolve()).get("network") or {}).get("settings") or {}
    tls = ("TLS and client authentication on" if network.get("use_tls", True) and network.get("require_client_auth", True)
           else "TLS or client authentication off, as this site's policy allows")
    print(f"checked: the package carries no code and no key, names only the installed fedcontrast's components; {tls}")
    print(f"your private key {joined.workspace / 'cert' / 'client' / f'col_{args.name}.key'} stays on this machine")
    if joined.request is None:
        print(f"certificate reused from {args.cert_from} and checked; ready: fedcontrast site start "
              f"{joined.workspace} --name {args.name}")
        return 0
    print(f"send {joined.request} to the operator, and read them this hash by another channel: {joined.csr_hash}")
    print(f"then: fedcontrast site import-cert agg_to_col_{args.name}_signed_cert.zip --workspace {joined.workspace}")
    return 0


def cmd_site_import_cert(args: argparse.Namespace) -> int:
    from .openfl.deploy import import_certificate

    ws = Path(args.workspace)
    name = import_certificate(ws, args.signed)
    print(f"{name}'s certificate is installed and checked (it fits this site's key and the federation's CA)")
    print(f"ready: fedcontrast site start {ws} --name {name}")
    return 0


FX_START_OPTIONS = {"plan": ("-p", "--plan"), "data_config": ("-d", "--data_config")}


def _fx_option(extra: list[str], option: str) -> str | None:
    """The value ``fx collaborator start`` would take for ``option`` ("plan" or "data_config") from
    the extra arguments; None when they do not give it."""
    from .openfl.plan import fx_option

    return fx_option(extra, FX_START_OPTIONS[option])


def site_data_names(path: Path) -> list[str]:
    """The site names of a ``NAME,PATH`` data file, read as OpenFL reads it (blank lines and lines
    starting with ``#`` skipped, the name up to the first comma)."""
    from .openfl.plan import read_data_lines

    return list(read_data_lines(path))


def site_start_command(workspace: str | Path, name: str, *, plan: str | None = None, data_config: str | None = None,
                       extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The pre-flight of ``fedcontrast site start``: what ``fx collaborator start -n NAME`` would stop
    on later (or with a traceback), each refused with one sentence; the ``fx`` command line to run
    in ``workspace`` when every check passes."""
    from .openfl.package_trust import check_policy_for_workspace, check_workspace
    from .openfl.pki import fx_executable
    from .openfl.plan import collaborator_names, load_plan_file

    ws = Path(workspace)
    extra = list(extra)
    if any(a in ("-n", "--collaborator_name") or a.startswith(("-n", "--collaborator_name=")) for a in extra):
        raise ConfigError("give this site's name with --name only, not among the fx arguments after --")
    fx_plan, fx_data_config = _fx_option(extra, "plan"), _fx_option(extra, "data_config")  # fx's own take precedence
    plan, data_config = fx_plan or plan, fx_data_config or data_config
    plan_path = ws / (plan or "plan/plan.yaml")
    if not ws.is_dir():
        raise ConfigError(f"{ws} is not a folder: give this site's workspace (the folder `fedcontrast site join` "
                          "unpacked)")
    if not plan_path.is_file():
        raise ConfigError(f"{ws} is not a workspace: {plan_path} does not exist (unpack the operator's package with "
                          "`fedcontrast site join PACKAGE.zip --name NAME --data FOLDER`)")
    plan_data = load_plan_file(plan_path)
    network = plan_data.get("network", {}).get("settings") or {}
    # no code in the workspace, only installed components, TLS on unless the site's policy allows it off
    check_workspace(ws, plan_data, check_policy_for_workspace(ws), plan_source=str(plan_path))
    data_path = ws / (data_config or "plan/data.yaml")
    if not data_path.is_file():
        raise ConfigError(f"{data_path} does not exist: write this site's data line with `fedcontrast site join`")
    names = site_data_names(data_path)
    if name not in names:
        listed = f"it names {', '.join(names)}" if names else "it names no site"
        raise ConfigError(f"{data_path} has no line for {name} ({listed}): start the site named there, or add the "
                          f"line {name},PATH_TO_ITS_IMAGES with `fedcontrast site join`")
    cols = ws / "plan" / "cols.yaml"
    admitted = collaborator_names(ws)
    if name not in admitted:
        raise ConfigError(f"{name} is not among the collaborators of {cols} ({', '.join(admitted) or 'none'}), so the "
                          "aggregator would refuse it: use the name the operator enrolled this site under")
    if network.get("use_tls", True):
        crt = ws / "cert" / "client" / f"col_{name}.crt"
        key = crt.with_suffix(".key")
        if not key.is_file():
            missing = f"{crt} and {key} are" if not crt.is_file() else f"{key} is"
            raise ConfigError(f"{missing} missing, and the plan uses TLS: make this site's key and certificate request "
                              f"with `fedcontrast site join ... --name {name}` on this machine (the key never "
                              "travels), then install the certificate the operator signed with `fedcontrast site "
                              f"import-cert agg_to_col_{name}_signed_cert.zip --workspace {ws}`")
        chain = ws / "cert" / "cert_chain.crt"  # the federation's CA, installed with the certificate
        if not crt.is_file() or not chain.is_file():
            missing = " and ".join(str(p) for p in (crt, chain) if not p.is_file())
            raise ConfigError(f"{missing} {'are' if ' and ' in missing else 'is'} missing, and the plan uses TLS: "
                              "install the certificate the operator signed with `fedcontrast site import-cert "
                              f"agg_to_col_{name}_signed_cert.zip --workspace {ws}`")
    # Everything the collaborator would stop on later (after fx's start-up and ~130 lines of plan), said now:
    # every check of the doctor — certificates and (when it already listens) the aggregator's, the data
    # line and folder, the policy, the public folder and shared files, the code, the transport.
    from .openfl.doctor import FAIL, run_checks

    for check in run_checks(ws, name, plan_path=plan_path, data_path=data_path):
        if check.status == FAIL:
            raise ConfigError(check.message)
    fx = fx_executable()
    if not Path(fx).is_absolute():
        import shutil

        fx = shutil.which(fx) or ""
        if not fx:
            raise ConfigError("fx (OpenFL's command line) is not installed next to fedcontrast nor on the PATH: "
                              "install the workspace's requirements.txt")
    argv = [fx, "collaborator", "start", "-n", name]
    if plan is not None and fx_plan is None:
        argv += ["-p", plan]
    if data_config is not None and fx_data_config is None:
        argv += ["-d", data_config]
    return argv + extra


def cmd_site_start(args: argparse.Namespace) -> int:
    import os

    ws = Path(args.workspace)
    argv = site_start_command(ws, args.name, plan=args.plan, data_config=args.data_config, extra=args.fx_args)
    print(f"fedcontrast site start: {args.name}'s workspace {ws} passed the checks; running "
          f"{' '.join(['fx', *argv[1:]])} in it", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(ws)
    os.execv(argv[0], argv)  # fx takes this process over: its id, signals and exit code are fx's
    return 0  # not reached (os.execv returns only when replaced in tests)


def _report_score(ws: Path, name: str | None) -> int:
    """``report --score``: the final model a site took home, scored again on its own held-out data."""
    from .openfl.site_report import score_in_workspace

    def show(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    name, scored, reported = score_in_workspace(ws, name)
    print(f"final model on {name}'s held-out data: accuracy {show(scored.get('accuracy'))} (the site's report says "
          f"{show(reported.get('accuracy'))})")
    others = {k: v for k, v in sorted(scored.items()) if k != "accuracy"}
    if others:
        print("other metrics: " + ", ".join(f"{k} {show(v)}" for k, v in others.items()))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .openfl.launch import export_results, format_round, read_rounds
    from .openfl.site_report import format_row, pick_site_report, read_rows, site_report_folders

    ws = Path(args.workspace)
    if args.score:
        return _report_score(ws, args.name)
    records = read_rounds(ws)
    folders = [] if records else site_report_folders(ws)
    if folders:  # a site's workspace: its own report (--name: that site's, refused if it has none here)
        for folder in [pick_site_report(ws, args.name)] if args.name is not None else folders:
            for row in read_rows(folder):
                print(format_row(row, folder.name))
            files = ", ".join(p.name for p in sorted(folder.iterdir()) if p.is_file())
            print(f"{folder.name}: {files} in {folder}")
        return 0
    if not records:
        raise ConfigError(f"{ws / 'save' / 'rounds.jsonl'} holds no finished round yet, nor does a site report "
                          f"under {ws / 'local_state' / 'site_report'} (is this a federation's workspace, and has a "
                          "round finished?)")
    for record in records:
        print(format_round(record))
    out = Path(args.out) if args.out else ws / "report"
    summary = export_results(ws, out)
    files = "accuracy.png, rounds.csv and summary.json" if summary["plot"] else "rounds.csv and summary.json"
    print(f"{summary['rounds_completed']} rounds; {files} in {out}")
    for key, reason in summary["why_null"].items():  # also in summary.json: why a value is null
        print(f"{'no accuracy.png' if key == 'plot' else f'{key} is null'}: {reason}")
    return 0


def cmd_public_fingerprint(args: argparse.Namespace) -> int:
    from .data.schema import folder_fingerprint

    print(folder_fingerprint(args.folder))
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
    from .openfl.plan import plan_templates, write_plan_templates

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
    from .openfl.pki import dev_pki_commands, make_dev_pki
    from .openfl.plan import collaborator_names

    ws = Path(args.workspace)
    if not (args.dry_run and args.collaborators) and not (ws / "plan" / "plan.yaml").is_file():
        raise ConfigError(f"{ws} is not a workspace (no plan/plan.yaml): make one with `fedcontrast workspace create`")
    names = args.collaborators or collaborator_names(ws)
    if args.dry_run:
        print("\n".join(" ".join(c) for c in dev_pki_commands(names, fqdn=args.fqdn)))
        return 0
    make_dev_pki(args.workspace, names, fqdn=args.fqdn)
    print(f"certificate authority, aggregator and {len(names)} collaborator certificates in {Path(args.workspace) / 'cert'}")
    return 0


def cmd_federation(args: argparse.Namespace) -> int:
    import shutil
    import time

    from .openfl.launch import export_results, format_round, initialize_plan, run_federation
    from .openfl.pki import make_dev_pki
    from .openfl.plan import collaborator_names, create_workspace, read_workspace_config

    check_port(args.port)
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
        print(format_round(record), file=sys.stderr, flush=True)

    run_federation(ws, timeout=args.timeout, on_round=show)
    summary = export_results(ws, run_dir)
    acc, sites = summary["final_accuracy"], summary["final_site_accuracy_mean"]
    final = (f"final model (torch state_dict): {summary['final_model']}" if summary["final_model"]
             else f"final global tensors: {summary['final_downlink']}")
    no_acc = f"n/a ({summary['why_null'].get('final_accuracy', 'no global model')})"
    print(f"final global test accuracy {no_acc if acc is None else f'{acc:.4f}'}, at the sites "
          f"{'n/a' if sites is None else f'{sites:.4f}'} (weighted mean of their own held-out data) after "
          f"{summary['rounds_completed']} rounds ({time.perf_counter() - t0:.0f} s); {final}; results in {run_dir}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .openfl.doctor import FAIL, run_checks

    checks = run_checks(args.workspace, name=args.name)
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        print(f"fedcontrast doctor: {len(failed)} check{'s' if len(failed) > 1 else ''} failed ({', '.join(failed)}); "
              "fix what the FAIL lines say before starting this site", file=sys.stderr)
        return 1
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    import json

    from .privacy.audit import audit_plan, format_report, load_plan
    from .privacy.policy import SitePolicy, check_policy, compared_guarantee

    plan, workspace = load_plan(args.target)
    policy = SitePolicy.from_yaml(args.policy) if args.policy else None
    report = audit_plan(plan, source=str(args.target), workspace=workspace, policy=policy, site=args.site)
    # At a site, its policy bounds its own ε: the others' data (and ε) are not known there.
    violations = check_policy(report, policy, sites=report.here or None) if policy else []
    compared = compared_guarantee(report, policy) if policy else None
    if args.json:
        print(json.dumps({**report.to_dict(), "policy": args.policy, "compared": compared, "violations": violations},
                         indent=2))
    else:
        print(format_report(report), end="")
        if args.policy:
            print(f"\npolicy {args.policy}: " + ("compliant" if not violations else f"{len(violations)} violation(s)")
                  + f" ({compared})")
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
    p.add_argument("--write-folders", metavar="DIR", help="also write each site's share as an image folder (one "
                                                          "per site, plus public/): data to try a deployment with")
    p.add_argument("--sites", help="the sites' names for --write-folders, comma-separated (default site_0, ...)")
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
    w.add_argument("--collaborators", type=int, help="number of sites (default: those named by --sites)")
    w.add_argument("--sites", help="the institutions' names, comma-separated (lower case), e.g. hosp1,hosp2,hosp3")
    w.add_argument("--input-shape", help="the sites' images as CHANNELSxHEIGHTxWIDTH, e.g. 1x32x32 (the operator "
                                         "needs no data)")
    w.add_argument("--classes", help="class folder names in label order, e.g. normal,pneumonia; or a number N "
                                     "for the folders 0 … N-1")
    w.add_argument("--mean", help="per-channel normalisation mean, comma-separated (default: measured on "
                                  "--public-data, else each site's own)")
    w.add_argument("--std", help="per-channel normalisation std, comma-separated")
    w.add_argument("--public-data", help="a public image folder every party holds (FLESD distils on it; "
                                         "FedPCL's backbones are pre-trained on it); its fingerprint goes in the plan")
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

    p = sub.add_parser("ca", help="the federation's certificate authority (operator)")
    csub = p.add_subparsers(dest="ca_command", required=True)
    c = csub.add_parser("init", help="make the CA and the aggregator's certificate in a workspace")
    c.add_argument("workspace")
    c.add_argument("--fqdn", help="the aggregator's host name (default: the plan's agg_addr)")
    c.set_defaults(func=cmd_ca_init)
    c = csub.add_parser("sign", help="sign an institution's certificate request (col_NAME_to_agg_cert_request.zip)")
    c.add_argument("workspace")
    c.add_argument("request", metavar="REQUEST.zip")
    c.add_argument("--site", required=True, metavar="NAME",
                   help="the site you sign for: the request's CSR (its CN) and its file names must name it")
    c.add_argument("--yes", action="store_true", help="do not ask to compare the request's hash")
    c.set_defaults(func=cmd_ca_sign)
    c = csub.add_parser("revoke", help="revoke the certificate signed for a site (lost or compromised key): the "
                                       "aggregator refuses it, and the site may be signed a new one")
    c.add_argument("workspace")
    c.add_argument("name", metavar="NAME")
    c.add_argument("--reason", required=True, help="why (kept in cert/revoked.jsonl)")
    c.set_defaults(func=cmd_ca_revoke)

    p = sub.add_parser("site", help="join a federation as an institution")
    ssub = p.add_subparsers(dest="site_command", required=True)
    c = ssub.add_parser("join", help="import the operator's package, check this site's data, make its key and "
                                     "certificate request")
    c.add_argument("package", metavar="PACKAGE.zip")
    c.add_argument("--name", required=True, help="this site's name in the plan")
    c.add_argument("--data", required=True, help="this site's image folder (one sub-folder per class)")
    c.add_argument("--public", help="the public data folder, when the plan names one")
    c.add_argument("--into", default=".", help="folder to unpack the workspace in (default: here)")
    c.add_argument("--cert-from", metavar="OLD_WORKSPACE",
                   help="reuse this site's key and certificate from its workspace of an earlier experiment of the "
                        "same federation (no new request)")
    c.add_argument("--policy", metavar="SITE_POLICY.yaml",
                   help="this site's policy: checked against the package now and installed as the workspace's "
                        "site_policy.yaml (checked again at every start)")
    c.set_defaults(func=cmd_site_join)
    c = ssub.add_parser("import-cert", help="install the certificate the operator signed")
    c.add_argument("signed", metavar="SIGNED.zip")
    c.add_argument("--workspace", default=".", help="this site's workspace (default: here)")
    c.set_defaults(func=cmd_site_import_cert)
    c = ssub.add_parser("start", help="check this site's workspace (its data.yaml line, cols.yaml, certificate), then "
                                      "run fx collaborator start -n NAME in it (arguments after -- go to fx)",
                        usage="fedcontrast site start [WORKSPACE] --name NAME [-p PLAN] [-d DATA_CONFIG] [-- FX_ARGS]")
    c.add_argument("workspace", nargs="?", default=".", help="this site's workspace (default: here)")
    c.add_argument("--name", required=True, help="this site's name in the plan")
    c.add_argument("-p", "--plan", help="the plan, relative to the workspace (fx's default: plan/plan.yaml)")
    c.add_argument("-d", "--data_config", "--data-config", dest="data_config",
                   help="the data file, relative to the workspace (fx's default: plan/data.yaml)")
    c.set_defaults(func=cmd_site_start, fx_args=[])  # and any further fx arguments after --

    p = sub.add_parser("report", help="a federation's rounds so far: in the aggregator's workspace every site's "
                                      "held-out accuracy, plot, CSV, summary; in a site's workspace its own report")
    p.add_argument("workspace")
    p.add_argument("--out", help="folder for accuracy.png, rounds.csv, summary.json (default: WORKSPACE/report)")
    p.add_argument("--score", action="store_true", help="in a site's workspace: score the final model it took home "
                                                        "on its own held-out data, next to what its report says")
    p.add_argument("--name", help="the site whose report to show or score, when the workspace holds several")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("public", help="public data folders")
    psub2 = p.add_subparsers(dest="public_command", required=True)
    c = psub2.add_parser("fingerprint", help="SHA-256 fingerprint of a folder's files (as the plan records it)")
    c.add_argument("folder")
    c.set_defaults(func=cmd_public_fingerprint)

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
    w.add_argument("--force", action="store_true", help="replace plans already in the folder")
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
    p.add_argument("--site", help="the site whose data is on this machine (default: the data.yaml line whose folder "
                                  "exists here)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("doctor", help="a site's checks before it joins: its certificate and key, the aggregator's "
                                      "certificate, its data, its policy (exit 1 when one fails)")
    p.add_argument("workspace", nargs="?", default=".", help="the site's workspace (default: here)")
    p.add_argument("--name", help="this site's name (default: the one site plan/data.yaml names)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("algorithms", help="list the registered algorithms and their settings")
    p.set_defaults(func=cmd_algorithms)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # `site start ... -- FX_ARGS` (argparse's sub-commands do not keep what follows --)
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if extra:
        if args.func is not cmd_site_start:
            parser.error("arguments after -- are passed on to fx by `fedcontrast site start` only")
        args.fx_args = extra
    try:
        from .devices import cpu_stand_in, stand_in_requested

        if stand_in_requested():  # FEDCONTRAST_DEVICE_STAND_IN=1: device mistakes fail as on CUDA (devices.py)
            with cpu_stand_in():
                return args.func(args)
        return args.func(args)
    except FedContrastError as exc:
        print(f"fedcontrast: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except KeyboardInterrupt:
        print("fedcontrast: interrupted; finished rounds are saved, continue with --resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
