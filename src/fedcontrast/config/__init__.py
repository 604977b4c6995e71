"""The typed run configuration shared by the simulator (and, later, the OpenFL plans).

Every field is validated in ``__post_init__`` with :class:`ConfigError`; ``RunConfig.from_dict``
rejects unknown keys by name, so a typo in a YAML file is an error rather than a silent default.

The configuration lives in four modules: :mod:`.checks` (how a setting is checked, shared bounds),
:mod:`.sections` (training, privacy, data schema, public data, robustness), :mod:`.secure_aggregation`
(its section and thresholds, re-exported by :mod:`.sections`) and :mod:`.run` (:class:`RunConfig`);
every name is importable from here.
"""

from .checks import (
    MAX_CLIP,
    MAX_DELTA,
    MAX_IMAGE_SIZE,
    MAX_NOISE_MULTIPLIER,
    MAX_PROJECTION_DIM,
    MIN_NOISE_MULTIPLIER,
    _finite,
)
from .run import SITE_NAME, RunConfig, load_yaml, site_names
from .sections import (
    ACCOUNTANTS,
    AUGMENTATIONS,
    MIN_ROBUST_SITES,
    ON_REJECTED,
    ROBUST_RULES,
    SHA256_HEX,
    DataSchema,
    DPSGDConfig,
    ExecutorConfig,
    PrivacyConfig,
    PublicDataConfig,
    RepresentationDPConfig,
    RobustnessConfig,
    SecureAggregationConfig,
    TrainingConfig,
)

__all__ = ["ACCOUNTANTS", "AUGMENTATIONS", "MAX_CLIP", "MAX_DELTA", "MAX_IMAGE_SIZE", "MAX_NOISE_MULTIPLIER",
           "MAX_PROJECTION_DIM", "MIN_NOISE_MULTIPLIER", "MIN_ROBUST_SITES", "ON_REJECTED", "ROBUST_RULES",
           "SHA256_HEX", "SITE_NAME", "DPSGDConfig", "DataSchema", "ExecutorConfig", "PrivacyConfig",
           "PublicDataConfig", "RepresentationDPConfig", "RobustnessConfig", "RunConfig", "SecureAggregationConfig",
           "TrainingConfig", "_finite", "load_yaml", "site_names"]
