"""A site's task, engine-free: what every engine's site did in its own copy before — run the plugin's
task in its context, release the sample count as the plan's privacy says (noised once under DP, unless
the site's policy publishes it exactly), keep the metrics that the plan and the site's policy let leave,
and read ε so far; and the evaluation every round starts with (:func:`evaluate_site`). The engine builds
the context (its data, model, device, state and DP noise source) and carries the uploads and released
numbers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algorithms import Algorithm, SiteContext, TaskResult
from ..config import RunConfig
from ..site.report import SiteReport, measure_held_out, snapshot, write_final_model

logger = logging.getLogger(__name__)


@dataclass
class SiteTask:
    """One task of a site's round: the plugin's ``result`` (uploads, the true count, every metric: the
    site's own report), the count as released (``weight``), the metrics that may leave the site
    (``released``) and ε so far (``epsilon``, empty without DP)."""

    task: str
    result: TaskResult
    weight: float
    released: dict[str, float] = field(default_factory=dict)
    epsilon: dict[str, float] = field(default_factory=dict)

    @property
    def uploads(self) -> dict[str, torch.Tensor]:
        return self.result.uploads

    @property
    def bytes_sent(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.result.uploads.values())


def run_site_task(algorithm: Algorithm, site: SiteContext, task: str, received: dict[str, torch.Tensor],
                  releases: Any) -> SiteTask:
    """``task`` of ``algorithm`` at ``site`` on what it ``received``; ``releases``: what the plan and
    the site's policy let leave (:func:`fedcontrast.privacy.releases.release_choices`)."""
    result = algorithm.run_task(task, site, received)
    weight = float(result.weight)
    if site.privacy is not None and not releases.exact_count:
        weight = float(site.privacy.released_count(result.weight))  # drawn once, recorded, reused every round
    epsilon = site.privacy.metrics() if site.privacy is not None else {}
    released = {k: float(v) for k, v in result.metrics.items()
                if releases.training_metrics and k in algorithm.task_metrics.get(task, ())}
    if releases.epsilon_metrics:
        released.update(epsilon)
    return SiteTask(task, result, weight, released, epsilon)


def evaluate_site(algorithm: Algorithm, site: SiteContext, received: dict[str, torch.Tensor], test: Any,
                  report: SiteReport, *, config: RunConfig, shape: dict[str, int],
                  sent_bytes: Callable[[dict[str, float]], int] | None = None,
                  validation: Any = None) -> dict[str, float]:
    """What ``site`` received at the start of round ``site.round_num`` — the model after the round
    before; the final model when ``site.round_num`` is ``rounds + 1``, the evaluation after the last
    round — scored on its held-out split ``test``: its report's row of that model, now complete (and,
    for the final model, the model and what loads it in its report folder); ``sent_bytes``: what the
    engine sends of the measurement; ``validation``: the site's validation part, scored the same way
    (``val_accuracy`` …). Returns what it measured."""
    after = site.round_num - 1
    final = snapshot(site.model, received) if after >= config.rounds else None  # before the plugin loads others
    measured = measure_held_out(algorithm, site, received, test, validation)  # and the validation part's
    report.evaluated(after, measured, len(test), sent_bytes(measured) if sent_bytes is not None else 0)
    if final is not None:
        write_final_model(report.folder, site=site, config=config, shape=shape, model=final, received=received,
                          metrics=measured)
    report.finish(after)  # its one line: the row of this model (the accuracy, what it received and sent)
    return measured
