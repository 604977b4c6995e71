"""Image folders under a plan's data schema, the public folder and its fingerprint, and the demo's
site folders written from a partition."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedcontrast.config import DataSchema, PublicDataConfig, RunConfig
from fedcontrast.construction import load_splits, partition, site_test_indices
from fedcontrast.data.folders import write_site_folders
from fedcontrast.data.schema import (
    folder_fingerprint,
    infer_schema,
    load_public_folder,
    load_site_splits,
    summarise_folder,
    with_statistics,
)
from fedcontrast.errors import ConfigError, DataError

SCHEMA = DataSchema(input_shape=(1, 16, 16), classes=("a", "b", "c", "d"))


def write_folder(root: Path, counts: dict[str, int], *, mode: str = "L", seed: int = 0, size: int = 12) -> Path:
    rng = np.random.default_rng(seed)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            shape = (size, size) if mode == "L" else (size, size, 3)
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(root / cls / f"{i}.png")
    return root


def test_fingerprint_changes_with_any_file_and_ignores_hidden_ones(tmp_path):
    folder = write_folder(tmp_path / "p", {"a": 2, "b": 2})
    first = folder_fingerprint(folder)
    assert first == folder_fingerprint(folder) and len(first) == 64
    (folder / ".DS_Store").write_bytes(b"junk")
    assert folder_fingerprint(folder) == first  # hidden files are not data
    (folder / "a" / "0.png").rename(folder / "a" / "9.png")
    renamed = folder_fingerprint(folder)
    assert renamed != first
    data = bytearray((folder / "b" / "1.png").read_bytes())
    data[-20] ^= 1
    (folder / "b" / "1.png").write_bytes(bytes(data))
    assert folder_fingerprint(folder) != renamed


def test_a_site_may_lack_classes_and_keeps_the_plans_labels(tmp_path):
    folder = write_folder(tmp_path / "site", {"b": 6, "d": 10})
    summary = summarise_folder(folder, SCHEMA)
    assert summary.counts == {"a": 0, "b": 6, "c": 0, "d": 10} and summary.missing_classes() == ["a", "c"]
    splits = load_site_splits(folder, SCHEMA, test_fraction=0.25, split_seed=0)
    assert splits.num_classes == 4 and tuple(splits.train.x.shape[1:]) == (1, 16, 16)
    labels = torch.cat([splits.train.y, splits.test.y])
    assert sorted(labels.unique().tolist()) == [1, 3]  # b and d, by their position in the plan
    assert torch.bincount(labels, minlength=4).tolist() == [0, 6, 0, 10]
    assert len(splits.test) == 4 and set(splits.test.y.tolist()) == {1, 3}  # held out from each class


def test_unknown_class_folder_and_wrong_colour_are_refused_naming_the_difference(tmp_path):
    with pytest.raises(DataError, match=r"class folder\(s\) zebra .* not among the plan's classes \(a, b, c, d\)"):
        summarise_folder(write_folder(tmp_path / "unknown", {"a": 2, "zebra": 2}), SCHEMA)
    with pytest.raises(DataError, match=r"not among the plan's classes"):
        load_site_splits(tmp_path / "unknown", SCHEMA, test_fraction=0.25, split_seed=0)
    with pytest.raises(DataError, match=r"is in colour \(mode RGB\) but the plan's data schema says 1"):
        summarise_folder(write_folder(tmp_path / "rgb", {"a": 3}, mode="RGB"), SCHEMA)
    rgb_schema = DataSchema((3, 16, 16), SCHEMA.classes)
    with pytest.raises(DataError, match=r"every image in .* is grey \(1 channel\) but the plan's data schema says 3"):
        summarise_folder(write_folder(tmp_path / "grey", {"a": 3}), rgb_schema)
    with pytest.raises(DataError, match="does not exist"):
        summarise_folder(tmp_path / "nowhere", SCHEMA)


def test_schema_normalisation_is_applied_exactly(tmp_path):
    folder = write_folder(tmp_path / "site", {"a": 4, "b": 4}, size=16)
    schema = DataSchema(SCHEMA.input_shape, SCHEMA.classes, mean=(0.25,), std=(0.5,))
    fixed = load_site_splits(folder, schema, test_fraction=0.25, split_seed=3)
    raw = load_site_splits(folder, DataSchema((1, 16, 16), SCHEMA.classes, mean=(0.0,), std=(1.0,)),
                           test_fraction=0.25, split_seed=3)
    torch.testing.assert_close(fixed.train.x, (raw.train.x - 0.25) / 0.5)
    own = load_site_splits(folder, SCHEMA, test_fraction=0.25, split_seed=3)  # its own statistics
    assert abs(float(own.train.x.mean())) < 1e-5 and abs(float(own.train.x.std(unbiased=False)) - 1) < 1e-4


def test_public_folder_is_checked_against_the_plans_fingerprint(tmp_path):
    folder = write_folder(tmp_path / "public", {"a": 3, "c": 3})
    good = PublicDataConfig(sha256=folder_fingerprint(folder), folder="public")
    public = load_public_folder(good, SCHEMA, base_dir=tmp_path)
    assert len(public) == 6 and sorted(public.y.unique().tolist()) == [0, 2]
    torch.testing.assert_close(public.x, load_public_folder(good, SCHEMA, base_dir=tmp_path).x, rtol=0, atol=0)
    other = PublicDataConfig(sha256="0" * 64, folder=str(folder))
    with pytest.raises(DataError, match=rf"{folder} has fingerprint {good.sha256[:16]}… but the plan expects 0000"):
        load_public_folder(other, SCHEMA)
    with pytest.raises(DataError, match="does not exist on this machine"):
        load_public_folder(good, SCHEMA, base_dir=tmp_path / "elsewhere")


def test_schema_read_off_a_folder_and_statistics_of_another(tmp_path):
    folder = write_folder(tmp_path / "x", {"b": 2, "a": 2}, mode="RGB")
    schema = infer_schema(folder, image_size=16)
    assert schema.input_shape == (3, 16, 16) and schema.classes == ("a", "b") and schema.mean is None
    measured = with_statistics(schema, folder)
    assert len(measured.mean) == 3 and all(0 < s for s in measured.std)


@pytest.mark.parametrize("bad, message", [
    ({"input_shape": (2, 16, 16)}, "1 .grey. or 3"), ({"input_shape": (1, 16, 8)}, "square"),
    ({"classes": ("a",)}, "at least two"), ({"classes": ("a", "a")}, "twice"), ({"classes": ("a", "x/y")}, "plain"),
    ({"mean": (0.5,)}, "both mean and std"), ({"mean": (0.5, 0.5), "std": (1.0, 1.0)}, "one number per channel"),
    ({"mean": (0.5,), "std": (0.0,)}, "std must be > 0"),
])
def test_bad_schemas_are_config_errors(bad, message):
    settings = {"input_shape": (1, 16, 16), "classes": ("a", "b"), **bad}
    with pytest.raises(ConfigError, match=message):
        DataSchema(**settings)


def test_deployment_settings_are_validated():
    schema = {"input_shape": [1, 32, 32], "classes": ["0", "1"]}
    config = RunConfig.from_dict({"dataset": "imagefolder", "sites": ["hosp1", "hosp2"], "data_schema": schema})
    assert config.clients == 2 and config.data_schema.num_classes == 2  # the named sites say how many
    assert RunConfig.from_dict(config.to_dict()) == config
    for data, message in [
        ({"sites": ["Hosp1"]}, "lower-case"), ({"sites": ["a", "a"]}, "twice"),
        ({"sites": ["a", "b"], "clients": 3}, r"clients \(3\) must equal the number of sites named \(2\)"),
        ({"data_schema": schema}, "set dataset to imagefolder"),
        ({"dataset": "imagefolder", "public_data": {"sha256": "0" * 64}}, "public_data needs a data_schema"),
        ({"dataset": "imagefolder", "data_schema": schema, "public_data": {"sha256": "xyz"}}, "64 lower-case hex"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_dict(data)


def test_site_test_indices_follow_the_sites_label_distribution():
    test_labels = np.repeat(np.arange(4), 20)  # 20 test samples per class
    site_labels = np.array([0] * 30 + [2] * 10)  # the site holds classes 0 and 2, 3:1
    held = site_test_indices(test_labels, site_labels, 4, seed=1)
    counts = np.bincount(test_labels[held], minlength=4)
    assert counts.tolist() == [20, 0, 6, 0]  # as large as class 0 allows, in the site's proportions
    np.testing.assert_array_equal(held, site_test_indices(test_labels, site_labels, 4, seed=1))
    assert len(set(held.tolist())) == len(held)


def test_written_site_folders_are_the_simulators_shards(tmp_path):
    config = RunConfig(dataset="digits", clients=3, sites=("h1", "h2", "h3"), beta=0.5, seed=2)
    folders = write_site_folders(config, tmp_path)
    splits = load_splits(config)
    parts = partition(config, splits)
    schema = DataSchema((1, 32, 32), tuple(str(c) for c in range(10)))
    for name, part in zip(config.sites, parts):
        own = load_site_splits(folders[name], schema, test_fraction=0.2, split_seed=0)
        assert torch.equal(torch.bincount(own.train.y, minlength=10),
                           torch.bincount(splits.train.y[part], minlength=10))
        present = set(own.train.y.unique().tolist())
        assert set(own.test.y.unique().tolist()) <= present  # held out with its own distribution
    public = list((tmp_path / "public").rglob("*.png"))
    assert len(public) == len(splits.public)
    with pytest.raises(ConfigError, match="built-in data set"):
        write_site_folders(config.replace(dataset="imagefolder"), tmp_path / "again")
