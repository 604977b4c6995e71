"""The registry of data sets: every name ``dataset:`` takes, with one line about each (what
``--help`` lists), and the settings of the data sets that have some (``dataset_settings:``).

Light on purpose (no numpy, no torch): the command line reads it to print its help.

A data set in :data:`PARTITIONED` comes split among its sites already (its generator gives every
site samples of its own); it takes ``partition: natural``, the only partition that applies to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .checks import _check, _finite, _typed_section

# name → one line; the order is the order --help and the docs list them in
DATASETS: dict[str, str] = {
    "digits": "scikit-learn's bundled 8×8 digits (1,294 training images by default), the default",
    "synthetic": "seeded class-conditional images, for tests",
    "fedprox_synthetic": "FedProx's Synthetic(α, β) (Li et al., MLSys 2020): a generator with its own sites, "
                         "as many as --clients (partition natural; --dataset-setting alpha=…, beta=…)",
    "cifar10": "torchvision's CIFAR-10 files in --data-root",
    "cifar100": "torchvision's CIFAR-100 files in --data-root",
    "mnist": "MNIST's four IDX files (gzipped or not) in --data-root",
    "fashion_mnist": "Zalando's Fashion-MNIST (70,000 28×28 images, 10 classes) from Debian's package with no flag "
                     "(apt-get install dataset-fashion-mnist), or its four IDX files in --data-root",
    "svhn": "torchvision's SVHN files in --data-root",
    "imagefolder": "--data-root with one folder per class (optionally train/ and test/)",
}
DATASET_NAMES: tuple[str, ...] = tuple(DATASETS)

NATURAL = "natural"  # the partition of a data set that comes split among its sites


@dataclass(frozen=True)
class FedProxSyntheticSettings:
    """Synthetic(α, β) of FedProx (docs/usage.md, "A data set that grows with the sites").

    ``alpha`` and ``beta`` are the standard deviations of u_k (the mean of site k's model) and of
    B_k (the mean of its features' means). ``features`` (d, 60 in the paper) are laid out row-major
    in a one-channel square image, the rest of it zero; ``classes`` (10). Site k holds
    ``min_site_samples + ⌊exp(Z)⌋`` samples, Z ~ N(``lognormal_mean``, ``lognormal_sigma``²), at most
    ``max_site_samples`` (None: no cap). α changes the sites' models but not their data (the module
    :mod:`fedcontrast.data.fedprox_synthetic` says why); β is what skews the sites' labels.
    """

    alpha: float = 1.0
    beta: float = 1.0
    features: int = 60
    classes: int = 10
    lognormal_mean: float = 4.0
    lognormal_sigma: float = 2.0
    min_site_samples: int = 50
    max_site_samples: int | None = None

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "lognormal_sigma"):
            value = getattr(self, name)
            _check(_finite(value) and 0 <= value <= 100, f"fedprox_synthetic {name} must be a number from 0 to 100, "
                                                         f"got {value!r}")
        _check(_finite(self.lognormal_mean) and -10 <= self.lognormal_mean <= 12,
               f"fedprox_synthetic lognormal_mean must be a number from -10 to 12, got {self.lognormal_mean!r}")
        _check(_is_int(self.features) and 1 <= self.features <= 4096,
               f"fedprox_synthetic features must be an integer from 1 to 4096, got {self.features!r}")
        _check(_is_int(self.classes) and 2 <= self.classes <= 1000,
               f"fedprox_synthetic classes must be an integer from 2 to 1000, got {self.classes!r}")
        # 3: one test sample, one training sample, and one to spare for the public split
        _check(_is_int(self.min_site_samples) and 3 <= self.min_site_samples <= 10**6,
               f"fedprox_synthetic min_site_samples must be an integer from 3 to 1000000, got "
               f"{self.min_site_samples!r}")
        _check(self.max_site_samples is None or (_is_int(self.max_site_samples) and
                                                 self.min_site_samples <= self.max_site_samples <= 10**7),
               f"fedprox_synthetic max_site_samples must be an integer from min_site_samples "
               f"({self.min_site_samples}) to 10000000, or left out, got {self.max_site_samples!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FileSetSettings:
    """Settings of the benchmark sets read from files (``mnist``, ``fashion_mnist``). ``train_samples``: a
    stratified sample of this many images of the official training split (seeded by ``split_seed``),
    to fit a run to a budget; None (the default): all of them. The official test split stays whole."""

    train_samples: int | None = None

    def __post_init__(self) -> None:
        _check(self.train_samples is None or (_is_int(self.train_samples) and 10 <= self.train_samples <= 10**7),
               f"train_samples must be an integer from 10 to 10000000, or left out for the whole training split, "
               f"got {self.train_samples!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# data set → the class of its settings (a data set not listed takes none)
SETTINGS: dict[str, type] = {"fedprox_synthetic": FedProxSyntheticSettings, "mnist": FileSetSettings,
                             "fashion_mnist": FileSetSettings}
PARTITIONED: frozenset[str] = frozenset({"fedprox_synthetic"})


def dataset_key(name: Any) -> Any:
    """The canonical spelling of a data set's name (lower case, ``-`` as ``_``); anything else as given."""
    return name.strip().lower().replace("-", "_") if isinstance(name, str) else name


def dataset_settings(name: str, settings: dict[str, Any] | None) -> Any:
    """The settings of data set ``name`` as its settings class (defaults where left out); None for a
    data set that takes none, where any setting given is refused in one sentence."""
    key = dataset_key(name)
    cls = SETTINGS.get(key)
    if cls is None:
        _check(not settings, f"dataset_settings apply to {', '.join(sorted(SETTINGS))}, not {name}: "
                             f"remove {', '.join(sorted(settings or {}))}")
        return None
    return _typed_section(cls, dict(settings or {}), f"{key} dataset")
