"""The round, once for every engine: the aggregator's side (:mod:`.server`: set-up, validation, the
upload screen, aggregation, blame, the secure branch, what is excluded and why) and a site's side
(:mod:`.site`: the task's releases and ε, and the evaluation each round starts with). The simulator,
the OpenFL glue and the Flower deployment only carry messages and state to and from these."""

from .server import AggregatorRound, RoundOutcome
from .site import SiteTask, evaluate_site, run_site_task

__all__ = ["AggregatorRound", "RoundOutcome", "SiteTask", "evaluate_site", "run_site_task"]
