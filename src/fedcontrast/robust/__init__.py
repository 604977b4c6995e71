"""What an aggregator accepts from a site, and robust ways to combine model weights.

Cross-silo sites hold valid certificates, so a site that misbehaves — by bug or by intent — is
authenticated and its upload arrives. The round core every engine carries
(:class:`fedcontrast.rounds.AggregatorRound`: the simulator, OpenFL and Flower) passes every round's
uploads through one :class:`UploadScreen` before the plugin aggregates them, configured by the plan's
``robustness`` section (:class:`~fedcontrast.config.RobustnessConfig`):

* the aggregation weight (a site's sample count) must be finite, ≥ 0 and within the plan's
  ``max_samples`` (one cap, or each site's count declared at enrolment; plus the noise allowance
  when counts are released noised under DP);
* the plugin's checks of meaning (:meth:`~fedcontrast.algorithms.Algorithm.check_upload`: prototype
  norms, counts, Gram matrices…);
* for model weights, the update ``w_k − w`` (``w`` the global model the site received) must not be
  larger than ``max_update_ratio · ‖w‖`` (L2 over every floating-point model tensor);
* an upload identical to one the same site sent in an earlier round is a replay, and so is a stale
  one: near an earlier upload of the site while the global model moved (``min_progress``,
  :mod:`.replay`) — a free-rider resending old work, altered.

Across the sites of a round (at least three), when the plan sets them: an update whose norm exceeds
``max_update_spread`` × the median norm of the other sites' updates (:func:`update_spreads`), and an
update whose direction disagrees with the others' — cosine to the coordinate-wise median of their
update directions below ``min_update_cosine`` (:func:`update_cosines`) — are rejected.

An upload that fails is rejected alone, with the sender, the bound, the measured value and the reason
named; the others are aggregated. Optionally each update is clipped to ``clip_update_norm`` first, and
model weights are combined by a robust rule (coordinate-wise median or trimmed mean,
:func:`robust_average`) in every weight-sharing plugin
(:meth:`~fedcontrast.algorithms.Algorithm.average_weights`). When the combined downlink is not finite,
the site whose upload caused it is found and named (:meth:`UploadScreen.aggregate`): a site is never
blamed for the global model's fault.

Blame. An update inside every bound can still wreck the global model (a hostile site's update at the
bound, pointing away), after which the honest sites' correcting updates are the ones that exceed it.
So each round the screen notes which upload moved the global model (:func:`abnormal_move`): the one
with the largest contribution ``p_k⟨Δ_k, M⟩/‖M‖²`` to the move ``M``, and the move is *abnormal* when
that upload's norm is at least :data:`ABNORMAL_SPREAD` × the median norm of the other uploads (honest
digits sites measured within 2.6×: 2, 3 and 5 sites, seeds 0–2). A rejection in the next
:data:`BLAME_WINDOW` rounds that the global model may explain (an update over ``max_update_ratio``, a
non-finite upload) then names that site as the likely cause, and so does the stop message when every
upload is non-finite; older abnormal moves are stated as history (:meth:`UploadScreen.earlier_moves`).
"""

from .blame import ABNORMAL_SPREAD, BLAME_WINDOW, Move, abnormal_move, all_rejected_hint
from .replay import upload_digest
from .rules import coordinate_median, robust_average, trimmed_count, trimmed_mean
from .screen import COUNT_NOISE_ALLOWANCE, RejectedUpload, UploadScreen, logger
from .updates import clip_update, update_cosines, update_norm, update_spreads

__all__ = ["ABNORMAL_SPREAD", "BLAME_WINDOW", "COUNT_NOISE_ALLOWANCE", "Move", "RejectedUpload", "UploadScreen",
           "abnormal_move", "all_rejected_hint", "clip_update", "coordinate_median", "logger", "robust_average",
           "trimmed_count", "trimmed_mean", "update_cosines", "update_norm", "update_spreads", "upload_digest"]
