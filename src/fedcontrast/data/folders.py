"""Write a configured data set and partition as image folders, one per site: the data an
institution would hold, for trying (and testing) a real cross-silo deployment on one machine.

``write_site_folders(config, out)`` gives ``out/<site>/train/<class>/*.png`` (the site's shard of the
training split, exactly the simulator's), ``out/<site>/test/<class>/*.png`` (a held-out set with the
site's own label distribution, drawn from the test split) and ``out/public/<class>/*.png`` (the
public split, when the configuration has one). Images are written at the configured image size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError


def _write_images(folder: Path, images: np.ndarray, labels: np.ndarray, class_names: tuple[str, ...],
                  prefix: str) -> None:
    from PIL import Image

    for c in sorted(set(int(y) for y in labels)):  # only the classes the site holds, as an institution would
        (folder / class_names[c]).mkdir(parents=True, exist_ok=True)
    for i, (img, y) in enumerate(zip(images, labels)):
        pixels = img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)
        Image.fromarray(pixels).save(folder / class_names[int(y)] / f"{prefix}{i:05d}.png")


def write_site_folders(config, out_dir: str | Path) -> dict[str, Path]:
    """The configured partition as image folders (see the module docstring); returns site → folder
    (and ``"public"`` → the public folder when there is one)."""
    from ..config import site_names
    from ..config.datasets import NATURAL
    from .datasets import _DEFAULT_SIZE, _NATIVE_SIZE, _read_raw, _split
    from .partition import partition_indices
    from .splits import site_test_indices, to_float_images

    if config.data_schema is not None or config.dataset == "imagefolder":
        raise ConfigError("write image folders from a built-in data set (e.g. digits), not from image folders")
    if config.partition == NATURAL:
        raise ConfigError(f"{config.dataset} holds feature vectors of its own sites, not images an institution "
                          "would hold: write image folders from digits, synthetic or a torchvision data set")
    out = Path(out_dir)
    size = config.image_size or _DEFAULT_SIZE.get(config.dataset, _NATIVE_SIZE.get(config.dataset, 32))
    raw = _read_raw(config.dataset, config.data_root, size, 1000, 10, 0.5, config.split_seed)
    rng = np.random.default_rng(config.split_seed)
    (train_x, train_y), (test_x, test_y), public = _split(raw, config.dataset, config.test_fraction,
                                                          config.public_fraction, rng)

    def as_uint8(x: np.ndarray) -> np.ndarray:
        images = to_float_images(x, size)
        if x.dtype != np.uint8:  # float sources: scale their range to 0..255
            images = (images - images.min()) / max(float(images.max() - images.min()), 1e-8)
        return (images.clamp(0, 1) * 255).round().to(dtype=torch.uint8).numpy()

    parts = partition_indices(train_y, config.clients, method=config.partition, beta=config.beta,
                              shards_per_client=config.shards_per_client, min_samples=config.min_samples,
                              seed=config.seed)
    folders = {}
    for i, (name, part) in enumerate(zip(site_names(config), parts)):
        folders[name] = out / name
        _write_images(out / name / "train", as_uint8(train_x[part]), train_y[part], raw.class_names, "")
        held = site_test_indices(test_y, train_y[part], len(raw.class_names), seed=config.split_seed + i)
        _write_images(out / name / "test", as_uint8(test_x[held]), test_y[held], raw.class_names, "")
    if public is not None:
        folders["public"] = out / "public"
        _write_images(out / "public", as_uint8(public[0]), public[1], raw.class_names, "")
    return folders
