"""Everything that leaves a site besides its declared upload tensors, and what a site lets leave.

Every round a collaborator also reports numbers computed from its private data: its aggregation
weight (its exact sample count), the metrics of its tasks (training loss, accuracy, contrastive
terms …), its evaluation of what it received (held-out accuracy and the held-out split's size, and
the same on its validation part),
and under DP its ε so far. Under add/remove adjacency an exact count breaks any sample-level
guarantee, and a metric computed on private data is a release like any other.

So, under DP (the plan has a ``privacy`` section):

* the sample count is released **noised** once, ``n + N(0, σ_n²)`` (``privacy.count_noise_multiplier``;
  sensitivity 1), accounted, and reused every round — unless the site's policy declares it public
  (``public_sample_count: true``: then it leaves exact and outside the accountant, by the site's choice);
* training and evaluation metrics are **withheld** unless the site's policy opts in
  (``share_training_metrics`` / ``share_evaluation_metrics: true``: then they leave, and the audit says
  the guarantee does not cover them); the site still sees them in its own log;
* ε itself leaves when it is a function of what may leave anyway: without DP-SGD (ε then depends
  on the plan alone), or when the count is public; with DP-SGD it depends on the exact count through
  the sample rate q = 1/⌈n/B⌉ and is withheld.

Without DP nothing is covered anyway: everything is sent unless the site's policy says ``false``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReleaseChoices:
    exact_count: bool  # the sample count leaves exact (no DP, or public by the site's policy)
    training_metrics: bool  # the tasks' metrics leave
    evaluation_metrics: bool  # the site's evaluation of what it received leaves
    epsilon_metrics: bool  # dp_epsilon / dp_epsilon_round leave


def release_choices(privacy: Any, policy: Any = None) -> ReleaseChoices:
    """What leaves a site under the plan's ``privacy`` section (None: no DP) and the site's policy
    (a :class:`~fedcontrast.privacy.policy.SitePolicy`, or None: the defaults)."""
    dp = privacy is not None

    def share(flag: bool | None) -> bool:
        return flag if flag is not None else not dp  # without DP: shared; under DP: withheld

    exact = not dp or bool(policy is not None and policy.public_sample_count)
    return ReleaseChoices(
        exact_count=exact,
        training_metrics=share(policy.share_training_metrics if policy is not None else None),
        evaluation_metrics=share(policy.share_evaluation_metrics if policy is not None else None),
        epsilon_metrics=dp and (exact or privacy.dp_sgd is None))


def evaluation_metric_names(algorithm: Any, config: Any) -> tuple[str, ...]:
    """Every number a site's evaluation of what it received may send: the plugin's evaluation metrics
    and the held-out split's size, and, where the plan holds out a validation part
    (``validation_fraction`` > 0), the same metrics on it (``val_``) and its size."""
    names = (*algorithm.evaluation_metrics, "samples")
    if config.validation_fraction > 0:
        names += (*(f"val_{m}" for m in algorithm.evaluation_metrics), "val_samples")
    return names


@dataclass(frozen=True)
class ReleaseLine:
    """One thing that leaves a site every round (or once), for the audit."""

    name: str
    source: str  # what it is computed from
    bytes_per_round: int
    guarantee: str  # covered | conditional | not covered | withheld | public (site policy)
    note: str = ""
    seen: str = "individually"  # how the aggregator sees it: individually, or only inside sums (secure aggregation)


METRIC_BYTES = 4  # one float32 scalar per OpenFL metric (plus its name and framing)


def describe_releases(config: Any, algorithm: Any, tensors: list, choices: ReleaseChoices,
                      conditional: bool, *, secure_sites: int | None = None,
                      weight_in_sum: bool = True) -> list[ReleaseLine]:
    """The audit's list of releases: every upload tensor (``tensors``: the audit's tensor lines) and
    every other number a site sends under ``choices``. ``conditional``: the DP guarantee on the
    tensors holds only given the local model (FedPCL's personal head trains without DP).
    ``secure_sites``: under secure aggregation, the fewest sites in a sum — the uploads (and the
    aggregation weight, when ``weight_in_sum``: the plugin's terms carry it) are seen only inside sums."""
    dp = config.privacy is not None
    summed = f"only inside sums of >= {secure_sites} sites" if secure_sites is not None else "individually"
    lines = []
    for t in tensors:
        source = ("the training data, through local training" if t.kind == "weights" else
                  "the training data's labels" if t.kind == "count" else "the training data, through the model")
        guarantee = "not covered" if t.mechanism == "none" else "conditional" if conditional else "covered"
        lines.append(ReleaseLine(t.name, source, t.bytes_per_round, guarantee, t.mechanism, summed))
    if not dp:
        count = ReleaseLine("aggregation weight", "the number of training samples (exact)", METRIC_BYTES,
                            "not covered", "no DP in the plan")
    elif choices.exact_count:
        count = ReleaseLine("aggregation weight", "the number of training samples (exact)", METRIC_BYTES,
                            "public (site policy)", "the site's policy declares its sample count public")
    else:
        count = ReleaseLine("aggregation weight", "the number of training samples, noised once", METRIC_BYTES,
                            "covered", f"n + N(0, σ²), σ = {config.privacy.count_noise_multiplier:g}, released in "
                                       "the first round and reused (accounted once)")
    if secure_sites is not None:  # not sent on its own: inside the sum, or not at all
        count = dataclasses.replace(count, seen=summed if weight_in_sum else "not sent (the secure sum does not use "
                                                                             "it)")
    lines.append(count)
    for task in algorithm.tasks:
        names = algorithm.task_metrics.get(task, ())
        if names:
            lines.append(_metric_line(f"{task} metrics ({', '.join(names)})", "the training data", len(names),
                                      choices.training_metrics, dp, "share_training_metrics"))
    names = evaluation_metric_names(algorithm, config)
    held = "the site's held-out data" + (" and its validation part" if config.validation_fraction > 0 else "")
    lines.append(_metric_line(f"evaluate metrics ({', '.join(names)})", held, len(names),
                              choices.evaluation_metrics, dp, "share_evaluation_metrics"))
    if dp:
        if not choices.epsilon_metrics:
            lines.append(ReleaseLine("dp_epsilon, dp_epsilon_round", "the plan and the exact sample count", 0,
                                     "withheld", "with DP-SGD, ε depends on the exact count (q = 1/⌈n/B⌉)"))
        else:
            source = "the plan" if config.privacy.dp_sgd is None else "the plan and the sample count"
            lines.append(ReleaseLine("dp_epsilon, dp_epsilon_round", source, 2 * METRIC_BYTES,
                                     "public (site policy)" if config.privacy.dp_sgd is not None else "covered",
                                     "a function of the plan (and of the count the site made public)"))
    return lines


def _metric_line(name: str, source: str, count: int, shared: bool, dp: bool, setting: str) -> ReleaseLine:
    if not shared:
        return ReleaseLine(name, source, 0, "withheld", f"kept on the site ({setting}: true to share)")
    note = "no DP in the plan" if not dp else f"shared by the site's choice ({setting}: true)"
    return ReleaseLine(name, source, count * METRIC_BYTES, "not covered", note)


WEIGHT_METRIC = "fedcontrast_aggregation_weight"  # OpenFL's metric carrying n_k: never a withheld one


def withheld_metrics(sent: dict[str, dict[str, list[str]]],
                     declared: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Which site withheld which metric, from what each site sent with its results (``{task: {site:
    metric names}}``) and the metrics each task declares (``declared``, OpenFL names such as
    ``evaluate_accuracy``): a site that sent a task's results withheld every metric of that task that
    another site sent, and, when it sent none of the task's declared metrics, those too (its policy
    keeps them, the default under DP). ``{site: sorted names}``; a site that withheld nothing is absent."""
    out: dict[str, set[str]] = {}
    for task, by_site in sent.items():
        anyone = set().union(*map(set, by_site.values())) if by_site else set()
        names = set(declared.get(task, ()))
        for site, sent_names in by_site.items():
            own = set(sent_names)
            expected = anyone | (names if not own & names else set())
            missing = expected - own - {WEIGHT_METRIC}
            if missing:
                out.setdefault(site, set()).update(missing)
    return {site: sorted(names) for site, names in sorted(out.items())}


def metric_kind(name: str) -> str:
    """What a site's metric is about, for a sentence: ``evaluation`` (``evaluate_*``), ``ε``
    (``*_dp_epsilon*``) or ``training``."""
    from ..config.run import EVALUATE_TASK

    if name.startswith(EVALUATE_TASK + "_"):
        return "evaluation"
    return "ε" if "dp_epsilon" in name else "training"


def describe_withheld(withheld: dict[str, list[str]]) -> str:
    """One clause per group of sites that withheld the same kinds of metrics, e.g. ``site_1
    withheld its evaluation and training metrics``; empty when no site withheld any."""
    groups: dict[tuple[str, ...], list[str]] = {}
    order = ("evaluation", "training", "ε")
    for site, names in sorted(withheld.items()):
        kinds = tuple(k for k in order if any(metric_kind(n) == k for n in names))
        if kinds:
            groups.setdefault(kinds, []).append(site)
    clauses = []
    for kinds, sites in groups.items():
        what = " and ".join(kinds) if len(kinds) < 3 else f"{kinds[0]}, {kinds[1]} and {kinds[2]}"
        clauses.append(f"{', '.join(sites)} withheld {'its' if len(sites) == 1 else 'their'} {what} metrics")
    return "; ".join(clauses)
