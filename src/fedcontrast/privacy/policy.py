"""A site's policy on what it lets leave its building, checked against a plan's audit.

A policy is a small YAML file (see ``policies/example-site.yaml``)::

    max_epsilon: 8.0          # ε at the plan's δ after all rounds, per site; no DP = ∞
    max_delta: 1.0e-5
    require_tls: true         # the default: a plan with TLS off is refused (false allows it)
    require_client_auth: true # the default: likewise for client authentication
    allow_weights: false      # may model weights leave the site (with or without DP-SGD)?
    min_class_count: 10       # fewest samples behind a shared per-class feature
    site_samples: 400         # this site's sample count, for its exact ε (else the plan's worst case)
    accept_conditional_guarantees: false  # may a guarantee "given the local model" meet max_epsilon?
    public_sample_count: false            # under DP: send the exact count (else noised once, accounted)
    share_training_metrics: false         # under DP default false; without DP default true
    share_evaluation_metrics: false       # the held-out accuracy of what the site received, likewise
    require_secure_aggregation: true      # the aggregator may see this site's uploads only inside sums …
    min_secure_sites: 3                   # … of at least this many sites
    max_hostile_reach: 20.0               # under secure aggregation: how far one hostile site may move each
                                          # value of the averaged model (the audit's figure, 2 × the clip)
    federation: hospitals-2026            # the roster the sites confirmed among themselves (`fedcontrast
    secure_threshold: 3                   # site roster`): a plan must name exactly these members, this
    peers:                                # threshold and this federation; the operator chooses none of them
      hosp1: SHA256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae
      hosp2: SHA256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
      hosp3: SHA256:fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9
    plugins: [mylab.algorithms]           # the plugin modules a plan may make this site import

Every key is optional; an absent key checks nothing, except TLS and client authentication, which a
site requires unless its policy says ``false`` (and the sharing keys take their defaults), and
``plugins``: a policy that lists none lets a plan import none. Anything at the policy's path that is
not a readable policy file is an error, never "no policy".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import MAX_DELTA, _finite, load_yaml
from ..config.run import plugin_problem
from ..config.sections import FEDERATION_ID, default_threshold, minimum_threshold
from ..errors import ConfigError

if TYPE_CHECKING:  # for annotations only: the audit imports the OpenFL site checks, which import this
    from ..audit.report import AuditReport

POLICY_ENV = "FEDCONTRAST_SITE_POLICY"
POLICY_FILE = "site_policy.yaml"  # in the workspace (the collaborator's working directory)
FINGERPRINT = re.compile(r"(?i)sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class SitePolicy:
    max_epsilon: float | None = None
    max_delta: float | None = None
    require_tls: bool = True  # TLS off is allowed only by an explicit false
    require_client_auth: bool = True
    allow_weights: bool = True
    min_class_count: int | None = None
    site_samples: int | None = None
    accept_conditional_guarantees: bool = False
    public_sample_count: bool = False
    share_training_metrics: bool | None = None  # None: shared without DP, withheld under DP
    share_evaluation_metrics: bool | None = None
    require_secure_aggregation: bool = False  # the aggregator may see this site's uploads only inside a sum
    min_secure_sites: int | None = None  # … of at least this many sites (the plan's threshold)
    # The other sites' long-term keys, as the hospitals confirmed them among themselves (site → SHA256:
    # fingerprint, `fedcontrast site roster`): secure aggregation shares nothing with a peer whose key
    # differs, and under require_secure_aggregation nothing with one left out.
    peers: dict[str, str] | None = None
    # … and, with them, the federation's name and its secure-aggregation threshold (default ⌊2n/3⌋ + 1 of
    # the n pinned members): a plan of other members, another threshold or another federation is refused.
    federation: str | None = None
    secure_threshold: int | None = None
    # The most a package this site joins may unpack (fedcontrast.archives.ArchiveLimits: max_total_bytes,
    # max_entries, max_entry_bytes, max_ratio); unset limits keep their defaults.
    package_limits: dict[str, int] | None = None
    # Under secure aggregation, how far one hostile site may move each value of the averaged model
    # (masked uploads cannot be checked; privacy/secagg_reach.py): a plan whose reach exceeds it is refused.
    max_hostile_reach: float | None = None
    # The plugin modules a plan may make this site import (its ``plugins:``), as the site installed and
    # reviewed them: a plan naming any other is refused before it is imported. None listed: none allowed.
    plugins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.package_limits is not None:  # checked now: a policy with a wrong limit is refused when read
            from ..archives import ArchiveLimits

            ArchiveLimits.from_mapping(self.package_limits, "policy package_limits")
        if self.max_epsilon is not None and not (_finite(self.max_epsilon) and self.max_epsilon > 0):
            raise ConfigError(f"policy max_epsilon must be a number > 0, got {self.max_epsilon!r}")
        if self.max_delta is not None and not (_finite(self.max_delta) and 0 < self.max_delta < 1):
            raise ConfigError(f"policy max_delta must be in (0, 1) (a plan's δ is at most {MAX_DELTA:g}), "
                              f"got {self.max_delta!r}")
        if self.max_hostile_reach is not None and not (_finite(self.max_hostile_reach) and self.max_hostile_reach > 0):
            raise ConfigError(f"policy max_hostile_reach must be a number > 0, got {self.max_hostile_reach!r}")
        for name in ("require_tls", "require_client_auth", "allow_weights", "accept_conditional_guarantees",
                     "public_sample_count", "require_secure_aggregation"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"policy {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("share_training_metrics", "share_evaluation_metrics"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"policy {name} must be true or false, got {getattr(self, name)!r}")
        for name in ("min_class_count", "site_samples", "min_secure_sites"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(f"policy {name} must be an integer >= 1, got {value!r}")
        if self.peers is not None:
            if not isinstance(self.peers, dict) or not all(isinstance(k, str) for k in self.peers):
                raise ConfigError("policy peers must map each site's name to its key's fingerprint (SHA256:…), "
                                  f"got {self.peers!r}")
            for site, value in self.peers.items():
                if not (isinstance(value, str) and FINGERPRINT.fullmatch(value.strip())):
                    raise ConfigError(f"policy peers: {site}'s fingerprint must be SHA256: and 64 hex digits (as "
                                      f"`fedcontrast site roster` prints it), got {value!r}")
            object.__setattr__(self, "peers", {k: v.strip().lower().replace("sha256:", "SHA256:")
                                               for k, v in self.peers.items()})
            holders: dict[str, str] = {}
            for site, value in sorted(self.peers.items()):
                other = holders.setdefault(value, site)
                if other != site:
                    raise ConfigError(f"policy peers: sites {other} and {site} are pinned to the same key {value}: one "
                                      "party could speak for both sites; each site needs a key of its own "
                                      "(`fedcontrast site roster` refuses such a roster)")
        if self.federation is not None and not (isinstance(self.federation, str)
                                                and FEDERATION_ID.fullmatch(self.federation)):
            raise ConfigError("policy federation must be the federation's name as the sites agreed it (letters, "
                              f"digits, '.', '_' and '-', at most 100), got {self.federation!r}")
        if self.secure_threshold is not None:
            n, t = len(self.peers or {}), self.secure_threshold
            low = max(2, minimum_threshold(n))
            if not (isinstance(t, int) and not isinstance(t, bool) and low <= t <= (n or t)):
                where = f"from {low} (a majority) to {n}, for the {n} members under peers:" if n else ">= 2"
                raise ConfigError(f"policy secure_threshold must be an integer {where}, got {t!r}")
        plugins = () if self.plugins is None else self.plugins  # `plugins:` with nothing after it: none
        if not (isinstance(plugins, (list, tuple)) and all(isinstance(p, str) for p in plugins)):
            raise ConfigError(f"policy plugins must be a list of plugin module names, got {self.plugins!r}")
        for plugin in plugins:
            problem = plugin_problem(plugin)
            if problem is not None:
                raise ConfigError(f"policy plugins: {problem}")
        object.__setattr__(self, "plugins", tuple(plugins))

    @property
    def agreed_threshold(self) -> int | None:
        """The secure-aggregation threshold the sites agreed: ``secure_threshold``, else the default
        for the pinned members; None without pins."""
        if self.secure_threshold is not None:
            return self.secure_threshold
        return default_threshold(len(self.peers)) if self.peers else None

    @classmethod
    def from_yaml(cls, path: str | Path) -> SitePolicy:
        data = load_yaml(path, "site policy")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"policy {path} has unknown setting(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        return cls(**data)


def roster_digest(federation: str | None, threshold: int, peers: dict[str, str]) -> str:
    """One fingerprint of a roster (the federation's name, its threshold, each member and its key's
    fingerprint), which the hospitals read to each other instead of every member's: SHA-256 of their
    canonical JSON."""
    text = json.dumps({"federation": federation, "threshold": threshold,
                       "members": [[site, peers[site].lower().replace("sha256:", "SHA256:")]
                                   for site in sorted(peers)]},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "SHA256:" + hashlib.sha256(text.encode()).hexdigest()


def agreed_roster(policy: SitePolicy | None) -> tuple[list[str] | None, int | None]:
    """The members and threshold a site's policy pins for secure aggregation (None, None: it pins
    none, or does not require secure aggregation), for the protocol's own check (PinnedKeys)."""
    if policy is None or not policy.require_secure_aggregation or not policy.peers:
        return None, None
    return sorted(policy.peers), policy.agreed_threshold


def check_policy(report: AuditReport, policy: SitePolicy, *, sites: list[str] | None = None) -> list[str]:
    """Every violation of ``policy`` by the audited plan, one sentence each (empty: compliant).
    ``sites`` restricts the ε check to those sites (a collaborator checks only itself)."""
    violations = []
    if policy.require_tls and not report.tls:
        violations.append("TLS is off (network.settings.use_tls: false) but the policy requires TLS")
    if policy.require_client_auth and not report.client_auth:
        violations.append("client authentication is off (network.settings.require_client_auth: false) but the "
                          "policy requires it")
    if not policy.allow_weights and report.weights_leave:
        names = report.weights_leave
        violations.append(f"model weights leave the site ({len(names)} tensors, e.g. {names[0]}) but the policy "
                          "forbids weights leaving")
    if policy.max_delta is not None and report.delta is not None and report.delta > policy.max_delta:
        violations.append(f"privacy.delta {report.delta:g} is above the policy's max_delta {policy.max_delta:g}")
    if policy.max_epsilon is not None:
        for site in report.sites:
            if sites is not None and site.name not in sites:
                continue
            if report.guarantee_kind == "conditional" and not policy.accept_conditional_guarantees \
                    and not math.isinf(site.epsilon_total):
                violations.append(f"ε = {site.epsilon_total:.3g} for {site.name} is a conditional guarantee (given the "
                                  f"local model, which trains without DP): it bounds nothing end to end, so it cannot "
                                  f"meet the policy's max_epsilon {policy.max_epsilon:g} (set "
                                  "accept_conditional_guarantees: true to accept it)")
            elif math.isinf(site.epsilon_total):
                unprotected = sorted({t.name for t in report.tensors if t.mechanism == "none"})
                what = f"{unprotected[0]} leaves without differential privacy" if unprotected else "no DP"
                violations.append(f"ε is unbounded for {site.name} ({what}) but the policy's max_epsilon is "
                                  f"{policy.max_epsilon:g}")
            elif site.epsilon_total > policy.max_epsilon:
                violations.append(f"ε = {site.epsilon_total:.3g} at δ = {report.delta:g} after {report.rounds} rounds "
                                  f"for {site.name} is over the policy's max_epsilon {policy.max_epsilon:g}")
    if policy.require_secure_aggregation or policy.min_secure_sites is not None:
        wanted = policy.min_secure_sites or 2
        if report.secure_sum_sites is None:
            violations.append("the plan has no secure aggregation: the aggregator would see this site's uploads one by "
                              "one, but the policy requires secure aggregation")
        elif report.secure_sum_sites < wanted:
            violations.append(f"the plan's secure aggregation unmasks sums of {report.secure_sum_sites} sites, fewer "
                              f"than the policy's min_secure_sites {wanted}")
    if policy.require_secure_aggregation and report.secure_sum_sites is not None:
        unpinned = [s for s in report.plan_sites if s not in (policy.peers or {})]
        if unpinned:
            violations.append(f"the policy requires secure aggregation but pins no key for {', '.join(unpinned)} "
                              "(peers:, every member of the federation): without keys confirmed among the hospitals, "
                              "an operator that lies could put its own keys in their place; confirm each fingerprint "
                              "(`fedcontrast site roster`) and list it under peers:")
        pinned = set(policy.peers or {})
        missing, extra = sorted(pinned - set(report.plan_sites)), sorted(set(report.plan_sites) - pinned)
        if pinned and (missing or extra):
            named = "; ".join(([f"it leaves out {', '.join(missing)}"] if missing else [])
                              + ([f"it names {', '.join(extra)}, not pinned"] if extra else []))
            violations.append(f"the plan's secure sum is not the federation the sites pinned under peers: "
                              f"({', '.join(sorted(pinned))}): {named}; the operator does not choose who is in a sum "
                              "(a member absent from a round is handled by the protocol's dropout path, never by "
                              "leaving it out of the plan)")
        agreed = policy.agreed_threshold
        if agreed is not None and report.secure_threshold is not None and report.secure_threshold != agreed:
            how = "the policy's secure_threshold" if policy.secure_threshold is not None else \
                f"the default ⌊2n/3⌋ + 1 for the {len(pinned)} members the policy pins"
            violations.append(f"the plan's secure-aggregation threshold is {report.secure_threshold} but the sites "
                              f"agreed on {agreed} ({how}): the operator does not choose the threshold")
        if policy.federation is not None and report.federation != policy.federation:
            named = f"is for federation {report.federation}" if report.federation else "names no federation"
            violations.append(f"the plan {named} (secure_aggregation.federation) but this site's policy pins "
                              f"federation {policy.federation}: a plan made for another federation is refused (the "
                              f"operator's plan of this one carries --secagg federation={policy.federation})")
    if policy.max_hostile_reach is not None and report.secure_reach is not None \
            and report.secure_reach > policy.max_hostile_reach:
        violations.append(hostile_reach_violation(report.secure_reach, report.secure_reach_setting,
                                                  policy.max_hostile_reach))
    refused = plugin_violation(report.plugins, policy)
    if refused is not None:
        violations.append(refused)
    violations += list(report.foreign_code)  # whatever else it says, a plan that runs code no one installed
    for line in report.code:
        if line.mismatch:
            violations.append(f"requirements.txt pins {line.distribution}=={line.pinned} but this machine runs "
                              f"{line.installed or 'none'}")
    for cert in report.certificates or []:
        if cert.days_left < 0:
            violations.append(f"certificate {cert.path} ({cert.subject}) expired on {cert.not_after}")
    if policy.min_class_count is not None and report.class_minimum is not None \
            and report.class_minimum < policy.min_class_count:
        violations.append(f"{report.algorithm} shares per-class features of classes with as few as "
                          f"{report.class_minimum} samples but the policy requires at least {policy.min_class_count} "
                          f"(set {report.algorithm}.min_class_samples)")
    return violations


def plugin_violation(plugins: Iterable[str], policy: SitePolicy | None) -> str | None:
    """The sentence refusing a plan whose ``plugins`` (the modules every party imports) name one that
    ``policy`` does not list under ``plugins:``; None when it lists them all, or without a policy (a site
    without one accepts the plan, as it accepts every setting but TLS and client authentication).
    Checked before a site imports any of them: the plan comes from the operator."""
    if policy is None:
        return None
    unlisted = [p for p in plugins if p not in policy.plugins]
    if not unlisted:
        return None
    many = len(unlisted) > 1
    return (f"the plan makes this site import the plugin module{'s' if many else ''} {', '.join(unlisted)}, which "
            f"its policy does not list under plugins: (add plugins: [{', '.join([*policy.plugins, *unlisted])}] to the "
            f"policy once this site has reviewed and installed {'them' if many else 'it'})")


def hostile_reach_violation(reach: float, setting: str | None, bound: float) -> str:
    """The sentence refusing a plan whose hostile reach on the averaged model (``setting``: the plan
    setting that lowers it, twice its value; None: none does) is over the policy's ``bound``."""
    if setting is None:
        fix = ("the plugin's averages lie within that range whatever the settings, so no setting lowers it: raise "
               "max_hostile_reach or turn secure aggregation off (the aggregator then screens each upload)")
    elif bound / 2 >= 1:
        fix = f"lower {setting} to at most {bound / 2:g} (the reach is twice it)"
    else:
        fix = (f"the reach is twice {setting}, which a plan cannot set below 1, so no plan meets it: raise "
               "max_hostile_reach or turn secure aggregation off (the aggregator then screens each upload)")
    return (f"one hostile site could move each value of the averaged model by up to {reach:g} under this plan's "
            f"secure aggregation (its masked uploads cannot be checked), more than the policy's max_hostile_reach "
            f"{bound:g}: {fix}")


def compared_guarantee(report: AuditReport, policy: SitePolicy) -> str:
    """Which guarantee the policy's max_epsilon was compared with, for the verdict."""
    if policy.max_epsilon is None:
        return "no ε bound in the policy"
    kind = {"end-to-end": "the end-to-end (sample-level) ε", "site-level": "the site-level ε (sample-level follows)",
            "none": "no guarantee (ε unbounded)"}.get(report.guarantee_kind)
    if kind is None:  # conditional
        kind = ("the conditional ε (given the local model), accepted by accept_conditional_guarantees"
                if policy.accept_conditional_guarantees else "the conditional ε (given the local model), treated as "
                                                             "unbounded")
    return f"max_epsilon {policy.max_epsilon:g} against {kind}"


def site_policy_path(cwd: str | Path = ".") -> Path | None:
    """The collaborator's policy file: ``$FEDCONTRAST_SITE_POLICY``, else ``site_policy.yaml`` in the
    working directory (the site's workspace) if present; None when the site has none."""
    env = os.environ.get(POLICY_ENV)
    if env:
        return Path(env)  # named explicitly: a missing file is an error, not "no policy"
    path = Path(cwd) / POLICY_FILE
    # anything there (a directory, a dangling link, an unreadable file) is read, and refused, as the policy
    return path if os.path.lexists(path) else None
