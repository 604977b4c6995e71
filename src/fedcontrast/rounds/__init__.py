"""The round, once for every engine: the aggregator's side (:mod:`.server`: set-up, validation, the
upload screen, aggregation, blame, the secure branch, what is excluded and why) and a site's side
(:mod:`.site`: the task's releases and ε, and the evaluation each round starts with; :mod:`.session`:
a site's side of a run, its context and its state from round to round), and the figure a round's
records make of the sites' scores (:mod:`.records`); and the loop that joins them over an engine's
:class:`SiteTransport` (:mod:`.transport`). The simulator, the OpenFL glue and the Flower deployment
only carry messages and state to and from these."""

from .server import AggregatorRound, RoundOutcome
from .session import DiskStateStore, MemoryStateStore, SiteSession, SiteStateStore
from .site import SiteTask, evaluate_site, run_site_task
from .transport import Replies, RoundRecorder, SecureSum, SiteTransport, run_round, run_rounds

__all__ = ["AggregatorRound", "DiskStateStore", "MemoryStateStore", "Replies", "RoundOutcome", "RoundRecorder",
           "SecureSum", "SiteSession", "SiteStateStore", "SiteTask", "SiteTransport", "evaluate_site", "run_round",
           "run_rounds", "run_site_task"]
