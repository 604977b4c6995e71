"""CIFAR-10, CIFAR-100 and SVHN read from local files through torchvision, never downloaded
(MNIST and Fashion-MNIST: :mod:`.idx`).

Each set is read once into uint8 arrays (``ds.data`` and its labels); no per-sample transforms run.
The expected files are checked before torchvision is asked, so that a missing file gives a message
naming the folder and the files instead of torchvision's hint to download the data.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from .raw import RawData


@dataclass(frozen=True)
class _Layout:
    """Where a data set's files live under ``root`` and how to describe them to a user."""

    subdir: str  # folder under root holding the files ("" for root itself)
    files: tuple[str, ...]
    described: str  # the files as the message lists them
    origin: str  # where the files come from


_LAYOUTS: dict[str, _Layout] = {
    "cifar10": _Layout(
        "cifar-10-batches-py",
        (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"),
        "data_batch_1..5, test_batch, batches.meta",
        "as extracted from cifar-10-python.tar.gz",
    ),
    "cifar100": _Layout(
        "cifar-100-python", ("train", "test", "meta"), "train, test, meta",
        "as extracted from cifar-100-python.tar.gz",
    ),
    "svhn": _Layout(
        "", ("train_32x32.mat", "test_32x32.mat"), "train_32x32.mat, test_32x32.mat",
        "as distributed in the SVHN cropped-digits format",
    ),
}

TORCHVISION_NAMES: tuple[str, ...] = tuple(_LAYOUTS)

# Everything torchvision and its readers raise on truncated or corrupt files (its MNIST reader even
# uses bare asserts); all of them mean "these files are unusable", which is the user's to fix.
_READ_ERRORS = (
    RuntimeError, OSError, ValueError, TypeError, KeyError, IndexError, EOFError, AssertionError,
    pickle.UnpicklingError,
)


def check_files(name: str, root: str | None) -> Path:
    """Raise :class:`DataError` unless ``root`` holds every file ``name`` needs; return the folder."""
    layout = _LAYOUTS[name]
    expected = f"{layout.subdir}/ ({layout.described})" if layout.subdir else f"{layout.described}"
    never = "this tool never downloads data"
    if root is None:
        raise DataError(
            f"{name} needs a data folder: pass root= a folder containing {expected} {layout.origin}; {never}."
        )
    base = Path(root).expanduser()
    folder = base / layout.subdir if layout.subdir else base
    missing = [f for f in layout.files if not (folder / f).is_file()]
    if missing:
        if not base.is_dir():
            problem = "the folder does not exist"
        elif not folder.is_dir():
            problem = f"there is no {layout.subdir}/ folder"
        elif len(missing) == len(layout.files):
            problem = "none of the files are there"
        else:
            problem = f"missing {', '.join(missing)}"
        where = f"{base}/{layout.subdir}/" if layout.subdir else f"{base}/"
        raise DataError(
            f"{name} data not found in {base} ({problem}): expected {where} "
            f"({layout.described}) {layout.origin}; {never}."
        )
    return base


def load_torchvision_raw(name: str, root: str | None) -> RawData:
    """Read the official train and test splits of ``name`` from ``root`` as uint8 NCHW arrays."""
    base = check_files(name, root)
    try:
        return _READERS[name](str(base))
    except ImportError as err:
        raise DataError(f"reading {name} needs a missing package ({err.name}); install it and retry.") from err
    except _READ_ERRORS as err:
        # torchvision's own message suggests downloading, which this tool never does: keep it out.
        raise DataError(
            f"{name} files in {base} are corrupt or unreadable ({type(err).__name__}); "
            f"replace them with intact copies {_LAYOUTS[name].origin}."
        ) from err


def _read_cifar(root: str, cls_name: str) -> RawData:
    import torchvision.datasets as tvd  # lazy: torchvision is slow to import

    cls = getattr(tvd, cls_name)
    train, test = cls(root, train=True, download=False), cls(root, train=False, download=False)
    # ds.data is (N, 32, 32, 3) uint8; the models want channels first.
    return RawData(
        np.ascontiguousarray(train.data.transpose(0, 3, 1, 2)),
        np.asarray(train.targets, dtype=np.int64),
        np.ascontiguousarray(test.data.transpose(0, 3, 1, 2)),
        np.asarray(test.targets, dtype=np.int64),
        tuple(train.classes),
    )


def _read_svhn(root: str) -> RawData:
    import torchvision.datasets as tvd

    train, test = tvd.SVHN(root, split="train", download=False), tvd.SVHN(root, split="test", download=False)
    # ds.data is already (N, 3, 32, 32) uint8 and torchvision maps label 10 to digit 0.
    return RawData(
        train.data, train.labels.astype(np.int64), test.data, test.labels.astype(np.int64),
        tuple(str(d) for d in range(10)),
    )


_READERS = {
    "cifar10": lambda root: _read_cifar(root, "CIFAR10"),
    "cifar100": lambda root: _read_cifar(root, "CIFAR100"),
    "svhn": _read_svhn,
}
