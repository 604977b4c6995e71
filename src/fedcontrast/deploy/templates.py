"""The components a site accepts in a plan: exactly those ``fedcontrast workspace create`` writes,
and those an installed plugin declares under the entry-point group ``fedcontrast.openfl_templates``
(``data_loader = "pkg.module:Class"``). See :mod:`fedcontrast.deploy.trust` for why."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

TEMPLATE_ENTRY_POINT_GROUP = "fedcontrast.openfl_templates"
# Each plan section (a dotted path; ``*`` one task name) and the one class a fedcontrast plan builds there.
BUILT_IN_TEMPLATES: dict[str, str] = {
    "aggregator": "fedcontrast.openfl.components.SafeAggregator",
    "collaborator": "fedcontrast.openfl.components.SafeCollaborator",
    "data_loader": "fedcontrast.openfl.loader.SiteDataLoader",
    "task_runner": "fedcontrast.openfl.runner.PluginTaskRunner",
    "assigner": "fedcontrast.openfl.components.RoundAssigner",
    "compression_pipeline": "openfl.pipelines.NoCompressionPipeline",
    "tasks.*.aggregation_type": "fedcontrast.openfl.aggregation.PluginAggregation",
}

# --- the plan's components ------------------------------------------------------------------------
def plan_templates(plan: Any) -> list[tuple[str, Any]]:
    """Every ``template`` in a plan, with the dotted path of the section that holds it."""
    found: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "template":
                    found.append((path, value))
                else:
                    walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(plan, "")
    return found


def allowed_templates() -> dict[str, set[str]]:
    """Section pattern → the templates a site accepts there: fedcontrast's own, plus those declared
    by installed plugins under :data:`TEMPLATE_ENTRY_POINT_GROUP`."""
    from importlib.metadata import entry_points

    allowed = {section: {template} for section, template in BUILT_IN_TEMPLATES.items()}
    for ep in entry_points(group=TEMPLATE_ENTRY_POINT_GROUP):
        allowed.setdefault(ep.name, set()).add(ep.value.replace(":", "."))
    return allowed


def _section_pattern(path: str, patterns: Iterable[str]) -> str | None:
    for pattern in patterns:
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.\[\]]+"), path):
            return pattern
    return None


def template_problems(plan: Any, source: str) -> list[str]:
    """One sentence per component of ``plan`` that is not code this site installed (empty: all are)."""
    if not isinstance(plan, dict):
        return [f"{source} is not a plan (a mapping of sections)"]
    problems = []
    for section, value in plan.items():
        if isinstance(value, dict) and "defaults" in value:
            problems.append(f"{source}'s {section} section reads its defaults from another file "
                            f"({value['defaults']!r}); a fedcontrast plan is complete in itself")
    allowed = allowed_templates()
    for path, template in plan_templates(plan):
        pattern = _section_pattern(path, allowed)
        if pattern is None:
            problems.append(f"{source} builds a component at {path} ({template!r}), where fedcontrast's plans have "
                            "none")
        elif template not in allowed[pattern]:
            expected = " or ".join(sorted(allowed[pattern]))
            problems.append(f"{source}'s {path}.template names {template!r}, which is not the installed "
                            f"fedcontrast's component ({expected}) nor one declared by an installed plugin")
    return problems
