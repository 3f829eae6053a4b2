"""User image → RGB8 array, with a clear one-line refusal for anything we won't decode.

Every image a user hands the runtime (a path, raw bytes, or an array) comes through
`load_image`, which returns an RGB uint8 (H, W, 3) C-contiguous array or raises
`ImageError`, whose message is meant to be shown to the user as is.

Why it is more than `cv2.imdecode`:

* EXIF orientation.  Phone cameras store the sensor's pixels unrotated and put the
  rotation in the JPEG's EXIF Orientation tag.  We decode with IMREAD_UNCHANGED (so
  16-bit and alpha survive), which ignores that tag, so we read it ourselves and
  rotate; otherwise a portrait photo reaches the model lying on its side.
* Size check before decode.  A few kilobytes of PNG or JPEG can declare a
  100000 x 100000 image (a "decompression bomb"); decoding it would take the device's
  memory.  We read width and height from the file header and refuse images above
  `max_pixels` before any pixel is decoded.  That is why only formats whose header we
  parse (JPEG, PNG, BMP, WebP, TIFF, GIF) are accepted: OpenCV's reduced-size probe
  (IMREAD_REDUCED_*) only decodes at reduced scale for JPEG; other formats are decoded
  at full size first, so it is no protection.
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
import struct
from dataclasses import dataclass
from typing import Union

import numpy as np

from edgemm.errors import InputError
from edgemm.opencv import cv2

DEFAULT_MAX_PIXELS = 40_000_000

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview, np.ndarray]

_EXPECTED_FORMATS = "expected JPEG, PNG, BMP, WebP, TIFF or GIF"
_ARRAY_LAYOUTS = "(H, W) grey, (H, W, 1) grey, (H, W, 3) RGB or (H, W, 4) RGBA"
_ARRAY_DTYPES = "uint8, uint16 or float in [0, 1]"


class ImageError(InputError):
    """Bad image input; str(e) is a clear one-line message for the user."""


def load_image(source: ImageSource, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Return an RGB uint8 array (H, W, 3), C-contiguous, never a view of `source`.

    `source` is a file path, the encoded file's bytes, or a pixel array (arrays are
    taken as RGB/RGBA, not OpenCV's BGR).  Raises ImageError for anything unusable.
    """
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    if isinstance(source, np.ndarray):
        return _from_array(source, max_pixels)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(source), max_pixels)
    if isinstance(source, (str, os.PathLike)):
        return _from_path(source, max_pixels)
    raise ImageError(f"unsupported image input of type {type(source).__name__} "
                     "(expected a file path, the file's bytes, or a numpy array)")


# --- paths ---------------------------------------------------------------------------

def _from_path(path: str | os.PathLike, max_pixels: int) -> np.ndarray:
    shown = os.fsdecode(path)
    data = _read_file(path, shown)
    try:
        return _from_bytes(data, max_pixels)
    except ImageError as e:
        raise ImageError(f"{e}: {shown}") from None


def _read_file(path: str | os.PathLike, shown: str) -> bytes:
    if not shown:
        raise ImageError("image path is empty")
    if os.path.isdir(path):
        raise ImageError(f"image path is a directory, not a file: {shown}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ImageError(f"image not found: {shown}") from None
    except PermissionError:
        raise ImageError(f"image not readable (permission denied): {shown}") from None
    except (OSError, ValueError) as e:  # ValueError: e.g. a NUL byte in the path
        reason = getattr(e, "strerror", None) or str(e)
        raise ImageError(f"image not readable ({reason}): {shown}") from None


# --- encoded bytes -------------------------------------------------------------------

@dataclass
class _Header:
    """What we learn from a file's header without decoding its pixels."""
    width: int
    height: int
    orientation: int = 1           # EXIF orientation, 1..8
    truncated: str | None = None   # why the file looks cut short, if it does


def _from_bytes(data: bytes, max_pixels: int) -> np.ndarray:
    if not data:
        raise ImageError("image is empty (0 bytes)")
    fmt = _sniff_format(data)
    if fmt is None:
        raise ImageError(f"not a decodable image ({_EXPECTED_FORMATS})")
    header = _HEADER_READERS[fmt](data)
    if header.width <= 0 or header.height <= 0:
        size = f"{header.width}x{header.height}"
        raise ImageError(f"image is truncated or corrupt ({fmt} header gives size {size})")
    _check_pixels(header.width, header.height, max_pixels)
    if header.truncated:
        raise ImageError(f"image is truncated or corrupt ({header.truncated})")
    rgb = _apply_orientation(_to_rgb8(_decode(data, fmt), bgr=True), header.orientation)
    _check_pixels(rgb.shape[1], rgb.shape[0], max_pixels)  # in case the header lied
    return np.ascontiguousarray(rgb)


def _sniff_format(data: bytes) -> str | None:
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"BM"):
        return "BMP"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None


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


# --- headers -------------------------------------------------------------------------

# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: no length
_JPEG_SOS, _JPEG_EOI, _JPEG_APP1 = 0xDA, 0xD9, 0xE1


def _jpeg_header(data: bytes) -> _Header:
    """Walk the marker segments from SOI to the first scan (SOS).

    Segment lengths let us skip APP payloads, so an EXIF thumbnail's own markers
    are never mistaken for the main image's.
    """
    size: tuple[int, int] | None = None
    orientation, scan_start, pos = 1, None, 2
    while scan_start is None and pos + 4 <= len(data) and data[pos] == 0xFF:
        while pos < len(data) - 1 and data[pos + 1] == 0xFF:  # fill bytes
            pos += 1
        marker = data[pos + 1]
        pos += 2
        if marker in _JPEG_STANDALONE:
            continue
        if marker == _JPEG_EOI:
            break
        length = int.from_bytes(data[pos:pos + 2], "big")
        segment = data[pos + 2:pos + length]
        if marker in _JPEG_SOF and size is None and len(segment) >= 5:
            height, width = struct.unpack_from(">HH", segment, 1)
            size = (width, height)
        elif marker == _JPEG_APP1 and segment.startswith(b"Exif\x00\x00"):
            orientation = _exif_orientation(segment[6:])
        elif marker == _JPEG_SOS:
            scan_start = pos + length
        pos += max(length, 2)
    if size is None:
        raise ImageError("image is truncated or corrupt (JPEG has no readable frame header)")
    # Entropy-coded data escapes every 0xFF, so an FFD9 after the scan starts is the EOI.
    complete = scan_start is not None and data.find(b"\xff\xd9", scan_start) >= 0
    truncated = None if complete else "JPEG has no end-of-image marker FFD9"
    return _Header(size[0], size[1], orientation, truncated)


def _exif_orientation(tiff: bytes) -> int:
    """EXIF Orientation (tag 0x0112) from the TIFF structure in APP1; 1 if absent or garbled."""
    value = _tiff_ifd0(tiff).get(0x0112, 1)
    return value if 1 <= value <= 8 else 1


def _tiff_ifd0(tiff: bytes) -> dict[int, int]:
    """Single SHORT/LONG values of a TIFF structure's first IFD; stops quietly at garbage."""
    endian = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    values: dict[int, int] = {}
    if endian is None:
        return values
    try:
        magic, ifd = struct.unpack_from(endian + "HI", tiff, 2)
        if magic != 42:
            return values
        (count,) = struct.unpack_from(endian + "H", tiff, ifd)
        for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
            tag, kind, n = struct.unpack_from(endian + "HHI", tiff, entry)
            if n == 1 and kind in (3, 4):  # SHORT, LONG: the value sits in the entry
                value_format = endian + ("H" if kind == 3 else "I")
                values[tag] = struct.unpack_from(value_format, tiff, entry + 8)[0]
    except struct.error:
        pass
    return values


def _png_header(data: bytes) -> _Header:
    """Size from IHDR; then walk the chunks to check that IEND is there."""
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ImageError("image is truncated or corrupt (PNG has no IHDR header)")
    width, height = struct.unpack_from(">II", data, 16)
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        pos += 12 + length  # length, type, payload, CRC
        if kind == b"IEND":
            truncated = None if pos <= len(data) else "PNG IEND chunk is cut short"
            return _Header(width, height, truncated=truncated)
    return _Header(width, height, truncated="PNG has no IEND chunk")


def _bmp_header(data: bytes) -> _Header:
    if len(data) < 26:
        raise ImageError("image is truncated or corrupt (BMP header is cut short)")
    (info_size,) = struct.unpack_from("<I", data, 14)
    if info_size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack_from("<HH", data, 18)
    else:
        width, height = struct.unpack_from("<ii", data, 18)
    return _Header(width, abs(height))  # negative height = rows stored top-down


def _webp_header(data: bytes) -> _Header:
    chunk, payload = data[12:16], data[20:30]
    if chunk == b"VP8X" and len(payload) >= 10:  # extended: canvas size minus one, 24-bit
        width = 1 + int.from_bytes(payload[4:7], "little")
        height = 1 + int.from_bytes(payload[7:10], "little")
    elif chunk == b"VP8L" and len(payload) >= 5 and payload[0] == 0x2F:  # lossless: 14-bit fields
        bits = int.from_bytes(payload[1:5], "little")
        width, height = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    elif chunk == b"VP8 " and len(payload) >= 10 and payload[3:6] == b"\x9d\x01\x2a":  # lossy
        width, height = (v & 0x3FFF for v in struct.unpack_from("<HH", payload, 6))
    else:
        raise ImageError("image is truncated or corrupt (WebP has no readable size)")
    (riff_size,) = struct.unpack_from("<I", data, 4)
    truncated = "WebP is shorter than its RIFF size" if len(data) < 8 + riff_size else None
    return _Header(width, height, truncated=truncated)


def _tiff_header(data: bytes) -> _Header:
    ifd0 = _tiff_ifd0(data)
    if 256 not in ifd0 or 257 not in ifd0:  # ImageWidth, ImageLength
        raise ImageError("image is truncated or corrupt (TIFF has no readable size)")
    return _Header(ifd0[256], ifd0[257])


def _gif_header(data: bytes) -> _Header:
    if len(data) < 10:
        raise ImageError("image is truncated or corrupt (GIF header is cut short)")
    width, height = struct.unpack_from("<HH", data, 6)  # logical screen size
    return _Header(width, height)


_HEADER_READERS = {"JPEG": _jpeg_header, "PNG": _png_header, "BMP": _bmp_header,
                   "WebP": _webp_header, "TIFF": _tiff_header, "GIF": _gif_header}


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
        return cv2.convertScaleAbs(a.astype(np.float32, copy=False), alpha=255)
    raise ImageError(f"unsupported pixel type {a.dtype}; expected {_ARRAY_DTYPES}")


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Composite 8-bit colour over white: (c·a + 255·(255 − a)) / 255, rounded."""
    a = alpha[:, :, None].astype(np.uint16)
    out = rgb.astype(np.uint16) * a + 255 * (255 - a) + 127  # at most 65152: fits uint16
    return (out // 255).astype(np.uint8)


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
