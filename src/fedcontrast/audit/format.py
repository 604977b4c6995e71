"""The audit as the privacy officer reads it: :func:`format_report` of an :class:`~.audit.AuditReport`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .report import AuditReport

if TYPE_CHECKING:
    from ..privacy.policy import SitePolicy


def _eps(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.4g}"


def format_report(report: AuditReport) -> str:
    lines = [f"plan: {report.source}",
             f"algorithm: {report.algorithm}; collaborator tasks per round: {', '.join(report.tasks)}; "
             f"rounds: {report.rounds}",
             "", "tensors that leave each site every round (uploaded with the round's last task):",
             f"  {'name':44s} {'shape':>14s} {'dtype':8s} {'bytes':>9s} {'what':15s} DP mechanism"]
    for t in report.tensors:
        lines.append(f"  {t.name:44s} {str(tuple(t.shape)):>14s} {t.dtype:8s} {t.bytes_per_round:>9d} "
                     f"{'raw weights' if t.kind == 'weights' else t.kind:15s} {t.mechanism}")
    total = sum(t.bytes_per_round for t in report.tensors)
    lines.append(f"  total {total} bytes per site per round")
    lines += ["", "everything that leaves each site (what it is computed from, bytes per round, guarantee; "
                  "how the aggregator sees it):"]
    width = max(len(r.name) for r in report.releases)
    source_width = max(len(r.source) for r in report.releases)
    for r in report.releases:
        lines.append(f"  {r.name:{width}s}  {r.source:{source_width}s} {r.bytes_per_round:>9d}  {r.guarantee}"
                     + (f" — {r.note}" if r.note and r.guarantee not in ("covered", "conditional") else "")
                     + f"  [aggregator: {r.seen}]")
    lines += ["", "differential privacy:"] + [f"  {m}" for m in report.mechanisms]
    if report.delta is not None:
        lines.append(f"  accountant: {report.accountant} (Opacus), δ = {report.delta:g}")
        lines.append(f"  secure noise: {report.secure_noise}")
    lines.append(f"  guarantee: {report.guarantee}")
    if report.class_minimum is not None:
        lines.append(f"  per-class features are shared for classes with ≥ {report.class_minimum} (released) samples")
    lines += ["", f"  {'site':12s} {'data':28s} {'samples':>8s} {'ε/round':>9s} {'ε total':>9s}"]
    for s in report.sites:
        lines.append(f"  {s.name:12s} {s.data:28s} {s.samples if s.samples is not None else '?':>8} "
                     f"{_eps(s.epsilon_round):>9s} {_eps(s.epsilon_total):>9s}"
                     + ("" if s.samples_note.startswith(("shard", "given", "counted")) else f"  ({s.samples_note})"))
    for s in report.sites:
        if s.classes is None:
            continue
        present = [f"{c} {n}" for c, n in s.classes.items() if n]
        absent = [c for c, n in s.classes.items() if not n]
        lines.append(f"  {s.name}, counted from its data on this machine: {s.samples} training samples"
                     + (f", {s.held_out} held out" if s.held_out is not None else "")
                     + f"; {len(present)} of {len(s.classes)} classes present ({', '.join(present)})"
                     + (f"; absent: {', '.join(absent)}" if absent else ""))
        if s.classes_under_minimum is not None:
            under = [f"{c} ({s.classes[c]})" for c in s.classes_under_minimum]
            lines.append(f"    classes under min_class_samples ({report.class_minimum}), never shared: "
                         + (", ".join(under) if under else "none"))
    if not report.here and any(s.samples is None for s in report.sites):
        lines.append("  sample counts not known here: each site's data is on its own machine (run the audit there)")
    if report.code:
        lines += ["", "code every party runs (pinned in the workspace's requirements.txt; installed on this machine):"]
        for c in report.code:
            pinned = f"=={c.pinned}" if c.pinned else " (not pinned)"
            here = c.installed or "not installed"
            lines.append(f"  {c.distribution + pinned:24s} here {here:12s} {c.role}"
                         + ("  MISMATCH" if c.mismatch else ""))
        if report.foreign_code:
            lines += [f"  NOT INSTALLED CODE: {problem}" for problem in report.foreign_code]
        else:
            lines.append("  the plan builds only installed components (no code travels in a package): fedcontrast's "
                         "aggregator, collaborator, data loader, task runner, assigner, aggregation")
        if report.plugins:
            lines.append(f"  plugin modules every party imports before it builds the algorithm (plugins:, installed "
                         f"on each host): {', '.join(report.plugins)}")
    lines += ["", ("aggregation: secure — the aggregator sees the uploads above only inside sums of at least "
                   f"{report.secure_sum_sites} sites (pairwise and self masks; Shamir t = {report.secure_sum_sites})"
                   if report.secure_sum_sites is not None else
                   "aggregation: plain — the aggregator sees each site's uploads above one by one")]
    if report.federation is not None:
        lines.append(f"  federation: {report.federation} (secure_aggregation.federation)")
    if report.secure_terms:
        lines.append("  what each site masks into the sum, computed from its uploads (the aggregator unmasks only "
                     "the sum over the round's sites):")
        for t in report.secure_terms:
            lines.append(f"    {t.name:40s} {str(tuple(t.shape)):>14s} {t.dtype:6s} {t.bytes_per_round:>9d} "
                         f"{'weights' if t.kind == 'weights' else t.kind:15s} {t.mechanism}")
    lines += [f"  {line}" for line in report.secure_ring]
    lines += ["", f"transport: TLS {'on' if report.tls else 'OFF'}, client authentication "
                  f"{'on' if report.client_auth else 'OFF'}"]
    if report.certificates is None:
        lines.append("certificates: no certificates found")
    else:
        lines.append("certificates:")
        for c in report.certificates:
            state = "EXPIRED" if c.days_left < 0 else f"{c.days_left} days left"
            lines.append(f"  {c.path:40s} {c.subject:40s} expires {c.not_after} ({state})")
    return "\n".join(lines) + "\n"


def format_plugins(plugins: list[str], policy: SitePolicy) -> list[str]:
    """The plan's plugin modules and whether ``policy`` allows a site to import them; empty when the
    plan names none."""
    if not plugins:
        return []
    unlisted = [p for p in plugins if p not in policy.plugins]
    listed = f"the policy's plugins: {', '.join(policy.plugins) or '(none)'}"
    verdict = (f"allowed ({listed})" if not unlisted else
               f"NOT ALLOWED: {', '.join(unlisted)} not listed ({listed}); a site refuses the plan before importing it")
    return [f"plugins the plan imports: {', '.join(plugins)}: {verdict}"]


def roster_facts(policy: SitePolicy) -> dict[str, Any] | None:
    """The roster a site's policy pins: federation, threshold, members and their digest (None: no peers)."""
    from ..privacy.policy import roster_digest

    if not policy.peers or policy.agreed_threshold is None:
        return None
    return {"federation": policy.federation, "threshold": policy.agreed_threshold, "members": sorted(policy.peers),
            "digest": roster_digest(policy.federation, policy.agreed_threshold, policy.peers)}


def format_roster(policy: SitePolicy) -> list[str]:
    """The roster a site's policy pins and what a plan may change; empty when it pins no peers."""
    roster = roster_facts(policy)
    if roster is None:
        return []
    default = "" if policy.secure_threshold is not None else " (the default ⌊2n/3⌋ + 1)"
    enforced = ("the policy requires secure aggregation, so" if policy.require_secure_aggregation else
                "with require_secure_aggregation: true (not set),")
    return [f"roster the sites agreed: federation {roster['federation'] or '(none pinned)'}; threshold "
            f"{roster['threshold']} of {len(roster['members'])}{default}; members {', '.join(roster['members'])}",
            f"  roster digest: {roster['digest']} (as `fedcontrast site roster` prints it for the hospitals to read "
            "to each other)",
            f"  {enforced} a plan may change the training settings, rounds, DP, the clip, bits, max_samples and "
            "neighbours, but not the members, the threshold or the federation: only the sites change those, with a "
            "new roster"]
