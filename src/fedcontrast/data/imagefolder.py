"""An institution's own images, one folder per class, read once with PIL.

Layouts: ``root/<class>/<image>`` (split later), or ``root/train/<class>/`` and ``root/test/<class>/``
when both exist (used as the splits). Class names are the sorted folder names of the training
side; their positions are the labels.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..errors import DataError
from .deep_images import MAX_IMAGE_PIXELS, _open_image  # noqa: F401 (their home was here)
from .raw import RawData

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm",
                            ".dcm", ".dicom"})  # DICOM through pydicom (the extra [dicom]): .deep_images

_LAYOUT_HINT = "a folder holding one sub-folder of images per class"

logger = logging.getLogger(__name__)


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_in(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    )


def _scan(folder: Path, class_names: tuple[str, ...] | None,
          schema: bool = False) -> tuple[tuple[str, ...], list[Path], np.ndarray]:
    """List ``folder``'s class folders and images; ``class_names`` fixes the labels (the test side,
    or the plan's data schema when ``schema``: then a class may be absent or empty, not unknown)."""
    dirs = _visible_dirs(folder)
    if not dirs:
        raise DataError(f"no class folders found in {folder}: put each class's images in {folder}/<class_name>/.")
    names = tuple(d.name for d in dirs)
    if class_names is not None:
        unknown = sorted(set(names) - set(class_names))
        if unknown and schema:
            shown = ", ".join(class_names[:12]) + (", …" if len(class_names) > 12 else "")
            raise DataError(
                f"class folder(s) {', '.join(unknown)} in {folder} are not among the plan's classes ({shown}); "
                "rename or remove them."
            )
        if unknown:
            raise DataError(
                f"test classes {', '.join(unknown)} in {folder} have no training folder; "
                "add them to the train folder or remove them."
            )
    label_of = {n: i for i, n in enumerate(class_names if class_names is not None else names)}

    paths: list[Path] = []
    labels: list[int] = []
    for d in dirs:
        images = _images_in(d)
        if not images and class_names is None and not schema:
            # An empty class would get a label no sample has; almost always a mistake in the folder.
            raise DataError(
                f"class folder {d} has no images ({', '.join(sorted(IMAGE_SUFFIXES))}); add images or remove it."
            )
        paths.extend(images)
        labels.extend([label_of[d.name]] * len(images))
    if not paths:
        raise DataError(f"no images found in the class folders of {folder}; add .png or .jpg files.")
    return names, paths, np.asarray(labels, dtype=np.int64)


def _read_images(paths: list[Path], mode: str, image_size: int,
                 window: tuple[float, float] | None = None) -> np.ndarray:
    """Read, convert and resize every image once; returns ``(N, C, S, S)`` uint8 — or, when any image is
    deeper than 8 bits (16-bit greyscale, DICOM), float32 in [0, 1], every image at its own depth
    (:mod:`.deep_images`; an 8-bit image gives exactly its uint8 values / 255 there too)."""
    from PIL import Image  # lazy: only this source needs PIL

    from .deep_images import image_format, read_deep

    channels = 1 if mode == "L" else 3
    formats = [image_format(path) for path in paths]
    deep = any(f.deep for f in formats)
    if paths:
        counts: dict[str, int] = {}
        for f in formats:
            counts[f.label()] = counts.get(f.label(), 0) + 1
        logger.info("reading %d images (%s)%s", len(paths), ", ".join(f"{k} ×{n}" for k, n in sorted(counts.items())),
                    " at their depth, as values in [0, 1]" if deep else "")
    out = np.empty((len(paths), channels, image_size, image_size), dtype=np.float32 if deep else np.uint8)
    for i, (path, fmt) in enumerate(zip(paths, formats)):
        try:
            if fmt.deep:
                out[i] = read_deep(path, channels, image_size, window)
                continue
            with _open_image(path) as img:
                img = img.convert(mode).resize((image_size, image_size), Image.Resampling.BILINEAR)
                pixels = np.asarray(img, dtype=np.uint8)
        except (OSError, ValueError) as err:  # a truncated file fails while decoding
            raise DataError(f"image {path} cannot be read ({type(err).__name__}); replace or remove it.") from err
        pixels = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
        out[i] = pixels / np.float32(255) if deep else pixels
    return out


def _all_grey(paths: list[Path]) -> bool:
    """True when every image has a single grey channel (opening reads the header only)."""
    from .deep_images import image_format

    return all(image_format(path).channels == 1 for path in paths)


def has_split_folders(root: str | None) -> bool:
    """True when ``root`` has both ``train/`` and ``test/`` folders, which then are the splits."""
    if root is None:
        return False
    base = Path(root).expanduser()
    return (base / "train").is_dir() and (base / "test").is_dir()


def check_channels(paths: list[Path], channels: int, folder: Path) -> None:
    """Refuse images whose colour does not fit ``channels``: a colour image where the plan says 1
    channel, or a folder of grey images only where it says 3 (a few grey images among colour ones
    are converted)."""
    from .deep_images import image_format

    if channels == 1:
        for path in paths:
            fmt = image_format(path)
            if fmt.channels != 1:
                raise DataError(f"image {path} is in colour (mode {fmt.kind}) but the plan's data schema says 1 (grey) "
                                "channel; convert the images to grey or ask the operator for a 3-channel plan.")
    elif paths and _all_grey(paths):
        raise DataError(f"every image in {folder} is grey (1 channel) but the plan's data schema says 3 (RGB) "
                        "channels; ask the operator for a 1-channel plan or convert the images.")


def load_imagefolder_raw(root: str | None, image_size: int, *, class_names: tuple[str, ...] | None = None,
                         channels: int | None = None, window: tuple[float, float] | None = None) -> RawData:
    """Read ``root`` as an image folder (see the module docstring) into uint8 NCHW arrays.

    Images become RGB, or one grey channel when every image is grey, and are resized to
    ``image_size`` × ``image_size`` (bilinear, aspect ratio not kept). ``class_names`` and
    ``channels`` (a plan's data schema) fix the labels and the channels instead: class folders
    outside ``class_names`` and images of the wrong colour are refused (:func:`check_channels`).
    """
    if root is None:
        raise DataError(f"imagefolder needs a data folder (--data-root; root= in Python): {_LAYOUT_HINT}.")
    base = Path(root).expanduser()
    if not base.is_dir():
        raise DataError(f"image folder {base} does not exist; it must be {_LAYOUT_HINT}.")

    train_dir, test_dir = base / "train", base / "test"
    has_split = has_split_folders(root)
    schema = class_names is not None
    names, train_paths, train_y = _scan(train_dir if has_split else base, class_names, schema)
    class_names = names if class_names is None else class_names  # schema: the given names
    test_paths: list[Path] = []
    test_y = None
    if has_split:
        _, test_paths, test_y = _scan(test_dir, class_names, schema)

    if channels is not None:
        check_channels(train_paths + test_paths, channels, base)
        mode = "L" if channels == 1 else "RGB"
    else:
        mode = "L" if _all_grey(train_paths + test_paths) else "RGB"
    train_x = _read_images(train_paths, mode, image_size, window)
    test_x = _read_images(test_paths, mode, image_size, window) if has_split else None
    if test_x is not None and train_x.dtype != test_x.dtype:  # one side deep, the other 8-bit: both as values in [0, 1]
        train_x, test_x = (x.astype(np.float32) / 255 if x.dtype == np.uint8 else x for x in (train_x, test_x))
    present = sorted(set(train_y.tolist()) | (set(test_y.tolist()) if test_y is not None else set()))
    if len(present) == 1:
        logger.warning("every image in %s is of class %r: accuracy measured on a single class is meaningless "
                       "(predicting that class scores 1.0); add images of other classes to compare models",
                       base, class_names[present[0]])
    return RawData(train_x, train_y, test_x, test_y, tuple(class_names))
