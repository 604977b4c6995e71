"""What every engine builds the same way from a :class:`RunConfig`: the data splits, each site's
shard, site names and seeds, the initial global model and the configured plugin.

The simulator, the OpenFL glue and the Flower apps all call these, which is what makes their runs
comparable bit for bit: the same shard for ``site_3``, the same initial weights, the same per-task seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .algorithms import Algorithm, RunFacts, get_algorithm, import_plugins, secure_summable
from .config import RunConfig, site_names
from .data import ArrayDataset, DataSplits, load_dataset, partition_indices
from .data.splits import site_test_indices, stratified_holdout  # tests import site_test_indices from here too
from .errors import ConfigError
from .models import ContrastiveNet, build_model
from .seeds import derive_seed  # noqa: F401  (engines and tests import it from here)


def site_index(config: RunConfig, name: str) -> int | None:
    """A site's position in the federation (``config.sites``, else ``site_0`` …); None if absent."""
    names = site_names(config)
    return names.index(name) if name in names else None


def task_seed(config: RunConfig, round_num: int, site_index: int, task_index: int) -> int:
    return derive_seed(config.seed, round_num, site_index, task_index)


def server_seed(config: RunConfig, round_num: int) -> int:
    return derive_seed(config.seed, round_num, 1 << 20)


def run_facts(config: RunConfig, public_size: int = 0) -> RunFacts:
    """The facts a plugin of this run is built with: the federation's size, the public set's size
    (``public_size``, where the caller holds it), the robustness section and, under DP, the noise on
    representations and on sample counts."""
    privacy = config.privacy
    return RunFacts(num_sites=config.clients, public_size=public_size, robustness=config.robustness,
                    representation_dp=privacy.representations if privacy is not None else None,
                    count_noise=privacy.count_noise_multiplier if privacy is not None else 0.0,
                    under_dp=privacy is not None)


def algorithm_class(config: RunConfig) -> type[Algorithm]:
    """The plugin class the run names, once the run's plugin modules (``config.plugins``) are imported."""
    import_plugins(config.plugins)
    return get_algorithm(config.algorithm)


def build_algorithm(config: RunConfig, *, public_size: int = 0) -> Algorithm:
    """The configured plugin, built once with the run's facts (:func:`run_facts`; ``public_size``: the
    public set's size, for callers whose use depends on it — else see :func:`build_algorithm_with_public`),
    the run's plugin modules imported first. Settings for other algorithms are validated too, so typos surface."""
    import_plugins(config.plugins)
    for name, settings in config.hyperparameters.items():
        get_algorithm(name).from_settings(settings)
    facts = run_facts(config, public_size)
    algorithm = get_algorithm(config.algorithm).from_settings(config.hyperparameters.get(config.algorithm), facts)
    algorithm.validate_training(config.training)
    if config.secure_aggregation is not None and not secure_summable(algorithm):
        variant = getattr(algorithm, "secure_variant", None)  # SecureSum's: a variant of the plugin is summable
        if variant is not None:  # name the setting
            setting, why = variant
            raise ConfigError(f"secure aggregation gives the aggregator only the sum of the uploads, but "
                              f"{algorithm.name} as configured {why}: set {setting} (its secure-summable variant) "
                              "or turn secure aggregation off")
        raise ConfigError(f"secure aggregation gives the aggregator only the sum of the uploads, but {algorithm.name} "
                          "combines individual uploads (e.g. FedSiam-DA's cosine weights); it supports fedavg, "
                          "fedprox, moon and flesd, and fedssc and fedpcl in their secure variants "
                          "(fedssc.class_reps: pooled, fedpcl.local_sets: global)")
    if config.secure_aggregation is not None:  # a ring too coarse for the plugin's terms would ruin the model
        from .privacy.secagg import SecureAggregationError
        from .privacy.secagg_terms import check_precision

        try:
            check_precision(algorithm, config.secure_aggregation, config.clients, config.min_samples)
        except SecureAggregationError as exc:
            raise ConfigError(str(exc)) from None
    if config.privacy is not None:
        unsupported = sorted(config.privacy.kinds - algorithm.dp_kinds)
        if unsupported:
            supported = ", ".join(sorted(algorithm.dp_kinds)) or "none"
            raise ConfigError(f"{algorithm.name} does not support privacy.{unsupported[0]} (its DP mechanisms: "
                              f"{supported}); remove that section or choose another algorithm")
        algorithm.validate_privacy(config.privacy)
    return algorithm


def upload_screen(config: RunConfig, algorithm: Algorithm):
    """The aggregator's screen of every round's uploads (:class:`fedcontrast.robust.UploadScreen`), as
    the plan's ``robustness`` section says; under DP a site's count may arrive noised, within the
    count noise's allowance (the run fact ``count_noise``)."""
    from .robust import UploadScreen

    return UploadScreen(config.robustness, algorithm, count_noise=algorithm.facts.count_noise)


def build_algorithm_with_public(config: RunConfig, public) -> Algorithm:
    """The plugin of a party that holds the run's public data set ``public`` (None: the run has none):
    its size is one of the plugin's facts (FLESD's upload shapes depend on it); a plugin that needs
    one and gets none fails here, before any round."""
    algorithm = build_algorithm(config, public_size=len(public) if public is not None else 0)
    if algorithm.requires_public and (public is None or len(public) < 2):
        raise ConfigError(f"{algorithm.name} needs a public data set that every site and the aggregator hold: "
                          "set public_fraction > 0")
    return algorithm


def site_privacy(config: RunConfig, state: dict, round_num: int, *, noise_seed: int | None):
    """The privacy object of one collaborator task (None when the plan has no privacy section).
    ``noise_seed=None`` draws the noise seed from the operating system, as a deployment must."""
    if config.privacy is None:
        return None
    from .privacy import SitePrivacy

    return SitePrivacy(config.privacy, state, round_num=round_num, noise_seed=noise_seed)


def load_splits(config: RunConfig) -> DataSplits:
    """The configured data set's splits. Under a data schema: the folder ``data_root`` read under the
    schema, and the plan's public folder (when it names one) as the public set."""
    schema = config.data_schema
    if schema is None:
        splits = load_dataset(config.dataset, root=config.data_root, image_size=config.image_size,
                              test_fraction=config.test_fraction, public_fraction=config.public_fraction,
                              split_seed=config.split_seed, sites=config.clients,
                              settings=config.dataset_settings or None)
        return splits if config.feature_shift == "none" else scanned_splits(config, splits)
    splits = load_dataset("imagefolder", root=config.data_root, image_size=schema.image_size,
                          test_fraction=config.test_fraction,
                          public_fraction=0.0 if config.public_data else config.public_fraction,
                          split_seed=config.split_seed, class_names=schema.classes, channels=schema.in_channels,
                          normalization=schema.normalization)
    if config.public_data is None:
        return splits
    return DataSplits(splits.train, splits.test, load_public(config), splits.name, splits.class_names)


def scanned_splits(config: RunConfig, splits: DataSplits) -> DataSplits:
    """``splits`` as the sites' scanners acquire them (``feature_shift: scanner``, :mod:`.data.shift`):
    each site's shard through its own device, and the test split divided among the sites (IID, seeded
    by ``split_seed``), each part through its site's device: the global model is scored on every
    site's kind of image, each site on its own part. The public split is left as it is."""
    from .data.shift import scan, scanner_for

    train_x, test_x = splits.train.x.clone(), splits.test.x.clone()
    own_tests = partition_indices(splits.test.y.numpy(), config.clients, method="iid", seed=config.split_seed)
    for index, (shard, own) in enumerate(zip(partition(config, splits), own_tests)):
        scanner = scanner_for(index, config.split_seed)
        shard_t, own_t = torch.as_tensor(shard, dtype=torch.int64), torch.as_tensor(own, dtype=torch.int64)
        train_x[shard_t] = scan(train_x[shard_t], scanner, seed=derive_seed(config.split_seed, index, 1))
        test_x[own_t] = scan(test_x[own_t], scanner, seed=derive_seed(config.split_seed, index, 2))
    return DataSplits(ArrayDataset(train_x, splits.train.y, splits.num_classes),
                      ArrayDataset(test_x, splits.test.y, splits.num_classes), splits.public, splits.name,
                      splits.class_names, site_test=tuple(np.asarray(o, dtype=np.int64) for o in own_tests))


def data_shape(config: RunConfig) -> dict[str, int]:
    """Input channels, image size and classes of the model's input — from the data schema without
    reading any data, else from the configured data set."""
    if config.data_schema is not None:
        s = config.data_schema
        return {"in_channels": s.in_channels, "image_size": s.image_size, "num_classes": s.num_classes}
    splits = load_splits(config)
    return {"in_channels": splits.in_channels, "image_size": splits.image_size, "num_classes": splits.num_classes}


def load_public(config: RunConfig, base_dir: str | Path = ".") -> ArrayDataset | None:
    """The public data set without any private data: the plan's public folder (checked against its
    fingerprint; relative to ``base_dir``), or the public split of the embedded/configured data set."""
    if config.public_data is not None:
        from .data.schema import load_public_folder

        assert config.data_schema is not None  # RunConfig: public_data needs a data_schema
        return load_public_folder(config.public_data, config.data_schema, base_dir)
    if config.data_schema is not None:
        return None  # a deployment without a public folder
    return load_splits(config).public


def site_test_split(test: ArrayDataset, site_labels: torch.Tensor, seed: int) -> ArrayDataset:
    """:func:`site_test_indices` applied to a test split: the held-out set of a ``shard:N`` site (the
    embedded demo's sites hold no test images of their own)."""
    return test.subset(site_test_indices(test.y.numpy(), site_labels.numpy(), test.num_classes, seed))


def site_test_of(config: RunConfig, splits: DataSplits, index: int, site_labels: torch.Tensor) -> ArrayDataset:
    """Site ``index``'s held-out set: its own test samples where the data set has sites of its own,
    else :func:`site_test_split` of the shared test split (with the site's label distribution)."""
    if splits.site_test is not None:
        return splits.test.subset(splits.site_test[index])
    return site_test_split(splits.test, site_labels, seed=config.split_seed + index)


def partition(config: RunConfig, splits: DataSplits) -> list[np.ndarray]:
    """Each site's indices into ``splits.train`` (deterministic given the config): the data set's own
    sites where it has them (``partition: natural``), else ``config.partition`` of its labels."""
    if splits.site_train is not None:
        if len(splits.site_train) != config.clients:
            raise ConfigError(f"{splits.name} was made for {len(splits.site_train)} sites, not {config.clients}")
        return list(splits.site_train)
    return partition_indices(splits.train.y.numpy(), config.clients, method=config.partition, beta=config.beta,
                             shards_per_client=config.shards_per_client, min_samples=config.min_samples,
                             seed=config.seed)


VALIDATION_STREAM = 0x7A1  # a site's validation hold-out draws from a stream of its own


def site_validation(config: RunConfig, labels: np.ndarray | torch.Tensor, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (kept, held) within site ``index``'s own training samples of the labels ``labels``:
    ``config.validation_fraction`` of them held out, stratified by class, as the site's validation
    split. Seeded by ``split_seed`` and the index alone, so every engine holds out the same samples;
    a class keeps at least one training sample, so a very small site may hold out none."""
    labels = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if config.validation_fraction == 0:
        return np.arange(len(labels), dtype=np.int64), np.empty(0, dtype=np.int64)
    rng = np.random.default_rng([config.split_seed, index, VALIDATION_STREAM])
    return stratified_holdout(labels, config.validation_fraction, rng)


def split_site_data(config: RunConfig, data: ArrayDataset, index: int) -> tuple[ArrayDataset, ArrayDataset | None]:
    """A site's (training, validation) parts of its own training data (:func:`site_validation`);
    validation None when nothing is held out."""
    kept, held = site_validation(config, data.y, index)
    if held.size == 0:
        return data, None
    return data.subset(kept), data.subset(held)


def initial_model(config: RunConfig, *, in_channels: int, image_size: int, num_classes: int) -> ContrastiveNet:
    """The round-0 global model: seeded by ``config.seed`` alone, so every process builds it alike."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, in_channels=in_channels, image_size=image_size, num_classes=num_classes,
                        projection_dim=config.projection_dim)
    if config.privacy is not None and config.privacy.dp_sgd is not None:
        from .privacy.dp_sgd import make_dp_compatible  # BatchNorm → GroupNorm, the same on every party

        model = make_dp_compatible(model)
    return model
