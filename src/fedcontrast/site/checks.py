"""What a site checks against its own policy before any of its data is read, whatever engine runs it.

Nothing here imports an engine (nor OpenFL, whose import costs a site seconds at start-up): a refusal
is a :class:`~fedcontrast.errors.SiteRefusal` in one sentence, which each engine reports its own way
(OpenFL's collaborator exits with it, a Flower site answers the operator with it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError, FedContrastError, SiteRefusal


def enforce_site_policy(config: RunConfig, network: dict[str, Any] | None, model_shape: dict[str, int] | None,
                        data_path: str, cwd: str | Path = ".", policy_path: str | Path | None = None) -> Any:
    """Raise :class:`SiteRefusal` (one sentence) when the plan violates this site's policy file
    (``policy_path`` when given, else :func:`~fedcontrast.privacy.policy.site_policy_path`: the
    ``$FEDCONTRAST_SITE_POLICY`` file or ``site_policy.yaml`` in ``cwd``); no file, no check but TLS and
    client authentication, which are required unless a policy allows them off. A plugin module of the
    plan that the policy does not list is refused before anything imports it (the audit below would).
    Returns the policy (None without one): it also says what this site lets leave besides its uploads."""
    from ..audit.report import audit_plan
    from ..deploy.trust import transport_problems
    from ..privacy.policy import SitePolicy, check_policy, plugin_violation, site_policy_path

    path = Path(policy_path) if policy_path else site_policy_path(cwd)
    try:
        policy = SitePolicy.from_yaml(path) if path is not None else None
    except FedContrastError as exc:
        raise SiteRefusal(f"cannot check this site's policy {path}: {exc}") from None
    if policy is None:  # TLS and client authentication are required without a policy too (a policy checks them below)
        refused = transport_problems({"network": {"settings": network or {}}}, None, "the plan")
        if refused:
            raise SiteRefusal("; ".join(refused))
        return None
    unlisted = plugin_violation(config.plugins, policy)  # before audit_plan, which imports the plan's plugins
    if unlisted is not None:
        raise SiteRefusal(f"this site's policy {path} refuses the plan before any data is read: {unlisted}")
    try:
        if network is None or model_shape is None:
            raise ConfigError("the plan does not give the data loader its network settings and model shape "
                              "(made by an older fedcontrast); regenerate it with `fedcontrast workspace create`")
        plan = {"task_runner": {"settings": {"run_config": config.to_dict()}}, "network": {"settings": network},
                "aggregator": {"settings": {"model_shape": model_shape, "rounds_to_train": config.rounds}}}
        samples = policy.site_samples or config.min_samples  # known to the site, else the plan's worst case
        report = audit_plan(plan, source="plan", sites=[("this site", data_path)], site_samples={"this site": samples},
                            policy=policy)
        violations = check_policy(report, policy)
    except FedContrastError as exc:
        raise SiteRefusal(f"cannot check this site's policy {path}: {exc}") from None
    if violations:
        raise SiteRefusal(f"this site's policy {path} refuses the plan before any data is read: "
                          f"{'; '.join(violations)}")
    return policy
