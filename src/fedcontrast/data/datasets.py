"""In-memory data sets and :func:`load_dataset`, the single entry point that builds the splits.

Every source (scikit-learn digits, synthetic images, torchvision benchmarks read from local files,
an image folder) is read once, split, turned into float tensors and normalised, so training only
ever indexes tensors. Nothing is ever downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config.datasets import DATASET_NAMES, PARTITIONED, dataset_key, dataset_settings
from ..errors import ConfigError, DataError, UnknownNameError
from .builtin import load_digits_raw, make_synthetic_raw
from .idx import IDX_NAMES, load_idx_raw
from .imagefolder import has_split_folders, load_imagefolder_raw
from .raw import RawData
from .splits import channel_stats, normalise_, stratified_holdout, to_float_images
from .torchvision_sets import TORCHVISION_NAMES, load_torchvision_raw

_NATIVE_SIZE = {"cifar10": 32, "cifar100": 32, "svhn": 32, "mnist": 28, "fashion_mnist": 28}
_DEFAULT_SIZE = {"digits": 32, "synthetic": 16, "imagefolder": 32, "fedprox_synthetic": 16}


# eq=False: the generated __eq__ would compare tensors element-wise and fail on ``bool(...)``.
@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A small data set held in memory as tensors; batches are taken by indexing.

    ``x`` is ``(N, C, H, W)`` float32, already normalised; ``y`` is ``(N,)`` int64 class indices in
    ``[0, num_classes)``.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.dim() != 4:
            raise DataError(f"images must be a 4-D (N, C, H, W) tensor, got shape {tuple(self.x.shape)}.")
        if self.y.dim() != 1 or self.y.shape[0] != self.x.shape[0]:
            raise DataError(
                f"labels must be a 1-D tensor with one entry per image ({self.x.shape[0]}), "
                f"got shape {tuple(self.y.shape)}."
            )
        if self.y.dtype != torch.int64:
            raise DataError(f"labels must be int64 class indices, got {self.y.dtype}.")
        if self.num_classes < 1:
            raise DataError(f"num_classes must be at least 1, got {self.num_classes}.")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray | torch.Tensor | list[int]) -> ArrayDataset:
        """The samples at ``indices`` (a copy), in the given order, with the same ``num_classes``."""
        index = torch.as_tensor(np.asarray(indices), dtype=torch.int64, device=self.x.device)
        return ArrayDataset(self.x[index], self.y[index], self.num_classes)

    def to(self, device: torch.device | str) -> ArrayDataset:
        """The same samples on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if self.x.device == device and self.y.device == device:
            return self
        return ArrayDataset(self.x.to(device), self.y.to(device), self.num_classes)

    @property
    def in_channels(self) -> int:
        return int(self.x.shape[1])

    @property
    def image_size(self) -> int:
        """The image height (images are square)."""
        return int(self.x.shape[2])


@dataclass(frozen=True, eq=False)
class DataSplits:
    """The splits of one data set.

    ``train`` is what gets partitioned among clients; ``public`` is held out of the training data for
    methods that need shared unlabelled/proxy data, ``None`` when ``public_fraction == 0``.
    ``class_names`` gives the label names in label order. A data set with sites of its own (a
    generator's) gives each site's indices into ``train`` (``site_train``) and into ``test`` (its
    held-out samples, ``site_test``); None for the others, which a partition splits.
    """

    train: ArrayDataset
    test: ArrayDataset
    public: ArrayDataset | None
    name: str
    class_names: tuple[str, ...] = ()
    site_train: tuple[np.ndarray, ...] | None = None
    site_test: tuple[np.ndarray, ...] | None = None

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def in_channels(self) -> int:
        return self.train.in_channels

    @property
    def image_size(self) -> int:
        return self.train.image_size


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_fraction(label: str, value: float, *, allow_zero: bool) -> None:
    in_range = _is_real(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0) and value < 1
    if not in_range:
        raise ConfigError(f"{label} must be in {'[0, 1)' if allow_zero else '(0, 1)'}, got {value!r}.")


def _check_int(label: str, value: int, minimum: int, unit: str = "") -> None:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"{label} must be an integer of at least {minimum}{unit}, got {value!r}.")


def _check_settings(
    name: str, image_size: int | None, test_fraction: float, public_fraction: float, split_seed: int,
    synthetic_samples: int, synthetic_classes: int, synthetic_noise: float,
) -> str:
    """Validate the arguments of :func:`load_dataset`; returns the canonical data set name."""
    key = dataset_key(name)
    if key not in DATASET_NAMES:
        raise UnknownNameError(f"unknown data set {name!r}; known data sets: {', '.join(DATASET_NAMES)}.")
    if image_size is not None:
        _check_int("image_size", image_size, 8, " pixels")
    _check_fraction("test_fraction", test_fraction, allow_zero=False)
    _check_fraction("public_fraction", public_fraction, allow_zero=True)
    _check_int("split_seed", split_seed, 0)
    if key == "synthetic":
        _check_int("synthetic_classes", synthetic_classes, 2)
        # Four per class leave every class a sample in each of train, test and public.
        _check_int("synthetic_samples", synthetic_samples, 4 * synthetic_classes, " (4 per class)")
        if not _is_real(synthetic_noise) or not math.isfinite(synthetic_noise) or synthetic_noise < 0:
            raise ConfigError(f"synthetic_noise must be a finite number >= 0, got {synthetic_noise!r}.")
    return key


def _read_raw(
    key: str, root: str | None, size: int, samples: int, classes: int, noise: float, seed: int,
    class_names: tuple[str, ...] | None = None, channels: int | None = None,
    window: tuple[float, float] | None = None,
) -> RawData:
    if key == "digits":
        return load_digits_raw()
    if key == "synthetic":
        return make_synthetic_raw(samples=samples, classes=classes, noise=noise, image_size=size, seed=seed)
    if key == "imagefolder":
        return load_imagefolder_raw(root, size, class_names=class_names, channels=channels, window=window)
    if key in IDX_NAMES:
        return load_idx_raw(key, root)
    if key in TORCHVISION_NAMES:
        return load_torchvision_raw(key, root)
    raise UnknownNameError(f"unknown data set {key!r}; known data sets: {', '.join(DATASET_NAMES)}.")


def load_dataset(
    name: str,
    *,
    root: str | None = None,
    image_size: int | None = None,
    test_fraction: float = 0.2,
    public_fraction: float = 0.1,
    split_seed: int = 0,
    synthetic_samples: int = 1000,
    synthetic_classes: int = 10,
    synthetic_noise: float = 0.5,
    class_names: tuple[str, ...] | None = None,
    channels: int | None = None,
    normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    window: tuple[float, float] | None = None,
    sites: int | None = None,
    settings: dict | None = None,
) -> DataSplits:
    """Read data set ``name`` and return its train, test and public splits as normalised tensors.

    Sources (see :data:`DATASET_NAMES`): ``digits`` (scikit-learn's bundled 8×8 digits, upsampled to
    32×32 by default), ``synthetic`` (seeded class-conditional 16×16 images; ``split_seed`` also
    seeds the images), the torchvision benchmarks ``cifar10``, ``cifar100`` and ``svhn`` read from
    local files in ``root``, ``mnist`` and ``fashion_mnist`` from their IDX files in ``root`` or, for
    Fashion-MNIST with no ``root``, where Debian's package puts them (:mod:`.idx`; native size by default), and
    ``imagefolder`` (``root/<class>/`` images, 32×32 by default). ``image_size`` resizes bilinearly.

    Splits: sources with an official test split (the torchvision sets, an image folder with
    ``train/`` and ``test/``) keep it, and ``test_fraction`` is unused; the others get a stratified
    test split of ``test_fraction`` of all samples. Then ``public_fraction`` of the remaining
    training split is held out, stratified, as the public split. Both hold-outs are seeded by
    ``split_seed`` and every class keeps at least one training sample.

    Normalisation: per-channel mean and std are computed on the final training split (after the
    public split was removed, i.e. exactly the data clients train on) and applied to train, public
    and test alike; ``normalization=(mean, std)`` fixes them instead (a plan's data schema).

    ``class_names`` and ``channels`` (``imagefolder`` only) come from a plan's data schema: labels
    follow ``class_names`` (a folder may lack classes; unknown class folders are refused) and images
    must have ``channels`` channels.

    ``fedprox_synthetic`` (:mod:`.fedprox_synthetic`) generates ``sites`` sites of its own, seeded by
    ``split_seed`` and set by ``settings`` (its :class:`~fedcontrast.config.datasets.FedProxSyntheticSettings`);
    each site holds out ``test_fraction`` of its samples for testing and ``public_fraction`` of the
    rest for the public split. ``settings`` of any other data set are refused.

    Raises :class:`UnknownNameError` for an unknown name, :class:`ConfigError` for settings out of
    range, and :class:`DataError` for missing or unusable files or too few samples to split.
    """
    key = _check_settings(
        name, image_size, test_fraction, public_fraction, split_seed,
        synthetic_samples, synthetic_classes, synthetic_noise,
    )
    has_official_test = (key in TORCHVISION_NAMES or key in IDX_NAMES
                         or (key == "imagefolder" and has_split_folders(root)))
    if not has_official_test and test_fraction + public_fraction >= 1:
        raise ConfigError(
            f"test_fraction + public_fraction must be below 1 so that training data remain, got "
            f"{test_fraction} + {public_fraction}."
        )
    size = image_size if image_size is not None else _DEFAULT_SIZE.get(key, _NATIVE_SIZE.get(key, 32))
    rng = np.random.default_rng(split_seed)
    if (class_names is not None or channels is not None) and key != "imagefolder":
        raise ConfigError(f"class_names and channels describe image folders, not {key}.")
    typed = dataset_settings(key, settings)
    own_sites: tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None = None
    if key in PARTITIONED:
        from .fedprox_synthetic import make_fedprox_synthetic

        if sites is None or not _is_int(sites) or sites < 1:
            raise ConfigError(f"{key} generates the federation's sites: give their number (sites), got {sites!r}.")
        made = make_fedprox_synthetic(typed, sites=sites, seed=split_seed, test_fraction=test_fraction,
                                      public_fraction=public_fraction)
        (train_x, train_y), test, public = made.train, made.test, made.public
        own_sites, names = (made.site_train, made.site_test), made.class_names
    else:
        raw = _read_raw(key, root, size, synthetic_samples, synthetic_classes, synthetic_noise, split_seed,
                        class_names, channels, window)
        if getattr(typed, "train_samples", None):  # a stratified sample of the training split, to fit a budget
            raw = _sample_train(raw, key, typed.train_samples, rng)
        (train_x, train_y), test, public = _split(raw, key, test_fraction, public_fraction, rng)
        names = tuple(raw.class_names)

    num_classes = len(names)
    _check_labels(key, num_classes, train_y, test[1])
    train_t = to_float_images(train_x, size)
    if normalization is not None:
        mean, std = (torch.tensor(v, dtype=torch.float32, device="cpu").view(1, -1, 1, 1) for v in normalization)
    else:
        mean, std = channel_stats(train_t)

    def build(x: np.ndarray, y: np.ndarray, ready: torch.Tensor | None = None) -> ArrayDataset:
        images = ready if ready is not None else to_float_images(x, size)
        labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
        return ArrayDataset(normalise_(images, mean, std), labels, num_classes)

    return DataSplits(
        train=build(train_x, train_y, train_t),
        test=build(*test),
        public=build(*public) if public is not None else None,
        name=key,
        class_names=names,
        site_train=own_sites[0] if own_sites else None,
        site_test=own_sites[1] if own_sites else None,
    )


_Pair = tuple[np.ndarray, np.ndarray]


def _sample_train(raw: RawData, key: str, samples: int, rng: np.random.Generator) -> RawData:
    """``samples`` images of ``raw``'s training split, stratified by class, in their original order."""
    total = len(raw.train_y)
    if samples > total:
        raise ConfigError(f"train_samples {samples} exceeds the {total} training images of {key}")
    _, chosen = stratified_holdout(raw.train_y, samples / total, rng)
    return RawData(raw.train_x[chosen], raw.train_y[chosen], raw.test_x, raw.test_y, raw.class_names)


def _split(
    raw: RawData, key: str, test_fraction: float, public_fraction: float, rng: np.random.Generator
) -> tuple[_Pair, _Pair, _Pair | None]:
    """(train, test, public-or-None) image/label pairs: official or held-out test, then public."""
    if raw.test_x is not None and raw.test_y is not None:
        train_x, train_y, test_x, test_y = raw.train_x, raw.train_y, raw.test_x, raw.test_y
    else:
        kept, held = stratified_holdout(raw.train_y, test_fraction, rng)
        if held.size == 0:
            raise DataError(
                f"{key} has too few samples ({len(raw.train_y)}) for a test split of {test_fraction}; "
                "use a larger test_fraction or more data."
            )
        train_x, train_y = raw.train_x[kept], raw.train_y[kept]
        test_x, test_y = raw.train_x[held], raw.train_y[held]
    if public_fraction == 0:
        return (train_x, train_y), (test_x, test_y), None
    kept, held = stratified_holdout(train_y, public_fraction, rng)
    if held.size == 0:
        raise DataError(
            f"{key} has too few training samples ({len(train_y)}) for a public split of {public_fraction}; "
            "use a larger public_fraction, 0 for none, or more data."
        )
    return (train_x[kept], train_y[kept]), (test_x, test_y), (train_x[held], train_y[held])


def _check_labels(key: str, num_classes: int, *label_arrays: np.ndarray) -> None:
    """Labels outside ``[0, num_classes)`` would crash training much later with a cryptic error."""
    for labels in label_arrays:
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise DataError(
                f"{key} labels must lie in [0, {num_classes}), found {int(labels.min())}..{int(labels.max())}; "
                "the data files are inconsistent."
            )
