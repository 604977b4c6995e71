"""The round, once for every engine: the aggregator's side (:mod:`.server`: set-up, validation, the
upload screen, aggregation, blame, the secure branch, what is excluded and why) and a site's side
(:mod:`.site`: the task's context, its releases and ε). The simulator, the OpenFL glue and the Flower
deployment only carry messages and state to and from these."""

from .server import AggregatorRound, RoundOutcome
from .site import SiteTask, run_site_task

__all__ = ["AggregatorRound", "RoundOutcome", "SiteTask", "run_site_task"]
