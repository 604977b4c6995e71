"""What a site checks against its own policy and data lines, without importing OpenFL.

``fedcontrast site start`` (and ``fedcontrast doctor``) run these checks, then ``os.execv`` replaces
the process with ``fx collaborator start``, which imports OpenFL (and through it scikit-learn, SciPy,
pandas, gRPC) anyway: importing OpenFL for the checks too cost every site those seconds twice. The
collaborator's own copies of the checks (:class:`.loader.SiteDataLoader`, :mod:`.components`) use
these same functions; :mod:`.loader` and :mod:`.components` re-export them under their old names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError, FedContrastError


class CollaboratorStopped(SystemExit):
    """Ends ``fx collaborator start`` with a message and a non-zero code."""


def enforce_site_policy(config: RunConfig, network: dict[str, Any] | None, model_shape: dict[str, int] | None,
                        data_path: str, cwd: str | Path = ".") -> Any:
    """Stop the collaborator (exit 1, one sentence) when the plan violates this site's policy file
    (``$FEDCONTRAST_SITE_POLICY`` or ``site_policy.yaml`` in the workspace); no file, no check but
    TLS and client authentication, which are required unless a policy allows them off.
    Returns the policy (None without one): it also says what this site lets leave besides its uploads."""
    from ..audit.report import audit_plan
    from ..deploy.trust import transport_problems
    from ..privacy.policy import SitePolicy, check_policy, site_policy_path

    path = site_policy_path(cwd)
    try:
        policy = SitePolicy.from_yaml(path) if path is not None else None
    except FedContrastError as exc:
        raise CollaboratorStopped("fedcontrast collaborator: error: "
                                  f"cannot check this site's policy {path}: {exc}") from None
    if policy is None:  # TLS and client authentication are required without a policy too (a policy checks them below)
        refused = transport_problems({"network": {"settings": network or {}}}, None, "the plan")
        if refused:
            raise CollaboratorStopped(f"fedcontrast collaborator: error: {'; '.join(refused)}")
        return None
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
        raise CollaboratorStopped("fedcontrast collaborator: error: "
                                  f"cannot check this site's policy {path}: {exc}") from None
    if violations:
        raise CollaboratorStopped(f"fedcontrast collaborator: error: this site's policy {path} refuses the plan "
                                  f"before any data is read: {'; '.join(violations)}")
    return policy
