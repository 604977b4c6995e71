"""Image folders checked against a plan's data schema, and the public folder every party holds.

A cross-silo plan is made from a :class:`~fedcontrast.config.DataSchema` (channels, image size,
class names) instead of data: the operator holds none. Each site reads its own folder under that
schema (:func:`load_site_splits`), and every party reads the public folder named in the plan
(:func:`load_public_folder`) only after checking the SHA-256 fingerprint of its files
(:func:`folder_fingerprint`) against the plan's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import DataSchema, PublicDataConfig
from ..errors import DataError
from .datasets import ArrayDataset, DataSplits, load_dataset
from .imagefolder import (
    IMAGE_SUFFIXES,
    _images_in,
    _visible_dirs,
    check_channels,
    has_split_folders,
    load_imagefolder_raw,
)
from .splits import channel_stats

__all__ = ["FolderSummary", "folder_fingerprint", "infer_schema", "load_public_folder", "load_site_splits",
           "public_folder_path", "summarise_folder", "verify_public_folder", "with_statistics"]


def folder_fingerprint(folder: str | Path) -> str:
    """SHA-256 over every visible file under ``folder``: its path relative to ``folder`` and the
    SHA-256 of its bytes, in sorted path order. The same files give the same fingerprint on any
    machine; one changed, added, removed or renamed file changes it."""
    base = Path(folder)
    if not base.is_dir():
        if base.exists():
            raise DataError(f"{base} is a file, not a folder: give the public data set's folder (its fingerprint "
                            "covers every file in it)")
        raise DataError(f"folder {base} does not exist")
    digest = hashlib.sha256()
    files = sorted(p for p in base.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(base).parts))
    for path in files:
        digest.update(path.relative_to(base).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class FolderSummary:
    """What a site's folder holds under the schema, without decoding any pixels."""

    folder: str
    split_folders: bool  # train/ and test/ given
    counts: dict[str, int]  # images per schema class (train side, or all when not split)
    test_counts: dict[str, int]  # images per class in test/ (empty when not split)
    formats: dict[str, int] = field(default_factory=dict)  # "I;16 16-bit" → images of that format and depth

    @property
    def total(self) -> int:
        return sum(self.counts.values()) + sum(self.test_counts.values())

    def missing_classes(self) -> list[str]:
        return [c for c, n in self.counts.items() if n == 0]

    def formats_text(self) -> str:
        """The images' formats and bit depths, e.g. "L 8-bit ×120, I;16 16-bit ×30"."""
        return ", ".join(f"{label} ×{n}" for label, n in self.formats.items())


def summarise_folder(folder: str | Path, schema: DataSchema) -> FolderSummary:
    """Check ``folder`` against ``schema`` (class folder names, image colour) and count its images.

    Raises :class:`DataError` with one sentence naming the difference."""
    base = Path(folder).expanduser()
    if not base.is_dir():
        raise DataError(f"image folder {base} does not exist")
    split = has_split_folders(str(base))
    sides = [base / "train", base / "test"] if split else [base]
    counts: list[dict[str, int]] = []
    paths = []
    for side in sides:
        dirs = _visible_dirs(side)
        if not dirs:
            raise DataError(f"no class folders found in {side}: put each class's images in {side}/<class_name>/")
        unknown = sorted(d.name for d in dirs if d.name not in schema.classes)
        if unknown:
            shown = ", ".join(schema.classes[:12]) + (", …" if len(schema.classes) > 12 else "")
            raise DataError(f"class folder(s) {', '.join(unknown)} in {side} are not among the plan's classes "
                            f"({shown}); rename or remove them")
        side_counts = {c: 0 for c in schema.classes}
        for d in dirs:
            images = _images_in(d)
            side_counts[d.name] = len(images)
            paths += images
        counts.append(side_counts)
    if not paths:
        raise DataError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found in the class folders of {base}")
    check_channels(paths, schema.in_channels, base)
    from .deep_images import image_format

    formats: dict[str, int] = {}
    for path in paths:
        label = image_format(path).label()
        formats[label] = formats.get(label, 0) + 1
    return FolderSummary(str(base), split, counts[0], counts[1] if split else {}, dict(sorted(formats.items())))


def load_site_splits(folder: str | Path, schema: DataSchema, *, test_fraction: float, split_seed: int,
                     public: ArrayDataset | None = None) -> DataSplits:
    """A site's own folder under the plan's schema: its training split, its held-out test split
    (``test/`` when given, else a stratified ``test_fraction``), and the public set if any."""
    splits = load_dataset("imagefolder", root=str(folder), image_size=schema.image_size, test_fraction=test_fraction,
                          public_fraction=0.0, split_seed=split_seed, class_names=schema.classes,
                          channels=schema.in_channels, normalization=schema.normalization, window=schema.window)
    return DataSplits(splits.train, splits.test, public, splits.name, splits.class_names)


def public_folder_path(public: PublicDataConfig, base_dir: str | Path = ".") -> Path:
    path = Path(public.folder).expanduser()
    return path if path.is_absolute() else Path(base_dir) / path


def verify_public_folder(public: PublicDataConfig, base_dir: str | Path = ".") -> Path:
    """The plan's public folder on this machine, refused (one sentence naming the folder and both
    fingerprints) unless its files are exactly those the plan's fingerprint describes."""
    path = public_folder_path(public, base_dir)
    if not path.is_dir():
        raise DataError(f"the plan's public data folder {path} does not exist on this machine; put the public "
                        f"data set there (every party holds the same files, fingerprint {public.sha256[:16]}…)")
    found = folder_fingerprint(path)
    if found != public.sha256:
        raise DataError(f"the public data folder {path} has fingerprint {found[:16]}… but the plan expects "
                        f"{public.sha256[:16]}…: every party must hold exactly the operator's files")
    return path


def load_public_folder(public: PublicDataConfig, schema: DataSchema, base_dir: str | Path = ".") -> ArrayDataset:
    """The public image folder named in the plan, after checking its fingerprint; labelled by the
    schema's classes, normalised with the schema's statistics (else its own: identical at every party)."""
    path = verify_public_folder(public, base_dir)
    raw = load_imagefolder_raw(str(path), schema.image_size, class_names=schema.classes, channels=schema.in_channels,
                              window=schema.window)
    x = np.concatenate([raw.train_x, raw.test_x]) if raw.test_x is not None else raw.train_x
    y = np.concatenate([raw.train_y, raw.test_y]) if raw.test_y is not None else raw.train_y
    import torch

    from .splits import normalise_, to_float_images

    images = to_float_images(x, schema.image_size)
    if schema.normalization is not None:
        mean, std = (torch.tensor(v, dtype=torch.float32, device="cpu").view(1, -1, 1, 1)
                     for v in schema.normalization)
    else:
        mean, std = channel_stats(images)
    return ArrayDataset(normalise_(images, mean, std), torch.from_numpy(y.astype(np.int64)), schema.num_classes)


def infer_schema(folder: str | Path, *, image_size: int | None = None,
                 normalise_from: str | Path | None = None) -> DataSchema:
    """A schema read off an example folder (its class folders, its images' colour and ``image_size``,
    default 32), with the per-channel statistics of ``normalise_from``'s images when given."""
    raw = load_imagefolder_raw(str(folder), image_size or 32)
    schema = DataSchema(input_shape=(raw.train_x.shape[1], image_size or 32, image_size or 32),
                        classes=raw.class_names)
    return with_statistics(schema, normalise_from) if normalise_from is not None else schema


def with_statistics(schema: DataSchema, folder: str | Path) -> DataSchema:
    """``schema`` with ``mean``/``std`` measured on ``folder``'s images (e.g. the public folder)."""
    from .splits import to_float_images

    raw = load_imagefolder_raw(str(folder), schema.image_size, class_names=schema.classes, channels=schema.in_channels,
                               window=schema.window)
    x = np.concatenate([raw.train_x, raw.test_x]) if raw.test_x is not None else raw.train_x
    mean, std = channel_stats(to_float_images(x, schema.image_size))
    return DataSchema(schema.input_shape, schema.classes, tuple(round(float(v), 6) for v in mean.flatten()),
                      tuple(round(float(v), 6) for v in std.flatten()), schema.window)
