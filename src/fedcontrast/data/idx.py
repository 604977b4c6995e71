"""MNIST and Fashion-MNIST from their four IDX files, gzipped or not, never downloaded.

Where the files are looked for, in order:

- with a data folder (``--data-root``): torchvision's layout under it (``FashionMNIST/raw/``,
  ``MNIST/raw/``), then the folder itself;
- without one: where a system package installs them. Debian's ``dataset-fashion-mnist`` puts the
  four ``.gz`` files in ``/usr/share/datasets/fashion-mnist`` (``apt-get install
  dataset-fashion-mnist``), so Fashion-MNIST runs with no flag at all.

In each folder a file may be unpacked (``train-images-idx3-ubyte``) or gzipped (``….gz``). The IDX
format is a 4-byte magic number (two zero bytes, the element type, the number of dimensions), one
big-endian 32-bit size per dimension, then the values; every header, size and label is checked, so
a truncated or foreign file is named in one sentence instead of loading as wrong images.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from .raw import RawData

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
UBYTE = 0x08  # the only element type MNIST-like files use
NEVER = "this tool never downloads data"


@dataclass(frozen=True)
class IdxSet:
    """An MNIST-like data set: its torchvision folder, where a system package installs it (if any)."""

    name: str
    torchvision_folder: str
    class_names: tuple[str, ...]
    package: str | None = None  # Debian's package
    package_folder: str | None = None  # where that package puts the files


FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot")
SETS: dict[str, IdxSet] = {
    "mnist": IdxSet("mnist", "MNIST/raw", tuple(str(d) for d in range(10))),
    "fashion_mnist": IdxSet("fashion_mnist", "FashionMNIST/raw", FASHION_CLASSES,
                            package="dataset-fashion-mnist", package_folder="/usr/share/datasets/fashion-mnist"),
}
IDX_NAMES: tuple[str, ...] = tuple(SETS)


def _found(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def locate(name: str, root: str | None) -> dict[str, Path]:
    """The four files of ``name``: each stem → its path. Raises :class:`DataError` naming what is
    missing and how to get it (the ``apt-get`` command where a package provides the set)."""
    spec = SETS[name]
    if root is None:
        if spec.package_folder is None:
            raise DataError(f"{name} needs a data folder: pass --data-root (root= in Python) a folder holding "
                            f"{', '.join(FILES)} (gzipped or not, or under {spec.torchvision_folder}/); {NEVER}.")
        folders = [Path(spec.package_folder)]
    else:
        base = Path(root).expanduser()
        folders = [base / spec.torchvision_folder, base]
    for folder in folders:
        paths = {stem: _found(folder, stem) for stem in FILES}
        if all(paths.values()):
            return {stem: path for stem, path in paths.items() if path is not None}
    if root is None:
        assert spec.package is not None and spec.package_folder is not None
        raise DataError(f"{name} is not installed: `apt-get install {spec.package}` (as root) puts its four files in "
                        f"{spec.package_folder}, or pass --data-root a folder holding them; {NEVER}.")
    base = Path(root).expanduser()
    if not base.is_dir():
        problem = "the folder does not exist"
    else:
        partial = max(folders, key=lambda f: sum(_found(f, s) is not None for s in FILES))
        missing = [s for s in FILES if _found(partial, s) is None]
        problem = ("none of the files are there" if len(missing) == len(FILES)
                   else f"missing {', '.join(missing)} in {partial}")
    hint = f" (or `apt-get install {spec.package}` and no --data-root)" if spec.package else ""
    raise DataError(f"{name} data not found in {base} ({problem}): expected {', '.join(FILES)}, gzipped or not, in "
                    f"{base}/ or {base}/{spec.torchvision_folder}/{hint}; {NEVER}.")


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """The uint8 array of an IDX file of ``ndim`` dimensions (gzipped when its name ends in .gz)."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path} is corrupt or unreadable ({type(err).__name__}: {err}); replace it with an intact "
                        "copy.") from err
    header = 4 + 4 * ndim
    if len(data) < header or data[0] != 0 or data[1] != 0 or data[2] != UBYTE or data[3] != ndim:
        raise DataError(f"{path} is not an IDX file of {ndim}-dimensional unsigned bytes (its first bytes are "
                        f"{data[:4].hex() or 'missing'}; expected 000008{ndim:02x}).")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise DataError(f"{path} holds {len(data) - header} values after its header, but its header announces "
                        f"{expected - header} ({' × '.join(map(str, shape))}): the file is truncated or damaged.")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _pair(paths: dict[str, Path], split: str, classes: int) -> tuple[np.ndarray, np.ndarray]:
    image_file, label_file = paths[f"{split}-images-idx3-ubyte"], paths[f"{split}-labels-idx1-ubyte"]
    images, labels = read_idx(image_file, 3), read_idx(label_file, 1)
    if len(images) != len(labels):
        raise DataError(f"{image_file} holds {len(images)} images but {label_file} {len(labels)} labels: the files "
                        "do not belong together.")
    if labels.size and int(labels.max()) >= classes:
        raise DataError(f"{label_file} holds label {int(labels.max())}; labels must lie in [0, {classes}).")
    # (N, 28, 28) → (N, 1, 28, 28): one channel; a copy, so the arrays own writable memory
    return images[:, None, :, :].copy(), labels.astype(np.int64)


def load_idx_raw(name: str, root: str | None) -> RawData:
    """The official train and test splits of ``name`` (``mnist``, ``fashion_mnist``) as uint8 NCHW."""
    spec = SETS[name]
    paths = locate(name, root)
    train_x, train_y = _pair(paths, "train", len(spec.class_names))
    test_x, test_y = _pair(paths, "t10k", len(spec.class_names))
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(f"the training images of {name} are {train_x.shape[2]}×{train_x.shape[3]} but its test images "
                        f"{test_x.shape[2]}×{test_x.shape[3]}: the files do not belong together.")
    return RawData(train_x, train_y, test_x, test_y, spec.class_names)
