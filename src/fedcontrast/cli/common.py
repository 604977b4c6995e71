"""What several command groups share: the run flags and the configuration they make, the parsing
of the deployment flags, ports."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..config import RunConfig, load_yaml
from ..config.datasets import DATASETS
from ..config.run import is_plugin_file
from ..errors import ConfigError
from ..yamlio import loads_yaml

# flag name → config key (None default = "not given": the YAML file or the default applies)
RUN_FLAGS = {
    "algorithm": str, "dataset": str, "data_root": str, "image_size": int, "test_fraction": float,
    "public_fraction": float, "validation_fraction": float, "split_seed": int, "partition": str,
    "feature_shift": str, "clients": int,
    "beta": float,
    "shards_per_client": int, "min_samples": int, "model": str, "projection_dim": int, "rounds": int,
    "sample_fraction": float, "seed": int, "target_accuracy": float, "device": str,
}
TRAINING_FLAGS = {"local_epochs": int, "batch_size": int, "lr": float, "momentum": float,
                  "weight_decay": float, "augmentation": str, "clip_grad_norm": float, "lr_schedule": str}


def dataset_help() -> str:
    """--dataset's help: every registered data set by name, with its line (config/datasets.py)."""
    return "the data set (default digits): " + "; ".join(f"{name}: {line}" for name, line in DATASETS.items())


def _add_run_flags(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    p.add_argument("--config", help="YAML file of settings; flags given on the command line override it")
    helps = {"dataset": dataset_help(), "partition": "how the training data are split among the sites: dirichlet "
             "(default), iid, shards; natural for a data set with sites of its own (fedprox_synthetic)",
             "feature_shift": "none (default), or scanner: each site's images through a device of its own (contrast, "
             "brightness, blur, noise), the test split divided among the sites' devices (docs/usage.md)",
             "validation_fraction": "the part of each site's training data it holds out as its validation split "
             "(default 0.1; 0: none): what tuning and the best round look at, never the test split"}
    for key, typ in {**RUN_FLAGS, **TRAINING_FLAGS}.items():
        if key not in skip:
            p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None, help=helps.get(key))
    if "dataset" not in skip:
        p.add_argument("--dataset-setting", dest="dataset_setting_texts", action="append", default=[],
                       metavar="KEY=VALUE", help="a setting of the data set, e.g. --dataset-setting alpha=0.5 "
                                                 "--dataset-setting beta=0.5 for fedprox_synthetic (docs/usage.md)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="[ALG.]KEY=VALUE",
                   help="an algorithm hyper-parameter, e.g. --set mu=1 or --set moon.temperature=0.2")
    p.add_argument("--robustness", dest="robustness_settings", action="append", default=[], metavar="KEY=VALUE",
                   help="what the aggregator accepts from a site, e.g. --robustness rule=median, "
                        "--robustness max_update_ratio=1, --robustness 'max_samples={hosp1: 900, hosp2: 400}', "
                        "--robustness on_rejected=exclude (docs/hostile-sites.md)")
    p.add_argument("--secure-aggregation", dest="secure_aggregation", action="store_true", default=None,
                   help="the aggregator learns only the sum of the uploads (fedavg, fedprox, moon, flesd; fedssc "
                        "with class_reps: pooled, fedpcl with local_sets: global; docs/privacy.md)")
    p.add_argument("--secagg", dest="secagg_settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a secure-aggregation setting (implies --secure-aggregation): threshold=T, clip=C, "
                        "max_samples=S, bits=32|64, federation=ID (the name the sites pinned with their roster)")
    p.add_argument("--dp-sgd", dest="dp_sgd", metavar="NOISE[,CLIP]", default=None,
                   help="DP-SGD of local training (Opacus): noise multiplier σ and per-sample gradient clip (default "
                        "1), e.g. --dp-sgd 1.1 or --dp-sgd 1.1,0.5 (privacy.dp_sgd; docs/privacy.md)")
    p.add_argument("--dp-representations", dest="dp_representations", metavar="NOISE[,CLIP]", default=None,
                   help="the Gaussian mechanism on uploaded representations: noise multiplier σ and clip C (default "
                        "1), e.g. --dp-representations 2,1 (privacy.representations)")
    p.add_argument("--dp-delta", dest="dp_delta", type=float, default=None, metavar="DELTA",
                   help="δ the ε of --dp-sgd/--dp-representations is reported at (privacy.delta, default 1e-5)")


def _add_plugin_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="import this module before the settings are read, so that the algorithm it registers can be "
                        "named: a module name importable from here (the current folder or PYTHONPATH) or a .py file; "
                        "repeatable (docs/plugins.md)")


def import_flag_plugins(args: argparse.Namespace) -> None:
    """Import the ``--plugin`` modules; a module name (here and in the settings' ``plugins``) is found in
    the current folder too, as ``python -m`` finds it. One sentence for a module that is missing, fails
    to import or registers nothing."""
    from ..algorithms import import_plugins

    if not {"", os.getcwd()} & set(sys.path):
        sys.path.append(os.getcwd())  # last: a file here never hides an installed module
    import_plugins(getattr(args, "plugins", []))  # `flower init` shares the deployment's flags, not this one


def _add_schema_flags(p: argparse.ArgumentParser) -> None:
    """The sites' data schema and public folder of a deployment (``workspace create``, ``flower init``)."""
    p.add_argument("--input-shape", help="the sites' images as CHANNELSxHEIGHTxWIDTH, e.g. 1x32x32 (the operator "
                                         "needs no data)")
    p.add_argument("--classes", help="class folder names in label order, e.g. normal,pneumonia; or a number N "
                                     "for the folders 0 … N-1")
    p.add_argument("--mean", help="per-channel normalisation mean, comma-separated (default: measured on "
                                  "--public-data, else each site's own)")
    p.add_argument("--std", help="per-channel normalisation std, comma-separated")
    p.add_argument("--dicom-window", metavar="CENTER,WIDTH",
                   help="for DICOM images: the window applied after each file's rescale slope/intercept, e.g. 40,400 "
                        "for soft tissue in Hounsfield units (default: each file's own window)")
    p.add_argument("--public-data", help="a public image folder every party holds (FLESD distils on it; "
                                         "FedPCL's backbones are pre-trained on it); its fingerprint goes in the plan")


# flag → key of the executor section (how the simulator runs a round's sites)
EXECUTOR_FLAGS = {"executor": ("kind", str), "site_cpus": ("site_cpus", int), "site_gpus": ("site_gpus", float),
                  "ray_address": ("address", str), "ray_cpus": ("cpus", int), "sites_per_task": ("sites_per_task", int)}


def _add_executor_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", default=None, choices=("sequential", "ray", "flower"),
                   help="who trains a round's sites: sequential (this process, the default), ray (in parallel) or "
                        "flower (Flower's simulation runtime; the extra [flower]); results identical at the same "
                        "--site-cpus")
    p.add_argument("--site-cpus", dest="site_cpus", type=int, default=None,
                   help="torch threads (Ray CPUs) per site (default: 1 under ray, torch's default otherwise)")
    p.add_argument("--site-gpus", dest="site_gpus", type=float, default=None,
                   help="the fraction of a GPU a site's Ray task asks for, where CUDA is present")
    p.add_argument("--ray-address", dest="ray_address", default=None,
                   help="a Ray cluster to join (its head's ADDRESS:PORT); default: a local Ray for this run")
    p.add_argument("--ray-cpus", dest="ray_cpus", type=int, default=None,
                   help="cores the local Ray may use (default: every core)")
    p.add_argument("--sites-per-task", dest="sites_per_task", type=int, default=None,
                   help="about how many sites one Ray task trains one after another in one worker process "
                        "(default: automatic, two tasks per site slot and round; 1: a task per site)")


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


def _plugin_list(value: Any) -> list[str]:
    """A copy of the settings' ``plugins`` (empty when left out); anything but a list of texts is refused."""
    if value is None:
        return []
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"plugins must be a list of module names or .py files, got {value!r}")
    return list(value)


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
    plugins = [*_plugin_list(data.get("plugins")), *getattr(args, "plugins", [])]
    if plugins:  # a file by its absolute path: found again by a resume from elsewhere, and by Ray's workers
        data["plugins"] = list(dict.fromkeys(str(Path(p).expanduser().resolve()) if is_plugin_file(p) else p
                                             for p in plugins))
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
    secagg = data.get("secure_aggregation")
    secagg = _mapping(secagg, "secure_aggregation") if secagg is not None else None
    settings = getattr(args, "secagg_settings", []) or []
    if getattr(args, "secure_aggregation", None) or settings:
        secagg = secagg or {}
    for text in settings:
        key, value = text.split("=", 1) if "=" in text else (text, None)
        if value is None or not key:
            raise ConfigError(f"--secagg expects KEY=VALUE, got {text!r}")
        assert secagg is not None  # settings given: a mapping above
        key = key.strip()  # a federation's name is text as given (YAML would read 2026 or yes otherwise)
        secagg[key] = value.strip() if key == "federation" else loads_yaml(value, f"--secagg {text!r}")
    if secagg is not None:
        data["secure_aggregation"] = secagg
    privacy = privacy_section(data.get("privacy"), args)
    if privacy is not None:
        data["privacy"] = privacy
    executor = _mapping(data.get("executor"), "executor")
    for flag, (key, _) in EXECUTOR_FLAGS.items():
        if getattr(args, flag, None) is not None:
            executor[key] = getattr(args, flag)
    if executor:
        data["executor"] = executor
    own = _mapping(data.get("dataset_settings"), "dataset_settings")
    for text in getattr(args, "dataset_setting_texts", []) or []:
        key, value = text.split("=", 1) if "=" in text else (text, None)
        if value is None or not key.strip():
            raise ConfigError(f"--dataset-setting expects KEY=VALUE, got {text!r}")
        own[key.strip()] = loads_yaml(value, f"--dataset-setting {text!r}")
    if own:
        data["dataset_settings"] = own
    return RunConfig.from_dict(data)


# flag's dest → (the flag, its privacy section, the section's clip key)
DP_FLAGS = {"dp_sgd": ("--dp-sgd", "dp_sgd", "max_grad_norm"),
            "dp_representations": ("--dp-representations", "representations", "clip")}


def privacy_section(section: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``privacy`` section of the YAML file (None: left out) with the DP flags on top: ``--dp-sgd
    NOISE[,CLIP]``, ``--dp-representations NOISE[,CLIP]`` (σ, and the clip: ``max_grad_norm`` or ``clip``,
    default 1), ``--dp-delta``. One parser for every command that takes the run flags."""
    privacy = _mapping(section, "privacy") if section is not None else None
    for dest, (flag, key, clip_key) in DP_FLAGS.items():
        text = getattr(args, dest, None)
        if text is None:
            continue
        parts = [v.strip() for v in str(text).split(",")]
        try:
            if not 1 <= len(parts) <= 2:
                raise ValueError
            numbers = [float(v) for v in parts]
        except ValueError:
            raise ConfigError(f"{flag} expects NOISE or NOISE,CLIP (the noise multiplier σ and the clip), e.g. "
                              f"{flag} 1.1,1; got {text!r}") from None
        privacy = privacy or {}
        privacy[key] = {**_mapping(privacy.get(key), f"privacy.{key}"), "noise_multiplier": numbers[0],
                        **({clip_key: numbers[1]} if len(numbers) == 2 else {})}
    if getattr(args, "dp_delta", None) is not None:
        if privacy is None:
            raise ConfigError("--dp-delta sets the δ of a DP guarantee: add --dp-sgd or --dp-representations "
                              "(or a privacy: section in --config)")
        privacy["delta"] = args.dp_delta
    return privacy


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
