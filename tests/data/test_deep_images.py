"""Deep images read at their depth through the data schema (issue 34): 16-bit greyscale PNG and TIFF
(a value of 60000 is 60000/65535, where convert('L') clipped 99.5 % of such pixels to 255), 16-bit RGB
read at Pillow's 8 bits and said so, formats and bit depths in the schema's report, and DICOM (CT and
MR from the sample files pydicom's wheel ships, never downloaded) with the rescale slope/intercept
and the window the schema (or the file) gives."""

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from fedcontrast.config import DataSchema
from fedcontrast.data.deep_images import image_format, read_deep
from fedcontrast.data.imagefolder import load_imagefolder_raw
from fedcontrast.data.schema import summarise_folder
from fedcontrast.errors import DataError

SCHEMA = DataSchema((1, 24, 24), ("a", "b"))


def sixteen_bit(seed=0, shape=(24, 24)):
    """Values as a CT or X-ray exporter writes them: most of them far above 255 (up to ~60000)."""
    return np.random.default_rng(seed).integers(0, 60001, shape, dtype=np.uint16)


def folder_of(tmp_path, suffix, arrays):
    for i, array in enumerate(arrays):
        (tmp_path / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(tmp_path / "ab"[i % 2] / f"{i}{suffix}")
    return tmp_path


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_16_bit_greyscale_is_read_at_its_depth(tmp_path, suffix):
    arrays = [sixteen_bit(i) for i in range(4)]
    root = folder_of(tmp_path, suffix, arrays)
    assert Image.open(root / "a" / f"0{suffix}").mode == "I;16"
    raw = load_imagefolder_raw(str(root), 24, class_names=SCHEMA.classes, channels=1)
    assert raw.train_x.dtype == np.float32
    by_name = sorted((p for p in root.rglob(f"*{suffix}")), key=lambda p: (p.parent.name, p.name))
    for i, path in enumerate(by_name):
        expected = arrays[int(path.stem)].astype(np.float64) / 65535
        np.testing.assert_allclose(raw.train_x[i, 0], expected, atol=1e-6)
    assert (raw.train_x >= 254 / 255).mean() == 0  # not saturated (convert("L") made ~99.6 % of these pixels 255)
    summary = summarise_folder(root, SCHEMA)
    assert summary.formats == {"I;16 16-bit": 4} and summary.formats_text() == "I;16 16-bit ×4"


def test_16_bit_rgb_is_read_at_8_bits_and_says_so(tmp_path):
    """Pillow reads 48-bit RGB PNGs as 8-bit RGB (the high byte: v >> 8, the value scaled to 8 bits)."""
    values = sixteen_bit(1, (6, 6, 3))
    rows = b"".join(b"\0" + values[r].astype(">u2").tobytes() for r in range(6))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path = tmp_path / "rgb16.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 6, 6, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    fmt = image_format(path)
    assert fmt.label() == "RGB 16-bit (read at 8 bits)" and fmt.channels == 3 and not fmt.deep
    with Image.open(path) as img:
        np.testing.assert_array_equal(np.asarray(img), values >> 8)


def test_images_whose_scale_is_unknown_are_refused_in_one_sentence(tmp_path):
    path = tmp_path / "f.tif"
    Image.fromarray(np.ones((8, 8), np.float32), "F").save(path)
    with pytest.raises(DataError, match=r"image .*f.tif holds floating-point samples \(Pillow mode F\)"):
        image_format(path)
    path = tmp_path / "i32.tif"
    Image.fromarray(np.full((8, 8), 70000, np.int32), "I").save(path)
    with pytest.raises(DataError, match=r"holds 32-bit integer samples \(Pillow mode I\), more than the 16 bits read"):
        image_format(path)


def dicom_sample(name):
    pydicom = pytest.importorskip("pydicom")
    from pydicom.data import get_testdata_file

    path = get_testdata_file(name, download=False)  # shipped inside the wheel: nothing is downloaded
    assert path is not None, f"{name} is not in pydicom's wheel"
    return pydicom, path


def window(values, center, width):
    """DICOM PS3.3 C.11.2.1.2.1's linear window, to [0, 1], computed independently with numpy."""
    low, high = center - 0.5 - (width - 1) / 2, center - 0.5 + (width - 1) / 2
    out = ((values - (center - 0.5)) / (width - 1) + 0.5)
    return np.where(values <= low, 0.0, np.where(values > high, 1.0, out))


def test_dicom_ct_in_hounsfield_units_with_the_schemas_window(tmp_path):
    pydicom, path = dicom_sample("CT_small.dcm")
    ds = pydicom.dcmread(path)
    assert ds.BitsStored == 16 and float(ds.RescaleIntercept) == -1024  # stored values, then Hounsfield units
    hounsfield = ds.pixel_array.astype(np.float64) * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
    got = read_deep(__import__("pathlib").Path(path), 1, 128, window=(40, 400))  # the schema's soft-tissue window
    np.testing.assert_allclose(got[0], window(hounsfield, 40, 400), atol=1e-6)
    assert 0 < got.mean() < 1 and got.min() == 0 and got.max() == 1  # air clipped to 0, bone to 1
    assert image_format(__import__("pathlib").Path(path)).label() == "DICOM MONOCHROME2 16-bit"


def test_dicom_mr_with_its_own_window_through_the_schema(tmp_path):
    import shutil

    pydicom, path = dicom_sample("MR_small.dcm")
    ds = pydicom.dcmread(path)
    assert (float(ds.WindowCenter), float(ds.WindowWidth)) == (600, 1600)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        shutil.copy(path, tmp_path / cls / "mr.dcm")
    schema = DataSchema((1, 64, 64), ("a", "b"))  # no window: the file's own
    summary = summarise_folder(tmp_path, schema)
    assert summary.formats == {"DICOM MONOCHROME2 16-bit": 2}
    raw = load_imagefolder_raw(str(tmp_path), 64, class_names=schema.classes, channels=1, window=schema.window)
    np.testing.assert_allclose(raw.train_x[0, 0], window(ds.pixel_array.astype(np.float64), 600, 1600), atol=1e-6)
    (tmp_path / "b" / "mr.dcm").write_bytes(b"not dicom")
    with pytest.raises(DataError, match=r"image .*mr.dcm cannot be read as DICOM"):
        summarise_folder(tmp_path, schema)


def tiny_dicom(path, **numbers):
    """A tiny 8×8 greyscale DICOM written here (pydicom only), with the given decimal-string attributes
    (RescaleSlope, WindowWidth …) set verbatim, NaN and infinities included."""
    pydicom = pytest.importorskip("pydicom")
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.2"
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Rows = ds.Columns = 8
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.PixelData = (np.arange(64, dtype=np.uint16) * 50).tobytes()
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")  # pydicom warns about the invalid values written on purpose
        for name, value in numbers.items():
            ds.add_new(name, "DS", value)
        ds.save_as(path, enforce_file_format=True)
    return pydicom


@pytest.mark.parametrize("name,value", [("RescaleSlope", "NaN"), ("RescaleSlope", "inf"),
                                        ("RescaleIntercept", "-inf"), ("WindowCenter", "nan"),
                                        ("WindowWidth", "Infinity"), ("RescaleSlope", "0")])
def test_dicom_whose_scaling_is_not_finite_is_refused_at_join_and_at_load(tmp_path, name, value):
    """Issue 46: a NaN or infinite RescaleSlope/RescaleIntercept/WindowCenter/WindowWidth was accepted at
    join (the schema's summary) and loaded as an all-NaN image; now one sentence names the file and attribute."""
    import warnings

    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        numbers = {"WindowCenter": "100", "WindowWidth": "400"} if name.startswith("Window") else {}
        tiny_dicom(tmp_path / cls / "ok.dcm")
        tiny_dicom(tmp_path / cls / "bad.dcm", **{**numbers, name: value})
    schema = DataSchema((1, 8, 8), ("a", "b"))
    pattern = rf"DICOM image .*bad\.dcm has {name} "
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DataError, match=pattern):
            summarise_folder(tmp_path, schema)  # what site join checks
        with pytest.raises(DataError, match=pattern):
            read_deep(tmp_path / "a" / "bad.dcm", 1, 8)
        with pytest.raises(DataError, match=pattern):
            load_imagefolder_raw(str(tmp_path), 8, class_names=schema.classes, channels=1)
        (tmp_path / "a" / "bad.dcm").unlink()
        (tmp_path / "b" / "bad.dcm").unlink()
        raw = load_imagefolder_raw(str(tmp_path), 8, class_names=schema.classes, channels=1)
    assert np.isfinite(raw.train_x).all() and 0 < raw.train_x.mean() < 1


def test_every_decoded_image_is_checked_for_finiteness(tmp_path, monkeypatch):
    """Whatever a reader decodes, a NaN never reaches training: one sentence names the file."""
    from fedcontrast.data import deep_images

    path = tmp_path / "x.png"
    Image.fromarray(sixteen_bit(0, (8, 8))).save(path)
    monkeypatch.setattr(deep_images, "_resize", lambda values, size: np.full((size, size), np.nan, np.float32))
    with pytest.raises(DataError, match=r"image .*x\.png decodes to values that are not finite"):
        read_deep(path, 1, 8)
