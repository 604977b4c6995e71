"""What every engine builds the same way from a :class:`RunConfig`: the data splits, each site's
shard, site names and seeds, the initial global model and the configured plugin.

The simulator and the OpenFL glue both call these, which is what makes their runs comparable
bit for bit: the same shard for ``site_3``, the same initial weights, the same per-task seeds.
"""

from __future__ import annotations

import numpy as np
import torch

from .algorithms import Algorithm, get_algorithm
from .config import RunConfig
from .data import DataSplits, load_dataset, partition_indices
from .errors import ConfigError
from .models import ContrastiveNet, build_model


def site_name(index: int) -> str:
    return f"site_{index}"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was requested but CUDA is not available on this machine")
    return torch.device(name)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers: the same parts always give the same seed, in any process."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def task_seed(config: RunConfig, round_num: int, site_index: int, task_index: int) -> int:
    return derive_seed(config.seed, round_num, site_index, task_index)


def server_seed(config: RunConfig, round_num: int) -> int:
    return derive_seed(config.seed, round_num, 1 << 20)


def build_algorithm(config: RunConfig) -> Algorithm:
    """The configured plugin; settings for other algorithms are validated too, so typos surface."""
    for name, settings in config.hyperparameters.items():
        get_algorithm(name).from_settings(settings)
    algorithm = get_algorithm(config.algorithm).from_settings(config.hyperparameters.get(config.algorithm))
    algorithm.validate_training(config.training)
    algorithm.num_sites = config.clients
    if config.privacy is not None:
        unsupported = sorted(config.privacy.kinds - algorithm.dp_kinds)
        if unsupported:
            supported = ", ".join(sorted(algorithm.dp_kinds)) or "none"
            raise ConfigError(f"{algorithm.name} does not support privacy.{unsupported[0]} (its DP mechanisms: "
                              f"{supported}); remove that section or choose another algorithm")
        algorithm.private_representations = config.privacy.representations is not None
    return algorithm


def attach_public(algorithm: Algorithm, public) -> None:
    """Tell the plugin the public data set's size (its declarations may depend on it); a plugin
    that needs one and gets none fails here, before any round."""
    if algorithm.requires_public and (public is None or len(public) < 2):
        raise ConfigError(f"{algorithm.name} needs a public data set that every site and the aggregator hold: "
                          "set public_fraction > 0")
    algorithm.public_size = len(public) if public is not None else 0


def site_privacy(config: RunConfig, state: dict, round_num: int, *, noise_seed: int | None):
    """The privacy object of one collaborator task (None when the plan has no privacy section).
    ``noise_seed=None`` draws the noise seed from the operating system, as a deployment must."""
    if config.privacy is None:
        return None
    from .privacy import SitePrivacy

    return SitePrivacy(config.privacy, state, round_num=round_num, noise_seed=noise_seed)


def load_splits(config: RunConfig) -> DataSplits:
    return load_dataset(config.dataset, root=config.data_root, image_size=config.image_size,
                        test_fraction=config.test_fraction, public_fraction=config.public_fraction,
                        split_seed=config.split_seed)


def partition(config: RunConfig, splits: DataSplits) -> list[np.ndarray]:
    """Each site's indices into ``splits.train`` (deterministic given the config)."""
    return partition_indices(splits.train.y.numpy(), config.clients, method=config.partition, beta=config.beta,
                             shards_per_client=config.shards_per_client, min_samples=config.min_samples,
                             seed=config.seed)


def initial_model(config: RunConfig, *, in_channels: int, image_size: int, num_classes: int) -> ContrastiveNet:
    """The round-0 global model: seeded by ``config.seed`` alone, so every process builds it alike."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, in_channels=in_channels, image_size=image_size, num_classes=num_classes,
                        projection_dim=config.projection_dim)
    if config.privacy is not None and config.privacy.dp_sgd is not None:
        from .privacy.dp_sgd import make_dp_compatible  # BatchNorm → GroupNorm, the same on every party

        model = make_dp_compatible(model)
    return model
