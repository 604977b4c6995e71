"""The ``fedcontrast`` parser, assembled from the command groups, and the entry point ``main``."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import FedContrastError
from . import audit, federation, flower, folders, runs, sites
from .sites import cmd_site_start

GROUPS = (runs, federation, sites, folders, audit, flower)
# the order `fedcontrast --help` lists the commands in (the groups interleave); any other goes last
COMMAND_ORDER = ("simulate", "probe", "compare", "partition", "federation", "workspace", "ca", "site", "report",
                 "public", "pretrain", "plan", "pki", "audit", "doctor", "flower", "algorithms")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedcontrast",
                                     description="Contrastive federated learning: a simulator, OpenFL and Flower.")
    sub = parser.add_subparsers(dest="command", required=True)
    group_of = {name: group for group in GROUPS for name in group.COMMANDS}
    for name in [*COMMAND_ORDER, *(n for n in group_of if n not in COMMAND_ORDER)]:
        group_of[name].register(sub, [name])
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
        # FEDCONTRAST_DEVICE_STAND_IN=1: device mistakes fail as on CUDA (devices.py). Read here without
        # importing torch, which commands that need none (a site's SuperNode wrapper) would carry for nothing.
        if os.environ.get("FEDCONTRAST_DEVICE_STAND_IN", "") not in ("", "0"):
            from ..devices import cpu_stand_in

            with cpu_stand_in():
                return args.func(args)
        return args.func(args)
    except FedContrastError as exc:
        print(f"fedcontrast: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    except ModuleNotFoundError as exc:  # an engine is an install extra
        if (exc.name or "").split(".")[0] == "flwr":
            from ..flower.records import INSTALL_HINT

            print(f"fedcontrast: error: {INSTALL_HINT}", file=sys.stderr)
            return 2
        if (exc.name or "").split(".")[0] != "openfl":
            raise
        from ..openfl.fx import OPENFL_MISSING

        print(f"fedcontrast: error: {OPENFL_MISSING}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedcontrast: interrupted; finished rounds are saved, continue with --resume", file=sys.stderr)
        return 130
