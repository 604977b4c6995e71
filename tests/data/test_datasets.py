"""Tests of load_dataset: sizes, disjoint splits, normalisation, determinism, files and errors."""

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedcontrast.data import DATASET_NAMES, ArrayDataset, DataSplits, load_dataset
from fedcontrast.data.splits import stratified_holdout
from fedcontrast.errors import ConfigError, DataError, UnknownNameError


def all_labels(splits: DataSplits) -> np.ndarray:
    parts = [splits.train.y, splits.test.y] + ([splits.public.y] if splits.public is not None else [])
    return torch.cat(parts).numpy()


def zscore_rows(x: np.ndarray) -> np.ndarray:
    """Per-image z-scores: invariant to the per-channel affine normalisation of one-channel images."""
    x = x.reshape(len(x), -1).astype(np.float64)
    x = x - x.mean(axis=1, keepdims=True)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def digits() -> DataSplits:
    return load_dataset("digits", split_seed=0)


# --- digits -----------------------------------------------------------------------------------


def test_digits_has_all_1797_samples_as_32x32_one_channel_images(digits):
    assert len(digits.train) + len(digits.test) + len(digits.public) == 1797
    for part in (digits.train, digits.test, digits.public):
        assert part.x.shape[1:] == (1, 32, 32) and part.x.dtype == torch.float32
        assert part.y.dtype == torch.int64
    assert (digits.num_classes, digits.in_channels, digits.image_size, digits.name) == (10, 1, 32, "digits")
    assert set(np.unique(all_labels(digits))) == set(range(10))
    assert len(digits.test) == round(0.2 * 1797)
    assert len(digits.public) == round(0.1 * (1797 - len(digits.test)))


def test_digits_splits_are_disjoint_and_together_are_the_raw_data(digits):
    from sklearn.datasets import load_digits

    raw = load_digits()
    upsampled = F.interpolate(torch.from_numpy(raw.images[:, None] / 16.0).float(), size=(32, 32),
                              mode="bilinear", align_corners=False).numpy()
    raw_z = zscore_rows(upsampled)
    ours = np.concatenate([digits.train.x.numpy(), digits.test.x.numpy(), digits.public.x.numpy()])
    ours_labels = all_labels(digits)
    similarity = zscore_rows(ours) @ raw_z.T
    match = similarity.argmax(axis=1)
    assert np.allclose(similarity.max(axis=1), 1.0, atol=1e-4), "every image must be a raw digit"
    assert len(np.unique(match)) == 1797, "no raw digit may appear twice (splits must be disjoint)"
    assert np.array_equal(raw.target[match], ours_labels), "labels must follow their images"


def test_digits_train_is_normalised_and_test_uses_the_train_statistics(digits):
    x = digits.train.x.double()
    assert abs(x.mean().item()) < 1e-4
    assert abs(x.std().item() - 1.0) < 1e-3
    # Same statistics, a different sample: close to but not exactly standardised.
    assert abs(digits.test.x.mean().item()) < 0.1
    assert abs(digits.test.x.std().item() - 1.0) < 0.1


def test_splits_are_stratified(digits):
    train_counts = np.bincount(digits.train.y.numpy(), minlength=10)
    test_counts = np.bincount(digits.test.y.numpy(), minlength=10)
    total = train_counts + test_counts + np.bincount(digits.public.y.numpy(), minlength=10)
    assert np.all(np.abs(test_counts - 0.2 * total) <= 1.0)


def test_public_fraction_zero_gives_no_public_split():
    splits = load_dataset("digits", public_fraction=0.0, test_fraction=0.25)
    assert splits.public is None
    assert len(splits.train) + len(splits.test) == 1797
    assert len(splits.test) == round(0.25 * 1797)


def test_image_size_resizes():
    splits = load_dataset("digits", image_size=16, public_fraction=0.0)
    assert splits.train.x.shape[1:] == (1, 16, 16) and splits.image_size == 16


# --- synthetic --------------------------------------------------------------------------------


def test_synthetic_is_deterministic_by_seed():
    a = load_dataset("synthetic", split_seed=3, synthetic_samples=300)
    b = load_dataset("synthetic", split_seed=3, synthetic_samples=300)
    c = load_dataset("synthetic", split_seed=4, synthetic_samples=300)
    for first, second in ((a.train, b.train), (a.test, b.test), (a.public, b.public)):
        assert torch.equal(first.x, second.x) and torch.equal(first.y, second.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert a.train.x.shape[1:] == (1, 16, 16)
    assert len(a.train) + len(a.test) + len(a.public) == 300


def test_synthetic_sizes_and_classes():
    splits = load_dataset("synthetic", synthetic_samples=200, synthetic_classes=4, image_size=12, public_fraction=0)
    assert splits.num_classes == 4 and splits.image_size == 12
    assert np.array_equal(np.bincount(all_labels(splits)), [50, 50, 50, 50])


def nearest_centroid_accuracy(splits: DataSplits) -> float:
    x, y = splits.train.x.flatten(1).numpy(), splits.train.y.numpy()
    centroids = np.stack([x[y == k].mean(axis=0) for k in range(splits.num_classes)])
    xt = splits.test.x.flatten(1).numpy()
    predicted = ((xt[:, None, :] - centroids[None]) ** 2).sum(axis=-1).argmin(axis=1)
    return float(np.mean(predicted == splits.test.y.numpy()))


def test_synthetic_is_learnable_but_not_trivial_and_noise_makes_it_harder():
    default = nearest_centroid_accuracy(load_dataset("synthetic", split_seed=0))
    noisy = nearest_centroid_accuracy(load_dataset("synthetic", split_seed=0, synthetic_noise=1.5))
    assert 0.5 < default < 0.99  # chance is 0.1
    assert noisy < default


# --- the hold-out helper ----------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5])
def test_stratified_holdout_partitions_the_indices(fraction):
    labels = np.random.default_rng(0).integers(0, 7, size=503)
    kept, held = stratified_holdout(labels, fraction, np.random.default_rng(1))
    assert np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(503))
    assert len(np.intersect1d(kept, held)) == 0
    assert len(held) == round(fraction * 503)
    assert set(labels[kept]) == set(labels)  # every class keeps training samples
    again, _ = stratified_holdout(labels, fraction, np.random.default_rng(1))
    assert np.array_equal(kept, again)


# --- errors -----------------------------------------------------------------------------------


def test_unknown_name_lists_the_known_names():
    with pytest.raises(UnknownNameError) as info:
        load_dataset("imagenet")
    for name in DATASET_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "settings",
    [
        {"test_fraction": 0.0},
        {"test_fraction": 1.0},
        {"test_fraction": float("nan")},
        {"public_fraction": 1.0},
        {"public_fraction": -0.1},
        {"test_fraction": 0.6, "public_fraction": 0.4},
        {"image_size": 4},
        {"image_size": 16.5},
        {"synthetic_classes": 1},
        {"synthetic_noise": -1.0},
        {"synthetic_samples": 10},
        {"split_seed": -3},
    ],
)
def test_bad_settings_are_config_errors(settings):
    with pytest.raises(ConfigError):
        load_dataset("synthetic", **settings)


def test_missing_cifar10_folder_is_a_data_error_naming_the_folder(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("cifar10", root=str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "cifar-10-batches-py" in message and "never downloads" in message
    with pytest.raises(DataError, match="root="):
        load_dataset("cifar10")


def test_partly_missing_mnist_names_the_missing_file(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_dataset("mnist", root=str(tmp_path))


def test_corrupt_cifar10_files_are_a_data_error(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (folder / name).write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="corrupt"):
        load_dataset("cifar10", root=str(tmp_path))


# --- torchvision sets from tiny local files ----------------------------------------------------


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> None:
    """Write an IDX file (the MNIST format) of uint8 values, gzipped when ``gz``."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def write_mnist_like(folder: Path, *, gz: bool, train: int = 40, test: int = 20, seed: int = 0) -> tuple:
    """The four files of a tiny MNIST-like set in ``folder``; returns (train images, train labels,
    test images, test labels) as written."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = (rng.integers(0, 256, (train, 28, 28)), np.arange(train) % 10,
              rng.integers(0, 256, (test, 28, 28)), (np.arange(test) * 3) % 10)
    for stem, array in zip(("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                            "t10k-labels-idx1-ubyte"), arrays):
        write_idx(folder / stem, array, gz=gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_like_sets_are_read_from_local_idx_files(tmp_path, name, folder, gz):
    _, train_y, _, test_y = write_mnist_like(tmp_path / folder / "raw", gz=gz)  # torchvision's layout

    splits = load_dataset(name, root=str(tmp_path), public_fraction=0.25)
    assert splits.train.x.shape == (30, 1, 28, 28) and len(splits.public) == 10
    assert np.array_equal(splits.test.y.numpy(), test_y)  # the official test split, in order
    assert np.array_equal(np.sort(torch.cat([splits.train.y, splits.public.y]).numpy()), np.sort(train_y))
    assert splits.num_classes == 10
    resized = load_dataset(name, root=str(tmp_path), image_size=32, public_fraction=0)
    assert resized.test.x.shape == (20, 1, 32, 32)


def test_idx_pixels_and_labels_arrive_unchanged(tmp_path):
    """The reader's arrays against what was written: the raw source, before splits and normalisation."""
    from fedcontrast.data.idx import load_idx_raw

    train_x, train_y, test_x, test_y = write_mnist_like(tmp_path, gz=True, seed=3)  # the folder itself
    raw = load_idx_raw("fashion_mnist", str(tmp_path))
    assert raw.train_x.shape == (40, 1, 28, 28) and raw.train_x.dtype == np.uint8
    assert np.array_equal(raw.train_x[:, 0], train_x) and np.array_equal(raw.test_x[:, 0], test_x)
    assert np.array_equal(raw.train_y, train_y) and np.array_equal(raw.test_y, test_y)
    assert raw.class_names[0] == "T-shirt/top" and raw.class_names[9] == "Ankle boot"


def test_fashion_mnist_needs_no_flag_where_debians_package_put_it(tmp_path, monkeypatch):
    import dataclasses

    from fedcontrast.data import idx

    package = tmp_path / "usr-share-datasets-fashion-mnist"
    _, _, _, test_y = write_mnist_like(package, gz=True)  # as Debian's package installs them: four .gz files
    monkeypatch.setitem(idx.SETS, "fashion_mnist", dataclasses.replace(idx.SETS["fashion_mnist"],
                                                                       package_folder=str(package)))
    splits = load_dataset("fashion_mnist", public_fraction=0.25)
    assert np.array_equal(splits.test.y.numpy(), test_y) and len(splits.train) == 30

    for path in package.iterdir():
        path.unlink()
    with pytest.raises(DataError) as info:
        load_dataset("fashion_mnist")
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message and str(package) in message
    assert "never downloads" in message and "\n" not in message


def test_mnist_has_no_package_and_asks_for_a_folder():
    with pytest.raises(DataError, match="--data-root"):
        load_dataset("mnist")


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "truncated"),
    (lambda p: p.write_bytes(b"\x00\x00\x0d\x03" + p.read_bytes()[4:]), "not an IDX file"),
    (lambda p: p.write_bytes(b"garbage"), "not an IDX file"),
])
def test_damaged_idx_files_are_named_in_one_sentence(tmp_path, damage, match):
    write_mnist_like(tmp_path, gz=False)
    target = tmp_path / "t10k-images-idx3-ubyte"
    damage(target)
    with pytest.raises(DataError, match=match) as info:
        load_dataset("fashion_mnist", root=str(tmp_path))
    assert str(target) in str(info.value)


def test_a_broken_gzip_and_mismatched_files_are_data_errors(tmp_path):
    write_mnist_like(tmp_path, gz=True)
    gz = tmp_path / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:30])
    with pytest.raises(DataError, match="corrupt"):
        load_dataset("fashion_mnist", root=str(tmp_path))
    write_mnist_like(tmp_path, gz=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(39) % 10, gz=True)  # one label short
    with pytest.raises(DataError, match="40 images but"):
        load_dataset("fashion_mnist", root=str(tmp_path))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.full(40, 12), gz=True)  # no such class
    with pytest.raises(DataError, match="label 12"):
        load_dataset("fashion_mnist", root=str(tmp_path))


def test_a_folder_missing_some_idx_files_names_them(tmp_path):
    write_mnist_like(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="missing t10k-labels-idx1-ubyte"):
        load_dataset("fashion_mnist", root=str(tmp_path))
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("fashion_mnist", root=str(tmp_path / "nowhere"))


def test_cifar10_is_read_channels_first_from_local_batches(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar

    # The real files are checked against MD5 sums; these hand-made ones cannot match them.
    monkeypatch.setattr(cifar.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(cifar, "check_integrity", lambda *args, **kwargs: True)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)

    def batch(n: int) -> dict:
        images = np.zeros((n, 3, 32, 32), dtype=np.uint8)
        images[:, 0] = np.arange(32, dtype=np.uint8) * 8  # red ramps along the width
        images[:, 1] = rng.integers(0, 256, (n, 32, 32))
        return {"data": images.reshape(n, -1), "labels": list(range(n))}

    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch(10)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(10)))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))

    splits = load_dataset("cifar10", root=str(tmp_path), public_fraction=0.2)
    assert len(splits.train) == 40 and len(splits.public) == 10 and len(splits.test) == 10
    assert splits.train.x.shape[1:] == (3, 32, 32)
    assert splits.class_names == tuple(f"c{i}" for i in range(10))
    red_row = splits.test.x[0, 0, 5]
    assert torch.all(red_row[1:] > red_row[:-1]), "the red channel must still ramp along the width"
    assert np.array_equal(splits.test.y.numpy(), np.arange(10))


def test_svhn_is_read_from_local_mat_files(tmp_path, monkeypatch):
    import scipy.io
    import torchvision.datasets.svhn as svhn

    monkeypatch.setattr(svhn.SVHN, "_check_integrity", lambda self: True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("test", 10)):
        labels = (np.arange(n) % 10 + 1).reshape(n, 1)  # SVHN stores digit 0 as label 10
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat",
                         {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8), "y": labels})
    splits = load_dataset("svhn", root=str(tmp_path), public_fraction=0)
    assert splits.train.x.shape == (30, 3, 32, 32) and splits.test.x.shape == (10, 3, 32, 32)
    assert set(splits.test.y.tolist()) == set(range(10))


# --- image folders ----------------------------------------------------------------------------


CLASSES = ("apple", "banana", "cherry")


def make_folder(root: Path, classes=CLASSES, per_class: int = 4, mode: str = "RGB") -> None:
    """Class ``k`` images are flat colours whose red (or grey) value grows with ``k``."""
    from PIL import Image

    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for j in range(per_class):
            value = 40 + 70 * k + 5 * j
            colour = (value, 90, 200 - j) if mode == "RGB" else value
            Image.new(mode, (20, 12), colour).save(root / name / f"img_{j}.png")


def test_imagefolder_loads_images_with_labels_from_sorted_folder_names(tmp_path):
    make_folder(tmp_path)
    splits = load_dataset("imagefolder", root=str(tmp_path), test_fraction=0.25)
    assert splits.class_names == CLASSES and splits.num_classes == 3
    assert splits.in_channels == 3 and splits.image_size == 32
    assert len(splits.train) + len(splits.test) + len(splits.public) == 12
    xs = torch.cat([splits.train.x, splits.test.x, splits.public.x])
    ys = all_labels(splits)
    assert np.array_equal(np.bincount(ys), [4, 4, 4])
    red = xs[:, 0].mean(dim=(1, 2)).numpy()
    for k in range(2):  # normalisation keeps the order of the red values, which grow with the class
        assert red[ys == k].max() < red[ys == k + 1].min()


def test_grey_imagefolder_with_train_and_test_folders(tmp_path):
    make_folder(tmp_path / "train", mode="L")
    make_folder(tmp_path / "test", classes=CLASSES[:2], per_class=2, mode="L")
    splits = load_dataset("imagefolder", root=str(tmp_path), image_size=16, public_fraction=0)
    assert splits.in_channels == 1 and splits.train.x.shape == (12, 1, 16, 16)
    assert np.array_equal(splits.test.y.numpy(), [0, 0, 1, 1])


@pytest.mark.parametrize("layout", ["empty", "empty class", "missing"])
def test_unusable_imagefolder_is_a_data_error_naming_the_folder(tmp_path, layout):
    root = tmp_path / "images"
    if layout != "missing":
        root.mkdir()
    if layout == "empty class":
        (root / "dogs").mkdir()
    with pytest.raises(DataError) as info:
        load_dataset("imagefolder", root=str(root))
    assert str(root) in str(info.value)


def test_array_dataset_subset_and_validation():
    data = ArrayDataset(torch.arange(24, dtype=torch.float32).view(6, 1, 2, 2), torch.arange(6) % 3, 3)
    part = data.subset(np.array([4, 1]))
    assert len(part) == 2 and part.y.tolist() == [1, 1] and torch.equal(part.x[0], data.x[4])
    assert len(data.subset(torch.tensor([0, 2, 5]))) == 3
    with pytest.raises(DataError):
        ArrayDataset(torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64), 2)
    with pytest.raises(DataError):
        ArrayDataset(torch.zeros(3, 1, 2, 2), torch.zeros(4, dtype=torch.int64), 2)


def claim_size(png: Path, width: int, height: int) -> None:
    """Rewrite ``png``'s header to claim ``width`` × ``height`` pixels (a decompression bomb's trick:
    a few hundred bytes whose header announces gigabytes), with a valid header checksum."""
    import struct
    import zlib

    data = bytearray(png.read_bytes())
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    png.write_bytes(bytes(data))


@pytest.mark.parametrize("side", [30000, 9000])
def test_an_image_claiming_huge_dimensions_is_a_data_error_naming_it(tmp_path, side):
    make_folder(tmp_path)
    bomb = tmp_path / "banana" / "img_1.png"
    claim_size(bomb, side, side)
    with pytest.raises(DataError) as info:
        load_dataset("imagefolder", root=str(tmp_path))
    assert str(bomb) in str(info.value) and "8192×8192" in str(info.value)


def test_a_folder_of_one_class_warns_that_accuracy_is_meaningless(tmp_path, caplog):
    make_folder(tmp_path / "only", classes=("apple",))
    with caplog.at_level("WARNING", logger="fedcontrast.data.imagefolder"):
        splits = load_dataset("imagefolder", root=str(tmp_path / "only"), public_fraction=0)
    assert splits.num_classes == 1
    assert any(str(tmp_path / "only") in r.getMessage() and "single class is meaningless" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    # A site's folder under a plan's schema of two classes, holding images of one.
    from fedcontrast.config import DataSchema
    from fedcontrast.data.schema import load_site_splits

    with caplog.at_level("WARNING", logger="fedcontrast.data.imagefolder"):
        load_site_splits(tmp_path / "only", DataSchema((3, 16, 16), ("apple", "banana")), test_fraction=0.25,
                         split_seed=0)
    assert any("is of class 'apple'" in r.getMessage() for r in caplog.records)
    caplog.clear()
    make_folder(tmp_path / "two")
    with caplog.at_level("WARNING", logger="fedcontrast.data.imagefolder"):
        load_dataset("imagefolder", root=str(tmp_path / "two"), test_fraction=0.25)
    assert not caplog.records


def test_train_samples_takes_a_stratified_seeded_sample_of_the_training_split(tmp_path):
    write_mnist_like(tmp_path, gz=True, train=60)  # six of each class
    whole = load_dataset("fashion_mnist", root=str(tmp_path), public_fraction=0)
    sample = load_dataset("fashion_mnist", root=str(tmp_path), public_fraction=0, settings={"train_samples": 20})
    assert len(sample.train) == 20 and torch.equal(torch.bincount(sample.train.y), torch.full((10,), 2))
    assert len(sample.test) == len(whole.test)  # the official test split stays whole
    again = load_dataset("fashion_mnist", root=str(tmp_path), public_fraction=0, settings={"train_samples": 20})
    assert torch.equal(sample.train.x, again.train.x)
    other = load_dataset("fashion_mnist", root=str(tmp_path), public_fraction=0, split_seed=1,
                         settings={"train_samples": 20})
    assert not torch.equal(sample.train.x, other.train.x)
    with pytest.raises(ConfigError, match="exceeds the 60 training images"):
        load_dataset("fashion_mnist", root=str(tmp_path), settings={"train_samples": 61})
    with pytest.raises(ConfigError, match="train_samples must be an integer"):
        load_dataset("fashion_mnist", root=str(tmp_path), settings={"train_samples": 2.5})
