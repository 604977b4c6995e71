"""What leaves a site: audit (against a policy), public fingerprint."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..privacy.policy import SitePolicy


def cmd_public_fingerprint(args: argparse.Namespace) -> int:
    from ..data.schema import folder_fingerprint

    print(folder_fingerprint(args.folder))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..audit.format import format_plugins, format_report, format_roster, roster_facts
    from ..audit.report import audit_plan, load_plan
    from ..config import RunConfig
    from ..privacy.policy import SitePolicy, check_policy, compared_guarantee, plugin_violation

    policy = SitePolicy.from_yaml(args.policy) if args.policy else None
    target = Path(args.target)
    flower = None
    if target.is_dir() and not (target / "plan" / "plan.yaml").is_file():  # a Flower folder: its own plan
        from ..flower.folders import audit_plan_of, folder_kind

        if folder_kind(target) is not None:
            flower = audit_plan_of(target, args.site)
    plan, workspace = (flower["plan"], flower["workspace"]) if flower is not None else load_plan(args.target)
    plugins = list(RunConfig.from_dict(plan["task_runner"]["settings"]["run_config"]).plugins)
    unlisted = plugin_violation(plugins, policy)
    if policy is not None and unlisted is not None:  # not imported here, as a site would not: nothing else audited
        return _refused_plugins(args, plugins, policy, unlisted)
    if flower is not None:
        report = audit_plan(plan, source=flower["source"], workspace=workspace, policy=policy,
                            sites=flower.get("sites"), site=flower.get("site"), cert_dir=flower["cert_dir"])
    else:
        report = audit_plan(plan, source=str(args.target), workspace=workspace, policy=policy, site=args.site)
    # At a site, its policy bounds its own ε: the others' data (and ε) are not known there.
    violations = check_policy(report, policy, sites=report.here or None) if policy else []
    compared = compared_guarantee(report, policy) if policy else None
    if args.json:
        print(json.dumps({**report.to_dict(), "policy": args.policy, "compared": compared, "violations": violations,
                          "roster": roster_facts(policy) if policy else None}, indent=2))
    else:
        print(format_report(report), end="")
        if args.policy:
            print(f"\npolicy {args.policy}: " + ("compliant" if not violations else f"{len(violations)} violation(s)")
                  + f" ({compared})")
            for v in violations:
                print(f"  VIOLATION: {v}")
            for line in format_plugins(report.plugins, policy) if policy else []:
                print(line)
            for line in format_roster(policy) if policy else []:
                print(line)
    if violations:
        print(f"fedcontrast: policy violated: {violations[0]}" + (f" (and {len(violations) - 1} more)"
                                                                  if len(violations) > 1 else ""), file=sys.stderr)
        return 1
    return 0


def _refused_plugins(args: argparse.Namespace, plugins: list[str], policy: SitePolicy, violation: str) -> int:
    """The audit of a plan that imports a plugin module ``policy`` does not list: the plugins and the
    refusal only (the rest of the audit needs the plugin, which is not imported), exit 1."""
    import json

    from ..audit.format import format_plugins

    if args.json:
        print(json.dumps({"source": str(args.target), "plugins": plugins, "policy": args.policy,
                          "violations": [violation], "audited": False}, indent=2))
    else:
        print("\n".join([f"plan: {args.target}", *format_plugins(plugins, policy), "",
                         f"policy {args.policy}: 1 violation(s) (nothing else audited: the plan's plugins are not "
                         "imported here)", f"  VIOLATION: {violation}"]))
    print(f"fedcontrast: policy violated: {violation}", file=sys.stderr)
    return 1


def _add_public(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("public", help="public data folders")
    psub2 = p.add_subparsers(dest="public_command", required=True)
    c = psub2.add_parser("fingerprint", help="SHA-256 fingerprint of a folder's files (as the plan records it)")
    c.add_argument("folder")
    c.set_defaults(func=cmd_public_fingerprint)


def _add_audit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="what leaves each site under a plan, its DP guarantee and transport; "
                                     "optionally checked against a policy (exit 1 on a violation)")
    p.add_argument("target", metavar="WORKSPACE_OR_PLAN", help="an OpenFL workspace or plan file, or a Flower folder "
                                                                "(the operator's, its run/ folder, a site's --workdir)")
    p.add_argument("--policy", help="a site policy YAML file (see policies/example-site.yaml)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--site", help="the site whose data is on this machine (default: the data.yaml line whose folder "
                                  "exists here)")
    p.set_defaults(func=cmd_audit)


# command name → the function adding its sub-parser (build_parser orders them)
COMMANDS = {
    "public": _add_public,
    "audit": _add_audit,
}


def register(subparsers: argparse._SubParsersAction, names: Iterable[str] | None = None) -> None:
    """Add this group's sub-commands to ``subparsers`` (``names``: only those, in that order)."""
    for name in COMMANDS if names is None else names:
        COMMANDS[name](subparsers)
