"""User image → RGB8 array, with a clear one-line refusal for anything we won't decode.

Every image a user hands the runtime (a path, raw bytes, or an array) comes through
`load_image`, which returns an RGB uint8 (H, W, 3) C-contiguous array or raises
`ImageError`, whose message is meant to be shown to the user as is.

Why it is more than `cv2.imdecode`:

* EXIF orientation.  Phone cameras store the sensor's pixels unrotated and put the
  rotation in the EXIF Orientation tag (JPEG APP1, PNG eXIf chunk, WebP EXIF chunk).  We decode with IMREAD_UNCHANGED (so
  16-bit and alpha survive), which ignores that tag, so we read it ourselves and
  rotate; otherwise a portrait photo reaches the model lying on its side.
* Size check before decode.  A few kilobytes of PNG or JPEG can declare a
  100000 x 100000 image (a "decompression bomb"); decoding it would take the device's
  memory.  We read width and height from the file header and refuse images above
  `max_pixels` before any pixel is decoded.  That is why only formats whose header we
  parse (JPEG, PNG, BMP, WebP, TIFF, GIF) are accepted: OpenCV's reduced-size probe
  (IMREAD_REDUCED_*) only decodes at reduced scale for JPEG; other formats are decoded
  at full size first, so it is no protection.
* Work before decode.  The header walk (edgemm/model/image_header.py) also bounds
  what decoding costs: a JPEG may have at most MAX_JPEG_SCANS scans (a progressive
  decoder revisits every block of the image once per scan, so 400 repeats of a tiny
  scan take seconds) and MAX_JPEG_SEGMENTS marker segments in all (millions of empty comment segments);
  a TIFF's size is the largest width and height any of its IFDs lists, however often
  (libtiff and our reader need not agree on which of two repeated tags counts).
* Only regular files.  A path is `stat`-ed before it is opened: a FIFO, a device or a
  socket is refused at once (open() on a FIFO blocks, /dev/zero never ends), and so
  is a file above `max_bytes`; the file is then opened with O_NONBLOCK and read at
  most `max_bytes` + 1 bytes, so a path swapped in between changes nothing.
* Truncation.  An upload cut short often still "decodes" (libjpeg pads the missing
  rows with grey).  We refuse a JPEG with no end-of-image marker after its image data
  and a PNG with no IEND chunk, so a half-grey picture never reaches the model.
  Bytes after a JPEG's end-of-image marker (zero padding, or the video that "motion
  photos" append) are allowed.

Alpha is composited over white, not dropped: fully transparent pixels often hold
arbitrary colour (commonly black), and dark content on a transparent background
(logos, diagrams, text) is meant to be seen on a light page, as viewers show it.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Union

import numpy as np

from edgemm.model.errors import DecodeBusy, ImageError
from edgemm.model.image_header import decode_cost, read_header, sniff_format
from edgemm.util.files import check_regular_file, read_regular_file
from edgemm.util.opencv import cv2

# 25 MP: a 24 MP phone photo (5712x4284) fits; the model never sees more than 4096 px a
# side (edgemm.model.tiling), so larger images only cost decode time and memory
DEFAULT_MAX_PIXELS = 25_000_000
DEFAULT_MAX_BYTES = 50 * 1024 * 1024  # limits.max_image_bytes' default
# limits.max_decoded_bytes' default: what decoding one image may hold at once (see
# decode_cost). 144 MiB takes a 24 MP 8-bit photo (5712x4284: 147 MB), a 12 MP RGBA PNG
# (84 MB) or a 16-bit 8 MP RGB PNG, and keeps a daemon's peak within 2 x its idle RSS
# (~155 MB); the pixel limit alone let a 16-bit RGBA 40 MP PNG take 956 MB.
DEFAULT_MAX_DECODED_BYTES = 144 * 1024 * 1024

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray]

_EXPECTED_FORMATS = "expected JPEG, PNG, BMP, WebP, TIFF or GIF"
_ARRAY_LAYOUTS = "(H, W) grey, (H, W, 1) grey, (H, W, 3) RGB or (H, W, 4) RGBA"
_ARRAY_DTYPES = "uint8, uint16 or float in [0, 1]"


def load_image(source: ImageSource, max_pixels: int = DEFAULT_MAX_PIXELS,
               max_bytes: int = DEFAULT_MAX_BYTES, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
               budget: "DecodeBudget | None" = None) -> np.ndarray:
    """Return an RGB uint8 array (H, W, 3), C-contiguous, never a view of `source`.

    `source` is a file path, the encoded file's bytes, or a pixel array (arrays are
    taken as RGB/RGBA, not OpenCV's BGR).  A path must name a regular file of at most
    `max_bytes`; an encoded image whose decode_cost is above `max_decoded_bytes` is
    refused from its header.  `budget`, if given, is shared with other threads'
    decodes: the decode holds its cost there, and DecodeBusy is raised at once if
    it does not fit beside theirs.  Raises ImageError for anything unusable.
    """
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    if isinstance(source, np.ndarray):  # (nothing to decode: no decode limits to build)
        return _from_array(source, max_pixels)
    limits = _Limits(max_pixels, max_decoded_bytes, budget)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(source), limits)
    if isinstance(source, (str, os.PathLike)):
        return _from_path(source, limits, max_bytes)
    raise ImageError(f"unsupported image input of type {type(source).__name__} "
                     "(expected a file path, the file's bytes, or a numpy array)")


# --- paths ---------------------------------------------------------------------------

def _from_path(path: str | os.PathLike, limits: "_Limits", max_bytes: int) -> np.ndarray:
    shown = os.fsdecode(path)
    data = read_image_file(path, max_bytes)
    try:
        return _from_bytes(data, limits)
    except ImageError as e:
        raise ImageError(f"{e}: {shown}") from None


def check_image_file(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """The size of the regular file at `path`; ImageError, without opening it, for
    anything else (missing, a FIFO, a device, a socket, a directory, above `max_bytes`)."""
    if not os.fsdecode(path):
        raise ImageError("image path is empty")
    return check_regular_file(path, max_bytes, _image_error(path), "limits.max_image_bytes")


def read_image_file(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` of them (see check_image_file:
    read_regular_file makes the same check before it opens the file)."""
    return read_regular_file(path, max_bytes, _image_error(path), "limits.max_image_bytes")


def _image_error(path: str | os.PathLike):
    shown = os.fsdecode(path)
    return lambda detail: ImageError(f"image {detail}: {shown}")


# --- encoded bytes -------------------------------------------------------------------

@dataclass
class _Limits:
    max_pixels: int
    max_decoded_bytes: int
    budget: "DecodeBudget | None" = None


class DecodeBudget:
    """Bytes that all decodes in flight may hold together (limits.decode_budget_bytes).

    A decode that does not fit beside the others is refused at once (DecodeBusy) rather
    than waiting: a waiting decode would hold its prepare thread, and a small image
    behind it would then wait for both. Thread-safe."""

    def __init__(self, total: int):
        self.total, self.held = total, 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, cost: int) -> Iterator[None]:
        with self._lock:
            if self.held + cost > self.total:
                busy = self.held
                raise DecodeBusy(f"server busy: decoding this image needs {_mb(cost)} MB, and images being "
                                 f"decoded hold {_mb(busy)} MB of the {_mb(self.total)} MB budget "
                                 "(limits.decode_budget_bytes); try again shortly")
            self.held += cost
        try:
            yield
        finally:
            with self._lock:
                self.held -= cost


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


def _from_bytes(data: bytes, limits: _Limits) -> np.ndarray:
    if not data:
        raise ImageError("image is empty (0 bytes)")
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageError(f"not a decodable image ({_EXPECTED_FORMATS})")
    header = read_header(data, fmt)
    if header.width <= 0 or header.height <= 0:
        size = f"{header.width}x{header.height}"
        raise ImageError(f"image is truncated or corrupt ({fmt} header gives size {size})")
    _check_pixels(header.width, header.height, limits.max_pixels)
    cost = decode_cost(header)
    if cost > limits.max_decoded_bytes:
        depth = f"{header.channels} x {8 * header.sample_bytes}-bit"
        raise ImageError(f"image is refused: decoding this {header.width}x{header.height} {fmt} "
                         f"({depth} samples) takes {_mb(cost)} MB, above the "
                         f"{_mb(limits.max_decoded_bytes)} MB limit (limits.max_decoded_bytes)")
    if header.truncated:
        raise ImageError(f"image is truncated or corrupt ({header.truncated})")
    with limits.budget.hold(cost) if limits.budget else nullcontext():
        rgb = _apply_orientation(_to_rgb8(_decode(data, fmt), bgr=True), header.orientation)
        _check_pixels(rgb.shape[1], rgb.shape[0], limits.max_pixels)  # in case the header lied
        return np.ascontiguousarray(rgb)


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {_mp(width * height)} MP, "
                         f"above the {_mp(max_pixels)} MP limit (limits.max_pixels)")


def _mp(pixels: int) -> str:
    mp = pixels / 1e6
    return f"{mp:.1f}" if mp >= 0.1 else f"{mp:.2g}"


def _decode(data: bytes, fmt: str) -> np.ndarray:
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error:
        img = None
    if img is None or img.size == 0:
        raise ImageError(f"image is truncated or corrupt ({fmt} data could not be decoded)")
    return img


# --- pixels --------------------------------------------------------------------------

def _from_array(a: np.ndarray, max_pixels: int) -> np.ndarray:
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (1, 3, 4))):
        raise ImageError(f"image array has shape {a.shape}; expected {_ARRAY_LAYOUTS}")
    if a.size == 0:
        raise ImageError(f"image array is empty (shape {a.shape})")
    if a.dtype not in (np.uint8, np.uint16) and a.dtype.kind != "f":
        raise ImageError(f"image array has dtype {a.dtype}; expected {_ARRAY_DTYPES}")
    _check_pixels(a.shape[1], a.shape[0], max_pixels)
    return np.ascontiguousarray(_to_rgb8(a, bgr=False))


def _to_rgb8(a: np.ndarray, bgr: bool) -> np.ndarray:
    """uint8/uint16/float grey, RGB(A) or BGR(A) → a new RGB uint8 array."""
    a = _to_uint8(a)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 2:
        return cv2.cvtColor(np.ascontiguousarray(a), cv2.COLOR_GRAY2RGB)
    if a.ndim == 3 and a.shape[2] == 3:
        if bgr and a.flags.writeable:  # the decoder's own array: swap in place
            return _swap_red_blue(a)
        return a[:, :, ::-1].copy() if bgr else a.copy()
    if a.ndim == 3 and a.shape[2] == 4:
        rgb = a[:, :, 2::-1] if bgr else a[:, :, :3]
        return _over_white(rgb, a[:, :, 3])
    raise ImageError(f"unsupported image layout {a.shape}; expected grey, RGB or RGBA")


def _to_uint8(a: np.ndarray) -> np.ndarray:
    """Scale to 8 bits with rounding: 16-bit by 255/65535, float [0, 1] by 255."""
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.uint16:
        return cv2.convertScaleAbs(a, alpha=255 / 65535)  # rounds and saturates, no big temporaries
    if a.dtype.kind == "f":
        lo, hi = float(a.min()), float(a.max())
        if not (0.0 <= lo and hi <= 1.0):  # also catches NaN
            raise ImageError(f"float image values must be in [0, 1], got range [{lo:g}, {hi:g}]")
        # float64 as it is: a float32 copy of a 64-bit TIFF would be half as big again
        return cv2.convertScaleAbs(a if a.dtype == np.float64 else a.astype(np.float32, copy=False), alpha=255)
    raise ImageError(f"unsupported pixel type {a.dtype}; expected {_ARRAY_DTYPES}")


def _swap_red_blue(bgr: np.ndarray) -> np.ndarray:
    """BGR → RGB in place, a band of rows at a time: a copy (cvtColor copies its source
    when asked to write over it) would double the peak of every large 8-bit image."""
    for top in range(0, bgr.shape[0], _OVER_WHITE_ROWS):
        band = bgr[top:top + _OVER_WHITE_ROWS]
        blue = band[:, :, 0].copy()
        band[:, :, 0] = band[:, :, 2]
        band[:, :, 2] = blue
    return bgr


_OVER_WHITE_ROWS = 256  # rows composited at once: the uint16 temporaries stay a few MB


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Composite 8-bit colour over white: (c·a + 255·(255 − a)) / 255, rounded.

    In bands of rows: done on the whole image at once, the uint16 temporaries were 4
    times the 8-bit image (a 40 MP RGBA PNG peaked at 800 MB)."""
    out = np.empty(rgb.shape, np.uint8)
    for top in range(0, rgb.shape[0], _OVER_WHITE_ROWS):
        rows = slice(top, top + _OVER_WHITE_ROWS)
        a = alpha[rows, :, None].astype(np.uint16)
        band = rgb[rows].astype(np.uint16) * a + 255 * (255 - a) + 127  # at most 65152: fits uint16
        out[rows] = band // 255
    return out


def _apply_orientation(rgb: np.ndarray, orientation: int) -> np.ndarray:
    """Turn stored pixels into the upright image the EXIF Orientation tag describes."""
    if orientation == 2:  # mirror horizontal
        return rgb[:, ::-1]
    if orientation == 3:  # rotate 180
        return rgb[::-1, ::-1]
    if orientation == 4:  # mirror vertical
        return rgb[::-1]
    if orientation == 5:  # transpose (mirror across the main diagonal)
        return rgb.transpose(1, 0, 2)
    if orientation == 6:  # rotate 90 clockwise
        return np.rot90(rgb, k=-1)
    if orientation == 7:  # transverse (mirror across the anti-diagonal)
        return rgb[::-1, ::-1].transpose(1, 0, 2)
    if orientation == 8:  # rotate 90 counter-clockwise
        return np.rot90(rgb, k=1)
    return rgb
