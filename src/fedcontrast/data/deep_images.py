"""Images deeper than 8 bits, read at their depth: 16-bit greyscale PNG and TIFF (Pillow's modes
``I;16``/``I;16B``/``I;16L`` and ``I`` holding 16-bit samples) and DICOM (through pydicom, the extra
``[dicom]``: greyscale CT and MR of 12 or 16 bits, the file's rescale slope and intercept applied, then
the schema's window or the file's own).

Every image's format is read from its header (:func:`image_format`) — what the schema's report and
the loader show — and a deep image becomes float32 values in [0, 1] at its full precision
(:func:`read_deep`): a 16-bit sample ``v`` is ``v / 65535``, where ``convert('L')`` used to clip every
value above 255. Pillow reads a 16-bit RGB image only to 8 bits per channel (its high byte, ``v >> 8``,
which is the value correctly scaled to 8 bits); such an image is read so and its format says
"read at 8 bits". What cannot be scaled without guessing (floating-point or 32-bit integer images,
colour or multi-frame DICOM) is refused in one sentence naming the file and its format.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError

DICOM_SUFFIXES = frozenset({".dcm", ".dicom"})
_DEEP_GREY = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The most pixels an image may claim in its header (8192 × 8192): a larger one is refused before its
# pixels are decoded (a "decompression bomb" of a few kB can claim 30000 × 30000 and exhaust memory).
MAX_IMAGE_PIXELS = 8192 * 8192


@contextlib.contextmanager
def _open_image(path: Path) -> Iterator:
    """``PIL.Image.open(path)`` (header only), refusing with one :class:`DataError` naming the file an
    image that cannot be read or whose header claims more than :data:`MAX_IMAGE_PIXELS`."""
    from PIL import Image, UnidentifiedImageError  # lazy: only this source needs PIL

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise DataError(f"image {path} claims more than {MAX_IMAGE_PIXELS:,} pixels (at most 8192×8192 is read); "
                        "replace it with a smaller image or remove it.") from None
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataError(f"image {path} cannot be read ({type(err).__name__}); replace or remove it.") from err
    with img:
        width, height = img.size
        if width * height > MAX_IMAGE_PIXELS:
            raise DataError(f"image {path} claims {width}×{height} pixels, more than 8192×8192; replace it with a "
                            "smaller image or remove it.")
        yield img


@dataclass(frozen=True)
class ImageFormat:
    kind: str  # Pillow's mode, or "DICOM MONOCHROME2"
    bits: int  # bits per sample as stored
    channels: int  # 1 (grey) or 3 (colour)
    read_bits: int  # bits per sample as read (8 for everything Pillow converts, 16 for deep greyscale)

    @property
    def deep(self) -> bool:
        return self.read_bits > 8 or self.kind.startswith("DICOM")

    def label(self) -> str:
        text = f"{self.kind} {self.bits}-bit"
        return text + (f" (read at {self.read_bits} bits)" if self.read_bits < min(self.bits, 16) else "")


def _png_depth(path: Path) -> int | None:
    with open(path, "rb") as f:
        head = f.read(33)
    if head[:8] == _PNG_SIGNATURE and head[12:16] == b"IHDR":
        return head[24]
    return None


def _tiff_depth(img) -> int | None:
    tags = getattr(img, "tag_v2", None)
    bits = tags.get(258) if tags is not None else None  # BitsPerSample
    if isinstance(bits, tuple):
        bits = max(bits) if bits else None
    return int(bits) if bits else None


def pil_format(path: Path, img) -> ImageFormat:
    """The format of an image Pillow opened (header only)."""
    mode = img.mode
    depth = _png_depth(path) if path.suffix.lower() == ".png" else _tiff_depth(img)
    if mode == "F":
        raise DataError(f"image {path} holds floating-point samples (Pillow mode F), whose scale is not known; save it "
                        "as an 8- or 16-bit image, or remove it.")
    if mode in _DEEP_GREY:
        bits = 16 if mode.startswith("I;16") else (depth or 32)
        if bits > 16:
            raise DataError(f"image {path} holds {bits}-bit integer samples (Pillow mode {mode}), more than the 16 "
                            "bits read; save it as a 16-bit image, or remove it.")
        return ImageFormat(mode, bits, 1, bits)
    channels = 1 if mode in ("1", "L", "LA") else 3
    bits = 1 if mode == "1" else 8
    if depth == 16 and mode in ("RGB", "RGBA", "LA", "L"):
        bits = 16  # stored at 16 bits, read by Pillow at 8 (its high byte: the value scaled to 8 bits)
    return ImageFormat(mode, bits, channels, 8 if bits > 1 else 1)


def _pydicom():
    try:
        import pydicom
    except ImportError:
        raise DataError("reading DICOM images needs pydicom, which is not installed here: pip install "
                        "'fedcontrast[dicom]'") from None
    return pydicom


def dicom_format(path: Path) -> ImageFormat:
    """A DICOM file's format from its header: greyscale (MONOCHROME1/2), one frame, or one sentence."""
    pydicom = _pydicom()
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True)
    except Exception as exc:  # pydicom's InvalidDicomError, a truncated file
        raise DataError(f"image {path} cannot be read as DICOM ({type(exc).__name__}); replace or remove it.") from None
    photometric = str(ds.get("PhotometricInterpretation", "")).strip()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise DataError(f"DICOM image {path} is {photometric or 'of no photometric interpretation'}: only greyscale "
                        "(MONOCHROME1/2) DICOM is read; convert it or remove it.")
    if int(ds.get("NumberOfFrames", 1) or 1) != 1:
        raise DataError(f"DICOM image {path} holds {ds.NumberOfFrames} frames: one image per file is read; split it "
                        "or remove it.")
    bits = int(ds.get("BitsStored", ds.get("BitsAllocated", 16)) or 16)
    for name in _DICOM_NUMBERS:
        _dicom_number(path, ds, name)
    return ImageFormat(f"DICOM {photometric}", bits, 1, bits)


# The attributes that scale a DICOM image's values (the modality LUT and the VOI window): each must be
# a finite number, else every pixel becomes NaN (0 × inf, NaN × v) or the window is meaningless.
_DICOM_NUMBERS = ("RescaleSlope", "RescaleIntercept", "WindowCenter", "WindowWidth")


def _dicom_number(path: Path, ds, name: str) -> float | None:
    """``ds``'s attribute ``name`` as a finite float (the first of several values), None when absent or
    empty; NaN, an infinity, text that is no number, or a RescaleSlope of 0 (which makes every pixel the
    same) is one :class:`DataError` naming the file and the attribute."""
    raw = ds.get(name)
    if raw is None or raw == "":
        return None
    values = list(raw) if isinstance(raw, (list, tuple)) or type(raw).__name__ == "MultiValue" else [raw]
    if not values:
        return None
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        shown = str(raw)[:40]
        raise DataError(f"DICOM image {path} has {name} {shown!r}, which is not a number; fix the file's header "
                        "or remove it.") from None
    bad = next((v for v in numbers if not np.isfinite(v)), None)
    if bad is not None:
        raise DataError(f"DICOM image {path} has {name} {bad}, which is not a finite number (its pixels would all "
                        "be NaN); fix the file's header or remove it.")
    if name == "RescaleSlope" and numbers[0] == 0:
        raise DataError(f"DICOM image {path} has RescaleSlope 0, which makes every pixel the same value; fix the "
                        "file's header or remove it.")
    return numbers[0]


def image_format(path: Path, opened=None) -> ImageFormat:
    """The format of the image in ``path`` (``opened``: Pillow's image, already opened)."""
    if path.suffix.lower() in DICOM_SUFFIXES:
        return dicom_format(path)
    if opened is None:
        with _open_image(path) as img:
            return pil_format(path, img)
    return pil_format(path, opened)


def _resize(values: np.ndarray, image_size: int) -> np.ndarray:
    """A float image resized as the 8-bit path resizes (Pillow, bilinear), kept in [0, 1]."""
    from PIL import Image

    out = Image.fromarray(np.ascontiguousarray(values, dtype=np.float32), mode="F")
    out = out.resize((image_size, image_size), Image.Resampling.BILINEAR)
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)


def dicom_values(path: Path, window: tuple[float, float] | None) -> np.ndarray:
    """A greyscale DICOM image in [0, 1]: stored values × RescaleSlope + RescaleIntercept (the modality
    LUT: Hounsfield units for CT), then the linear window of DICOM PS3.3 C.11.2.1.2 — ``window`` (the
    schema's), else the file's WindowCenter/WindowWidth, else the stored range — inverted for MONOCHROME1."""
    pydicom = _pydicom()
    fmt = dicom_format(path)
    try:
        ds = pydicom.dcmread(path)
        stored = np.asarray(ds.pixel_array, dtype=np.float64)
    except Exception as exc:  # a compressed transfer syntax without its decoder, truncated pixel data
        raise DataError(f"DICOM image {path}'s pixels cannot be decoded ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); replace or remove it.") from None
    slope = _dicom_number(path, ds, "RescaleSlope")
    slope = 1.0 if slope is None else slope
    intercept = _dicom_number(path, ds, "RescaleIntercept") or 0.0
    values = stored * slope + intercept
    center, width = _dicom_number(path, ds, "WindowCenter"), _dicom_number(path, ds, "WindowWidth")
    if window is None and center is not None and width is not None:
        window = (center, width)
    if window is not None:
        center, width = float(window[0]), max(float(window[1]), 1.0)
        if width == 1:
            scaled = (values > center - 0.5).astype(np.float64)
        else:
            scaled = (values - (center - 0.5)) / (width - 1) + 0.5
    else:  # the range the stored bits can hold, through the rescale
        signed = int(ds.get("PixelRepresentation", 0) or 0) == 1
        low, high = (-(2 ** (fmt.bits - 1)), 2 ** (fmt.bits - 1) - 1) if signed else (0, 2 ** fmt.bits - 1)
        low, high = sorted((low * slope + intercept, high * slope + intercept))
        scaled = (values - low) / (high - low)
    scaled = np.clip(scaled, 0.0, 1.0)
    return 1.0 - scaled if fmt.kind == "DICOM MONOCHROME1" else scaled


def read_deep(path: Path, channels: int, image_size: int, window: tuple[float, float] | None = None) -> np.ndarray:
    """One image as float32 ``(channels, image_size, image_size)`` in [0, 1] at its full depth."""
    if path.suffix.lower() in DICOM_SUFFIXES:
        grey = _resize(dicom_values(path, window), image_size)
    else:
        with _open_image(path) as img:
            fmt = pil_format(path, img)
            samples = np.asarray(img).astype(np.float64)
        top = 2 ** fmt.bits - 1
        if samples.min(initial=0) < 0 or samples.max(initial=0) > top:
            raise DataError(f"image {path} (Pillow mode {fmt.kind}) holds values outside 0…{top} for its {fmt.bits} "
                            "bits; save it as an 8- or 16-bit image, or remove it.")
        grey = _resize(samples / top, image_size)
    if not np.isfinite(grey).all():  # never a NaN or an infinity into training, whatever the format
        raise DataError(f"image {path} decodes to values that are not finite numbers (NaN or infinite); replace or "
                        "remove it.")
    return np.repeat(grey[None], channels, axis=0)
