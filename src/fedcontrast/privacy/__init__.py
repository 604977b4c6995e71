"""Differential privacy around the plugins: DP-SGD (Opacus), the Gaussian mechanism on uploaded
representations, accounting through Opacus's accountants, the audit and the site policy.

Plugins never import this package; engines hand its objects to them (``SiteContext.privacy``).
"""

from .accounting import PlannedEpsilon, epsilon, planned_epsilon, round_history
from .representations import GaussianClassSums, clip_rows, gaussian_public_representations
from .site import HISTORY_KEY, SitePrivacy, history_of

__all__ = ["HISTORY_KEY", "GaussianClassSums", "PlannedEpsilon", "SitePrivacy", "clip_rows", "epsilon",
           "gaussian_public_representations", "history_of", "planned_epsilon", "round_history"]
