"""Certificates and sites: ca init/sign/revoke, site join/import-cert/start/roster."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def cmd_ca_init(args: argparse.Namespace) -> int:
    from ..openfl.operator_flows import init_ca

    chain = init_ca(args.workspace, fqdn=args.fqdn, federation=args.federation)
    print(f"certificate authority in {Path(args.workspace) / 'cert' / 'ca'} (its private keys never leave this "
          f"machine) and the aggregator's certificate in {Path(args.workspace) / 'cert' / 'server'}; CA chain {chain}")
    print_ca_fingerprint(chain)
    return 0


def print_ca_fingerprint(chain: Path) -> None:
    """The federation's CA fingerprint, for the operator to read to every institution (they pin it at join)."""
    from ..deploy.anchor import fingerprint_of_chain, shown
    from ..yamlio import read_bytes

    found, subject = fingerprint_of_chain(read_bytes(chain, "the CA chain"), str(chain))
    print(f"the federation's CA ({subject}): {shown(found)} — read this fingerprint to every institution by phone "
          f"or another channel; each joins with --ca-fingerprint {shown(found)}")


def _ca_arguments(c: argparse.ArgumentParser, command: str) -> None:
    c.add_argument("--ca-fingerprint", metavar="SHA256:HEX",
                   help="the federation's CA fingerprint, as the operator read it to you (`fedcontrast ca init` prints "
                        "it): the CA is pinned, and any other refused; without it you are asked to confirm it")
    c.add_argument("--yes", action="store_true", help="pin the CA the package brings without asking (compare its "
                                                      f"fingerprint yourself: {command} prints it)")


def confirm_ca(args: argparse.Namespace) -> Any:
    """The question ``site join`` / ``import-cert`` ask about the federation's CA (None with --ca-fingerprint)."""
    from ..deploy.anchor import shown

    if args.ca_fingerprint:
        return None

    def confirm(subject: str, fingerprint: str) -> bool:
        print(f"the federation's CA: {subject}, {shown(fingerprint)}")
        if args.yes:
            return True
        try:
            answer = input("Is this the CA fingerprint the operator read out to you (by phone or another channel)? "
                           "[y/N] ")
        except EOFError:  # no terminal to ask on
            raise ConfigError("no one to confirm the federation's CA fingerprint (no terminal): compare it with the "
                              "operator's, then pass --ca-fingerprint SHA256:…") from None
        return answer.strip().lower() in ("y", "yes")

    return confirm


def cmd_ca_sign(args: argparse.Namespace) -> int:
    from ..openfl.operator_flows import sign_request

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
    from ..openfl.operator_flows import revoke_site

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
    from ..openfl.institution_flows import join, package_plan

    joined = join(args.package, name=args.name, data=args.data, public=args.public, into=args.into,
                  cert_from=args.cert_from, policy=args.policy, ca_fingerprint=args.ca_fingerprint,
                  confirm_ca=confirm_ca(args))
    s = joined.summary
    present = {c: n for c, n in s.counts.items() if n}
    print(f"workspace {joined.workspace}: {args.name} reads {s.folder} ({s.total} images; training images per "
          "class: " + ", ".join(f"{c}={n}" for c, n in present.items())
          + (f"; absent: {', '.join(s.missing_classes())}" if s.missing_classes() else "")
          + ("; test/ folder held out" if s.split_folders else "; a stratified test split is held out")
          + f"; formats: {s.formats_text()})")
    network = (package_plan(Path(args.package).resolve()).get("network") or {}).get("settings") or {}
    tls = ("TLS and client authentication on"
           if network.get("use_tls", True) and network.get("require_client_auth", True)
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
    from ..openfl.institution_flows import import_certificate

    ws = Path(args.workspace)
    name = import_certificate(ws, args.signed, ca_fingerprint=args.ca_fingerprint, confirm_ca=confirm_ca(args))
    print(f"{name}'s certificate is installed and checked (it fits this site's key and the federation's CA)")
    print(f"ready: fedcontrast site start {ws} --name {name}")
    return 0


FX_START_OPTIONS = {"plan": ("-p", "--plan"), "data_config": ("-d", "--data_config")}


def _fx_option(extra: list[str], option: str) -> str | None:
    """The value ``fx collaborator start`` would take for ``option`` ("plan" or "data_config") from
    the extra arguments; None when they do not give it."""
    from ..openfl.guard import fx_option

    return fx_option(extra, FX_START_OPTIONS[option])


def site_data_names(path: Path) -> list[str]:
    """The site names of a ``NAME,PATH`` data file, read as OpenFL reads it (blank lines and lines
    starting with ``#`` skipped, the name up to the first comma)."""
    from ..deploy.workspace import read_data_lines

    return list(read_data_lines(path))


def site_start_command(workspace: str | Path, name: str, *, plan: str | None = None, data_config: str | None = None,
                       extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The pre-flight of ``fedcontrast site start``: what ``fx collaborator start -n NAME`` would stop
    on later (or with a traceback), each refused with one sentence; the ``fx`` command line to run
    in ``workspace`` when every check passes."""
    from ..deploy.trust import check_policy_for_workspace, check_workspace
    from ..deploy.workspace import load_plan_file
    from ..openfl.fx import collaborator_names, fx_executable

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
    from ..openfl.doctor import FAIL, run_checks

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


def cmd_site_roster(args: argparse.Namespace) -> int:
    from ..site.roster import format_roster, read_roster

    print(format_roster(read_roster(args.paths, args.name), args.federation, args.threshold))
    return 0


def cmd_site_start(args: argparse.Namespace) -> int:
    import os

    ws = Path(args.workspace)
    argv = site_start_command(ws, args.name, plan=args.plan, data_config=args.data_config, extra=args.fx_args)
    print(f"fedcontrast site start: {args.name}'s workspace {ws} passed the checks; running "
          f"{' '.join(['fx', *argv[1:]])} in it", file=sys.stderr)
    if args.threads is not None:  # the collaborator applies and prints it (fedcontrast.threads; default: its cores)
        from ..threads import SHARED_ENV, Threads, check_threads, party_env, usable_cores

        os.environ.pop(SHARED_ENV, None)
        os.environ.update(party_env(Threads(check_threads(args.threads) or 1, usable_cores(), given=True)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(ws)
    os.execv(argv[0], argv)  # fx takes this process over: its id, signals and exit code are fx's
    return 0  # not reached (os.execv returns only when replaced in tests)


def _add_ca(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ca", help="the federation's certificate authority (operator)")
    csub = p.add_subparsers(dest="ca_command", required=True)
    c = csub.add_parser("init", help="make the CA and the aggregator's certificate in a workspace")
    c.add_argument("workspace")
    c.add_argument("--fqdn", help="the aggregator's host name (default: the plan's agg_addr)")
    c.add_argument("--federation", metavar="NAME", help="the federation's name, which its CA carries (CN=NAME "
                                                        "fedcontrast CA; default: the workspace folder's name)")
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


def _add_site(sub: argparse._SubParsersAction) -> None:
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
    _ca_arguments(c, "join")
    c.set_defaults(func=cmd_site_join)
    c = ssub.add_parser("import-cert", help="install the certificate the operator signed")
    c.add_argument("signed", metavar="SIGNED.zip")
    c.add_argument("--workspace", default=".", help="this site's workspace (default: here)")
    _ca_arguments(c, "import-cert")
    c.set_defaults(func=cmd_site_import_cert)
    c = ssub.add_parser("start", help="check this site's workspace (its data.yaml line, cols.yaml, certificate), then "
                                      "run fx collaborator start -n NAME in it (arguments after -- go to fx)",
                        usage="fedcontrast site start [WORKSPACE] --name NAME [-p PLAN] [-d DATA_CONFIG] [--threads N] "
                              "[-- FX_ARGS]")
    c.add_argument("workspace", nargs="?", default=".", help="this site's workspace (default: here)")
    c.add_argument("--name", required=True, help="this site's name in the plan")
    c.add_argument("-p", "--plan", help="the plan, relative to the workspace (fx's default: plan/plan.yaml)")
    c.add_argument("-d", "--data_config", "--data-config", dest="data_config",
                   help="the data file, relative to the workspace (fx's default: plan/data.yaml)")
    c.add_argument("--threads", type=int, help="torch threads this site trains with (default: the cores this "
                                               "process may use)")
    c.set_defaults(func=cmd_site_start, fx_args=[])  # and any further fx arguments after --
    c = ssub.add_parser("roster", help="the key fingerprint of each member of the federation, the federation's name "
                                       "and threshold, and one digest of them, to confirm with the other hospitals "
                                       "and pin in this site's policy (peers:) for secure aggregation")
    c.add_argument("paths", nargs="+", metavar="PATH",
                   help="an OpenFL workspace, a Flower operator folder or key folder, a certificate or key file")
    c.add_argument("--name", help="the site a lone key file belongs to (default: its file name)")
    c.add_argument("--federation", metavar="ID", help="the federation's name, as the hospitals agree it (default: "
                                                      "one derived from the members' keys, printed)")
    c.add_argument("--threshold", metavar="T", type=int, help="the secure-aggregation threshold the hospitals agree "
                                                              "(at least a majority of the members; default "
                                                              "⌊2n/3⌋ + 1)")
    c.set_defaults(func=cmd_site_roster)


# command name → the function adding its sub-parser (build_parser orders them)
COMMANDS = {
    "ca": _add_ca,
    "site": _add_site,
}


def register(subparsers: argparse._SubParsersAction, names: Iterable[str] | None = None) -> None:
    """Add this group's sub-commands to ``subparsers`` (``names``: only those, in that order)."""
    for name in COMMANDS if names is None else names:
        COMMANDS[name](subparsers)
