"""``fedcontrast flower ...``: a real Flower deployment (the extra ``[flower]``), operator and sites.

Operator: ``init`` → ``superlink`` (leave running) → ``register`` (each site's public key) → ``run``.
Site: ``site-key`` (once; send the ``.pub`` file) → ``supernode`` (leave running).
The guide is docs/flower.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError
from .common import _add_run_flags, _add_schema_flags
from .flower_node import (  # noqa: F401 (the Flower programs' output: cli/flower_node.py; every name re-exported)
    ANSI,
    CONNECTED_MARKER,
    FLOWER_CHATTER,
    FLOWER_GAVE_UP,
    FLOWER_RETRIED,
    FLOWER_RETRY,
    FLOWER_TLS,
    RUN_NOT_RUNNING,
    TRACEBACK_STARTS,
    _Attempt,
    _forgotten,
    _run_child,
    _stop_when_gone,
    _superlink_ended,
    shown,
)

REFUSED_MARKERS = ("Failed to activate SuperNode", "No SuperNode found with the given public key")
REFUSED_RETRY_S = 10.0
FINISHED_MARKER = "fedcontrast: finished:"  # the ServerApp's last line, streamed by flwr run


def cmd_init(args: argparse.Namespace) -> int:
    from ..flower.deploy import init_operator, pin_shared
    from .federation import deployment_config

    config, public_source = deployment_config(args)
    folder = Path(args.directory).resolve()
    if public_source is not None and config.public_data is not None:  # a public folder of the plan's
        import shutil

        shutil.copytree(public_source, folder / config.public_data.folder, dirs_exist_ok=True)
    config = pin_shared(config, folder)
    init_operator(folder, config, host=args.address, port=args.port, round_timeout=args.round_timeout,
                  start_timeout=args.start_timeout, threads=args.threads, min_sites=args.min_sites,
                  federation=args.federation, pki_from=args.pki_from)
    from ..deploy.anchor import fingerprint_of_chain
    from ..deploy.anchor import shown as shown_fingerprint  # (this module's `shown`: a Flower line)
    from ..flower.pki import carried_keys

    extras = [p for p, on in (("secure aggregation", config.secure_aggregation is not None),
                              (f"DP ({', '.join(sorted(config.privacy.kinds))})" if config.privacy else "",
                               config.privacy is not None)) if on]
    print(f"Flower deployment of {config.algorithm} for {', '.join(config.sites or ())} in {folder}"
          + (f"; {', '.join(extras)}" if extras else ""))
    found, subject = fingerprint_of_chain((folder / "certs" / "ca.crt").read_bytes(), "ca.crt")
    print(f"  the federation's CA ({subject}): {shown_fingerprint(found)} — read this fingerprint to every site by "
          "phone or another channel, to compare with the ca.crt it is sent")
    carried = sorted(carried_keys(folder))
    if args.pki_from:
        others = [s for s in config.sites or () if s not in carried]
        print(f"  reused the CA of {args.pki_from} (the sites keep the ca.crt they hold) and the keys of "
              f"{', '.join(carried) or 'no site'}" + (f"; {', '.join(others)} send their key (flower site-key)"
                                                      if others else ""))
    else:
        print(f"  send {folder / 'certs' / 'ca.crt'} to every site, with the SuperLink's address "
              f"{args.address}:{args.port}")
    print(f"  next: fedcontrast flower superlink {folder}   (leave it running)"
          + (f", then fedcontrast flower register {folder} --carried" if carried else ""))
    return 0


def cmd_superlink(args: argparse.Namespace) -> int:
    from ..flower.deploy import flower_env, superlink_command

    return _run_child(superlink_command(args.directory), flower_env(Path(args.directory)), verbose=args.verbose)


def cmd_register(args: argparse.Namespace) -> int:
    from ..flower.deploy import register_carried, register_site

    if args.carried:  # the keys `init --pki-from` carried over: no new key exchange with those sites
        if args.public_key is not None or args.site is not None:
            raise ConfigError("--carried registers every carried key: give no PUBLIC_KEY nor --site with it")
        for site, node_id, fingerprint in register_carried(args.directory):
            print(f"registered site {site}: SuperNode {node_id}, key {fingerprint} (carried over, as registered in "
                  "the earlier experiment)")
        return 0
    if args.public_key is None or args.site is None:
        raise ConfigError("give the site's public key file and --site NAME (or --carried for the keys carried over "
                          "by `flower init --pki-from`)")
    node_id, fingerprint = register_site(args.directory, args.public_key, args.site)
    print(f"registered site {args.site}: SuperNode {node_id}, key {fingerprint} (read this fingerprint to the site)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ..flower.deploy import (
        OUTCOME_FILE,
        RUN_DIR,
        check_min_sites,
        flower_env,
        load_operator,
        run_command,
    )
    from ..flower.runs import check_run_folder, progress
    from ..outputs import one_site

    folder, config, _ = load_operator(args.directory)
    command = run_command(folder)
    state = check_run_folder(folder / RUN_DIR, config, resume=args.resume)  # one run per folder, never mixed
    outcome = folder / RUN_DIR / OUTCOME_FILE
    result = json.loads(outcome.read_text()) if outcome.exists() else {}
    if state == "finished" and result.get("status") != "finished":
        state = "resume"  # every round done, the final evaluation not: the resumed run does it
    if state == "finished":
        held = progress(folder / RUN_DIR) or {}
        acc = result.get("final_accuracy")
        print(f"this run finished already ({held.get('rounds_done')} rounds): the sites' held-out accuracy of the "
              f"final model {'n/a' if acc is None else f'{acc:.4f}'}{one_site(result.get('final_sites'))}; outputs in "
              f"{folder / RUN_DIR}")
        return 0
    given = {"round-timeout": args.round_timeout, "start-timeout": args.start_timeout}
    check_min_sites(config, args.min_sites)
    overrides = " ".join([f"{k}={float(v)}" for k, v in given.items() if v is not None]
                         + ([f"min-sites={int(args.min_sites)}"] if args.min_sites is not None else [])
                         + (['resume="true"'] if state == "resume" else []))
    if overrides:
        command += ["--run-config", overrides]
    outcome.unlink(missing_ok=True)
    streamed: list[str] = []
    code = _run_child(command, flower_env(folder), watch=streamed, verbose=args.verbose)
    if not outcome.exists():
        raise ConfigError(f"the Flower run ended (flwr exit code {code}) without a result in {outcome}; see the "
                          "SuperLink's output")
    result = json.loads(outcome.read_text())
    if result.get("status") != "finished":
        print(f"fedcontrast: error: {result.get('error')}", file=sys.stderr)
        return 1
    if not any(FINISHED_MARKER in line for line in streamed):  # the ServerApp's own line said it already
        acc = result.get("final_accuracy")
        print(f"finished: the sites' held-out accuracy of the final model {'n/a' if acc is None else f'{acc:.4f}'}"
              f"{one_site(result.get('final_sites'))}; outputs in {folder / RUN_DIR}")
    return 0


def cmd_site_key(args: argparse.Namespace) -> int:
    from ..flower.deploy import make_site_key

    private, public, fingerprint = make_site_key(args.directory, args.name)
    print(f"{args.name}'s SuperNode key: {private} (stays here) and {public} (send it to the operator)")
    print(f"  fingerprint {fingerprint}: read it to the operator by another channel")
    return 0


def cmd_supernode(args: argparse.Namespace) -> int:
    from ..flower.deploy import runtime_api_address, start_worker, supernode_command, worker_address
    from ..threads import choose_threads

    isolation = args.isolation if args.worker else "subprocess"  # without a worker: a ClientApp process each
    address = worker_address(Path(args.workdir)) if args.worker and isolation == "subprocess" else None
    threads = choose_threads(args.threads)  # this site's one party that computes: its worker (or ClientApps)
    command = supernode_command(superlink=args.superlink, ca=args.ca, key=args.key, name=args.name, data=args.data,
                                workdir=args.workdir, public=args.public, policy=args.policy, port=args.port,
                                wait=args.wait, threads=threads.threads, worker=address,
                                isolation=isolation)  # its checks come first
    print(f"{args.name}: {threads.line()}", flush=True)
    worker = None
    if isolation == "node":  # one process: the site's node (flower/node.py), its threads set in the command
        pass
    elif isolation == "process":  # the worker takes the SuperNode's tasks itself (flower/runner.py)
        worker = start_worker(None, threads.threads, runtime_api=runtime_api_address(args.port))
    elif address is not None:
        worker = start_worker(address, threads.threads)
    stopping = _stop_when_gone(worker, args.name) if isolation == "process" and worker is not None else None
    try:
        return _supernode(args, command)
    finally:
        if stopping is not None:
            stopping.set()
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)


def _supernode(args: argparse.Namespace, command: list[str]) -> int:
    from ..flower.deploy import key_fingerprint, public_of_private, site_env

    flower = "fedcontrast.flower.node" not in command  # Flower's SuperNode, not the site's own node
    deadline = time.monotonic() + args.retry_refused
    again, told = False, False  # started again after its SuperLink forgot it; its refusal said
    while True:
        attempt = _Attempt(args, flower=flower, again=again)
        signalled: list[int] = []
        code = _run_child(command, site_env(), verbose=args.verbose, on_line=attempt.line, signalled=signalled,
                          hide_traceback=_forgotten if flower else None,
                          show=attempt.show if flower and not args.verbose else None)
        if signalled:  # stopped by the site
            return code
        if attempt.connected and flower:
            sentence, restart = _superlink_ended(args, attempt.seen, code)
            if not restart:
                print(f"fedcontrast flower supernode: error: {args.name}: {sentence}", flush=True)
                return code or 1
            print(f"{args.name}: {sentence}", flush=True)
            again, told, deadline = True, False, time.monotonic() + max(args.wait, args.retry_refused)
            continue
        # refused at start only: a node that was connected said itself why it ended (flower/link.py)
        refused = code != 0 and not attempt.connected and any(m in line for line in attempt.seen
                                                              for m in REFUSED_MARKERS)
        if not refused or time.monotonic() >= deadline:
            break
        # A SuperNode stopped less than two heartbeats (60 s) ago still counts as connected: its key
        # is refused until the SuperLink notices; try again. Started again after its SuperLink forgot it:
        # the operator registers its key at the next experiment's SuperLink.
        if again and not told:
            print(f"{args.name}: the SuperLink at {args.superlink} does not let this site's key in yet; asking again "
                  f"for up to {max(args.wait, args.retry_refused):g} s while the operator registers it (`fedcontrast "
                  "flower register DIR --carried`)", flush=True)
        elif not again:
            print(f"fedcontrast: the SuperLink refused this SuperNode for now; trying again in {REFUSED_RETRY_S:g} s",
                  flush=True)
        told = True
        time.sleep(REFUSED_RETRY_S)
    if refused:
        fingerprint = key_fingerprint(public_of_private(Path(args.key)))
        raise ConfigError(f"the SuperLink at {args.superlink} refused this site's key {args.key} ({fingerprint}): the "
                          f"operator has not registered it (send {Path(args.key).with_suffix('.pub').name} to the "
                          "operator: `fedcontrast flower register`), or a SuperNode with this key is connected already")
    return code


def _add_flower(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flower", help="a real Flower deployment: SuperLink at the operator, a SuperNode per site")
    fsub = p.add_subparsers(dest="flower_command", required=True)
    w = fsub.add_parser("init", help="operator: the CA, the SuperLink's certificate and the Flower App (no data)")
    _add_run_flags(w, skip=("clients",))
    w.add_argument("--sites", required=True, help="the institutions' names, comma-separated, e.g. hosp1,hosp2,hosp3")
    _add_schema_flags(w)
    w.add_argument("--address", default="localhost", help="the SuperLink's host name or address (its certificate's)")
    w.add_argument("--port", type=int, default=9092, help="the SuperLink's port (9092)")
    w.add_argument("--round-timeout", type=float, default=1800.0, help="seconds a round may take before the run "
                                                                       "stops naming the silent sites (1800)")
    w.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds to wait for every site's SuperNode to connect (600)")
    w.add_argument("--threads", type=int, help="torch threads of the ServerApp (default: the cores it may use)")
    w.add_argument("--min-sites", type=int, help="go on without sites that stay silent (or fail) in a round when at "
                                                "least this many answered (default: every site must answer)")
    w.add_argument("--federation", metavar="NAME", help="the federation's name, which its CA carries (CN=NAME "
                                                        "fedcontrast CA; default: the folder's name)")
    w.add_argument("--pki-from", metavar="OLD_FOLDER", help="a new experiment of an existing federation: reuse the CA "
                                                            "of that operator's folder and its sites' registered keys "
                                                            "(register them with `register DIR --carried`)")
    w.add_argument("directory")
    w.set_defaults(func=cmd_init)
    w = fsub.add_parser("superlink", help="operator: start the SuperLink (TLS, only registered SuperNode keys)")
    w.add_argument("--verbose", action="store_true", help="show Flower's own INFO lines too")
    w.add_argument("directory")
    w.set_defaults(func=cmd_superlink)
    w = fsub.add_parser("register", help="operator: register a site's SuperNode public key (SuperLink running)")
    w.add_argument("directory")
    w.add_argument("public_key", nargs="?")
    w.add_argument("--site", help="the site this key belongs to")
    w.add_argument("--carried", action="store_true", help="register every site key `init --pki-from` carried over")
    w.set_defaults(func=cmd_register)
    w = fsub.add_parser("run", help="operator: run the federation (flwr run) and print its outcome")
    w.add_argument("--round-timeout", type=float, help="this run's round timeout (default: init's)")
    w.add_argument("--start-timeout", type=float, help="this run's wait for the sites' SuperNodes (default: init's)")
    w.add_argument("--min-sites", type=int, help="this run's min_sites: go on without silent sites while this many "
                                                "answer (default: init's)")
    w.add_argument("--resume", action="store_true", help="continue the run the folder holds (from its last round), or "
                                                         "re-report it when it finished")
    w.add_argument("--verbose", action="store_true", help="show Flower's own INFO lines too")
    w.add_argument("directory")
    w.set_defaults(func=cmd_run)
    w = fsub.add_parser("site-key", help="site: make its SuperNode key pair (send the .pub file to the operator)")
    w.add_argument("--name", required=True)
    w.add_argument("directory", nargs="?", default=".")
    w.set_defaults(func=cmd_site_key)
    w = fsub.add_parser("supernode", help="site: start its SuperNode on its own folder, with its own key")
    w.add_argument("--superlink", required=True, help="HOST:PORT of the operator's SuperLink")
    w.add_argument("--ca", required=True, help="the federation's CA certificate (from the operator)")
    w.add_argument("--key", required=True, help="this site's private key (fedcontrast flower site-key)")
    w.add_argument("--name", required=True, help="this site's name in the plan")
    w.add_argument("--data", required=True, help="this site's image folder (one sub-folder per class)")
    w.add_argument("--workdir", default=".", help="where its state, report and final model stay (.)")
    w.add_argument("--public", help="the public folder it holds (FLESD, FedPCL)")
    w.add_argument("--policy", help="this site's policy (site_policy.yaml), checked before any data is read")
    w.add_argument("--port", type=int, default=9094, help="the SuperNode's local port for its ClientApp (9094)")
    w.add_argument("--threads", type=int, help="torch threads this site trains with (default: the cores this "
                                               "process may use)")
    w.add_argument("--verbose", action="store_true", help="show Flower's own INFO lines too (default: its warnings "
                                                          "and errors, and fedcontrast's lines)")
    w.add_argument("--no-worker", dest="worker", action="store_false",
                   help="run each message in the ClientApp process Flower starts for it (imports and the folder "
                        "read every round), not in the site's long-lived worker (implies --isolation subprocess)")
    w.add_argument("--isolation", choices=("node", "process", "subprocess"), default="node",
                   help="node (default): the site's one long-lived process is its Flower node, with Flower's own "
                        "client (no flower-supernode, no process per message); process: Flower's SuperNode, whose "
                        "messages the site's long-lived worker takes itself (Flower's --isolation process); "
                        "subprocess: Flower's SuperNode starts a ClientApp process for every message, which asks "
                        "the worker")
    w.add_argument("--retry-refused", type=float, default=90.0, metavar="SECONDS",
                   help="how long to keep trying when the SuperLink refuses this key (a SuperNode of this key stopped "
                        "less than a minute ago still counts as connected) (90)")
    w.add_argument("--wait", type=float, default=600.0, help="seconds to keep trying to reach the SuperLink, at start "
                                                             "and whenever it stops answering or does not let this "
                                                             "site's key in after a restart (600)")
    w.set_defaults(func=cmd_supernode)


COMMANDS = {"flower": _add_flower}


def register(subparsers: argparse._SubParsersAction, names: Iterable[str] | None = None) -> None:
    for name in COMMANDS if names is None else names:
        COMMANDS[name](subparsers)
