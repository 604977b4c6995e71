"""The classes a plan names (``aggregator.template``, ``collaborator.template``,
``assigner.template``): ``fedcontrast.openfl.components.X`` in every plan ``fedcontrast workspace
create`` writes, and in the allowlist of what a site accepts (:mod:`fedcontrast.deploy.trust`).

OpenFL 1.9 hangs when an aggregation function raises or a collaborator never answers, retries an
unreachable aggregator forever and saves ``last.pbuf`` from the model that went *into* the last
round. These subclasses change only that: a failed round, a round that outlives the plan's
``round_timeout`` (unless ``min_sites`` lets it go on without the silent sites) or a site that
reports a failed task ends the federation (aggregator exit code 3, every live collaborator told to
stop with a reason); a collaborator that cannot reach the aggregator keeps trying, with back-off,
for the plan's ``wait_for_aggregator`` (an aggregator's restart fits in it), and a failing
collaborator exits with one sentence. Every round the sites evaluate what they received on their
own held-out data (the engine's ``evaluate`` task, plus one evaluation-only round at the end), and
the aggregator writes one record per round with every site's figures (``save/rounds.jsonl``).

Where each part lives: :mod:`.assigner`, :mod:`.aggregator`, :mod:`.collaborator`,
:mod:`.records` (round records), :mod:`.grpc_bounds` (the bounded gRPC server),
:mod:`.startup_checks`.
"""

from .aggregator import SafeAggregator
from .assigner import RoundAssigner
from .collaborator import SafeCollaborator

__all__ = ["RoundAssigner", "SafeAggregator", "SafeCollaborator"]
