"""The checks the aggregator and collaborators run when OpenFL builds them, before any round:
the plan, the port, the initial model, the checkpoint database, the settings in effect."""

from __future__ import annotations

import logging
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from ..config import RunConfig, site_names
from ..construction import build_algorithm, build_algorithm_with_public, initial_model, load_public
from ..deploy.workspace import load_plan_file
from ..errors import ConfigError
from . import aggregation
from .enrolment import check_server_files
from .guard import fx_plan_path
from .packing import GLOBAL_PACKED, packed_size
from .protocol import UPLOAD_MARGIN

# one logger for the plan's components, as log lines name it
logger = logging.getLogger("fedcontrast.openfl.components")

def _check_collaborators(config: RunConfig, authorized: list[str], min_sites: int | None) -> None:
    """The aggregator admits exactly the plan's sites, each once (a site's index, e.g. FedPCL's
    prototype set, is its position in the plan): a name added to cols.yaml (``fx collaborator
    certify`` appends every name it signs) or listed twice would count a site's data twice, a name
    missing would run the federation without that site."""
    names = site_names(config)
    remake = "or make a plan with the sites taking part (`fedcontrast workspace create ... --sites`)"
    strangers = [c for c in authorized if c not in names]
    if strangers:
        raise ConfigError(f"plan/cols.yaml admits {', '.join(strangers)}, which the plan does not name as a site "
                          f"({', '.join(names)}); remove them from cols.yaml {remake}")
    repeated = sorted({c for c in authorized if authorized.count(c) > 1})
    if repeated:
        raise ConfigError(f"plan/cols.yaml lists {', '.join(repeated)} more than once (its data would count twice); "
                          f"list each of the plan's sites once in cols.yaml {remake}")
    missing = [n for n in names if n not in authorized]
    if missing:
        raise ConfigError(f"plan/cols.yaml lacks {', '.join(missing)}, a site of the plan ({', '.join(names)}); add "
                          f"it back to cols.yaml {remake}")
    if min_sites is not None and not (isinstance(min_sites, int) and 1 <= min_sites <= len(names)):
        raise ConfigError(f"min_sites must be an integer between 1 and the {len(names)} sites of the plan, "
                          f"got {min_sites!r}")


def check_aggregator_plan(config: RunConfig, settings: dict[str, Any], argv: list[str] | None = None,
                          cwd: str | Path = ".") -> Path | None:
    """The aggregator runs the rounds its plan's sites agreed to: ``rounds_to_train`` is the run
    configuration's ``rounds``; under ``fx aggregator start`` the plan file gives every component the
    same settings (:func:`~.plan.check_plan_consistency`), these are its ``aggregator.settings``, and
    the aggregator's own certificate and the CA chain are within their validity dates. The
    certificate folder when the plan serves with TLS under ``fx``, else None."""
    if settings["rounds_to_train"] != config.rounds:
        raise ConfigError(f"the plan's aggregator.settings.rounds_to_train ({settings['rounds_to_train']}) differs "
                          f"from the run configuration's rounds ({config.rounds}), for which the sites' privacy "
                          "budget is planned; regenerate the plan with `fedcontrast workspace create`")
    path = fx_plan_path("aggregator", argv, cwd)
    if path is None:
        return None
    plan = load_plan_file(path)
    ours = plan["aggregator"].get("settings") or {}
    differ = [key for key, value in settings.items() if ours.get(key) != value]
    if differ:
        raise ConfigError(f"the aggregator was not given the aggregator settings of {path} (differ: "
                          f"{', '.join(differ)}); start it with that plan: fx aggregator start -p {path}")
    network = plan.get("network", {}).get("settings") or {}
    port = network.get("agg_port")
    if isinstance(port, int) and not isinstance(port, bool):
        check_port_free(port)
    if network.get("use_tls", True):  # the files `fx aggregator start` serves with (OpenFL's default paths)
        address = network.get("agg_addr")
        if address == "auto":
            from openfl.utilities.utils import getfqdn_env

            address = getfqdn_env()
        # the certificate and key `fx aggregator start` will look up for agg_addr: present, in date, fitting
        check_server_files(Path(cwd) / "cert", str(address))
        return Path(cwd) / "cert"
    return None


def check_port_free(port: int) -> None:
    """Refuse, in one sentence naming the port, to serve on a port another process already listens on:
    gRPC binds with SO_REUSEPORT, so a second aggregator would start beside the first, and sites would
    reach whichever the kernel picks (the stale one, often, and then blame a CA mismatch)."""
    import errno
    import socket

    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine: try IPv4
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not "taken"
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(f"port {port} (the plan's network.settings.agg_port) is taken on this machine: "
                                      "another process listens on it (an aggregator still running?); stop it, or "
                                      "make the plan with another --port") from None
                continue  # e.g. IPv6 disabled: the other family decides
            return


def check_initial_model(path: str | Path, global_specs: list) -> None:
    """``save/init.pbuf`` (written by ``fx plan initialize``) holds this plan's initial downlink: a
    plan edited afterwards (another model, another plugin) needs it made again."""
    path = Path(path)
    if not path.is_file():
        return  # OpenFL names the missing file
    from openfl.pipelines import NoCompressionPipeline
    from openfl.protocols import utils

    advice = "re-run `fx plan initialize` after any change to plan/plan.yaml"
    try:
        tensors, _ = utils.deconstruct_model_proto(utils.load_proto(str(path)), NoCompressionPipeline())
    except Exception as exc:  # protobuf's DecodeError, a truncated file
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}); {advice}") from None
    expected = packed_size(global_specs)
    found = np.asarray(tensors[GLOBAL_PACKED]).size if GLOBAL_PACKED in tensors else None
    if found != expected:
        what = f"{found} values" if found is not None else f"no {GLOBAL_PACKED!r} tensor"
        raise ConfigError(f"{path} is not this plan's initial model ({what} where the plan's model has {expected}): "
                          f"it was made before the plan was edited; {advice}")


def check_tensor_db(path: str | Path) -> None:
    """OpenFL's checkpoint database opens cleanly, or one sentence naming it (a corrupt file would
    otherwise end the aggregator in a traceback on every start)."""
    path = Path(path)
    if not path.exists():
        return
    # A kill in the middle of a transaction leaves a hot journal: SQLite rolls it back on the next open
    # with write access (what OpenFL's open would do), and a read-only open fails ("attempt to write a
    # readonly database") although nothing is corrupt. Open it as OpenFL will, then.
    hot = any(path.with_name(path.name + suffix).exists() for suffix in ("-journal", "-wal"))
    try:
        with closing(sqlite3.connect(path.resolve().as_uri() + ("?mode=rw" if hot else "?mode=ro"), uri=True)) as db:
            status = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.Error as exc:
        status = str(exc)
    if status != "ok":
        raise ConfigError(f"the aggregator's checkpoint database {path} is corrupt ({status}); move it away to start "
                          "the federation afresh (its rounds are lost), or put back a good copy to resume")


def declared_uploads(config: RunConfig, model_shape: dict[str, int], assigner: Any = None) -> tuple[Any, list]:
    """The plugin and its declared uploads, read from the plan's aggregation functions when OpenFL has
    built them (``assigner.tasks``: no second build of the plugin, no second read of the public set),
    else built here."""
    for task in (getattr(assigner, "tasks", None) or {}).values():
        function = task.get("aggregation_type") if isinstance(task, dict) else None
        if isinstance(function, aggregation.PluginAggregation):
            return function.algorithm, function.specs
    algorithm = build_algorithm(config)
    if algorithm.requires_public:  # e.g. FLESD: the upload's shape depends on the public set, built with it
        algorithm = build_algorithm_with_public(config, load_public(config))
    model = initial_model(config, **model_shape)
    return algorithm, algorithm.upload_specs(model, model_shape["num_classes"])


def upload_limit(config: RunConfig, model_shape: dict[str, int], assigner: Any = None) -> int:
    """The most bytes one upload call may carry: the plugin's declared upload, packed (or, under
    secure aggregation, its masked vector if larger), plus :data:`UPLOAD_MARGIN` for the message around it."""
    algorithm, specs = declared_uploads(config, model_shape, assigner)
    size = packed_size(specs) * 4
    secure = config.secure_aggregation
    if secure is not None:  # the masked vector, in the ring's words (64 bits: twice a float32 upload)
        from ..privacy.secagg_terms import SumLayout

        size = max(size, SumLayout.of(algorithm, specs, secure).words * secure.bits // 8 + 8)
    return size + UPLOAD_MARGIN


def check_settings_in_effect(task_runner: Any, client: Any) -> None:
    """Behind the plan check, on the objects themselves: the connection and the training run with
    the settings this site's policy was checked against (the data loader's)."""
    from .loader import SiteDataLoader
    from .runner import PluginTaskRunner

    loader = getattr(task_runner, "data_loader", None)
    if not isinstance(task_runner, PluginTaskRunner) or not isinstance(loader, SiteDataLoader):
        raise ConfigError("the plan's task_runner or data_loader is not fedcontrast's (PluginTaskRunner, "
                          "SiteDataLoader), so this site's policy was not checked; use a plan made by "
                          "`fedcontrast workspace create`")
    checked = loader.network or {}
    problems = [f"{key} is {getattr(client, key, None)} on the connection but {checked.get(key, True)} in the "
                "settings this site's policy was checked against"
                for key in ("use_tls", "require_client_auth")
                if bool(getattr(client, key, None)) != bool(checked.get(key, True))]
    if task_runner.config != loader.config:
        a, b = task_runner.config.to_dict(), loader.config.to_dict()
        problems.append("the task runner's run configuration differs from the data loader's in: "
                        + ", ".join(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)))
    if problems:
        raise ConfigError(f"the plan splits what runs from what was checked: {'; '.join(problems)}")
