"""The collaborator's data loader for OpenFL: :class:`fedcontrast.site.data.SiteData` under OpenFL's
``DataLoader`` interface, with the check that the plan ``fx collaborator start`` parsed gives every
component the settings this loader was given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openfl.federated.data.loader import DataLoader

from ..deploy.workspace import OPENFL_NETWORK_KEYS, load_plan_file
from ..errors import ConfigError, SiteRefusal
from ..site.data import SiteData
from .guard import fx_plan_path
from .protocol import stopped


class SiteDataLoader(SiteData, DataLoader):
    """Built by OpenFL as ``SiteDataLoader(data_path=..., run_config=..., network=..., model_shape=...)``
    (see :class:`SiteData`); ``data_path`` is None when ``fx plan initialize`` builds it."""

    def __init__(self, data_path: str | None = None, run_config: dict[str, Any] | None = None,
                 network: dict[str, Any] | None = None, model_shape: dict[str, int] | None = None,
                 **kwargs: Any) -> None:
        DataLoader.__init__(self, **kwargs)
        try:
            SiteData.__init__(self, data_path, run_config, network, model_shape, check_plan=check_running_plan)
        except SiteRefusal as exc:  # the collaborator ends with the sentence (exit 1)
            raise stopped(exc) from None

    # --- what OpenFL calls ----------------------------------------------------------------------
    def get_feature_shape(self) -> tuple[int, ...]:
        return (self.shape["in_channels"], self.shape["image_size"], self.shape["image_size"])

    def get_train_data_size(self) -> int:
        """What OpenFL sends as a "train" task's data size (an integer field): the count as this site
        releases it, rounded (post-processing of the release)."""
        if self.reported_train_size is not None:
            return max(1, round(self.reported_train_size))
        return len(self.train) if self.train is not None else 0

    def get_valid_data_size(self) -> int:
        return len(self.test) if self.test is not None else 0


def check_running_plan(run_config: Any, network: Any, model_shape: Any, argv: list[str] | None = None,
                       cwd: str | Path = ".") -> None:
    """The site's policy is checked against this loader's settings, but training, the connection and
    the aggregator read their own copies: check that the plan ``fx collaborator start`` parsed gives
    every component the same (:func:`~.plan.check_plan_consistency`), and that this loader was given
    that plan's settings. Outside ``fx collaborator start`` (a program building its own loader)
    there is no plan file to compare with."""
    path = fx_plan_path("collaborator", argv, cwd)
    if path is None:
        return
    plan = load_plan_file(path)
    settings = plan.get("data_loader", {}).get("settings") or {}
    given = {"run_config": run_config, "network": network, "model_shape": model_shape}
    differ = [key for key, value in given.items() if _resolved(value) != _resolved(settings.get(key), value)]
    if differ:
        raise ConfigError(f"this collaborator's data loader was not given the data_loader settings of {path} "
                          f"(differ: {', '.join(differ)}); start it with that plan: fx collaborator start -p {path}")


def _resolved(value: Any, running: Any = None) -> Any:
    """``value`` without what OpenFL fills in at start-up (certificate paths; ``auto`` address or port)."""
    if not isinstance(value, dict):
        return value
    out = {k: v for k, v in value.items() if k not in OPENFL_NETWORK_KEYS}
    for key in ("agg_addr", "agg_port"):
        if out.get(key) == "auto" and isinstance(running, dict) and key in running:
            out[key] = running[key]
    return out
