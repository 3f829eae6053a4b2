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
* Work before decode.  The header walk also bounds what decoding costs: a JPEG may
  have at most MAX_JPEG_SCANS scans (a progressive decoder revisits every block of the
  image once per scan, so 400 repeats of a tiny scan take seconds) and
  MAX_JPEG_SEGMENTS marker segments in all (millions of empty comment segments);
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
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Union

import numpy as np

from edgemm.model.errors import DecodeBusy, ImageError
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

# Decode-work bounds, checked by walking the file's structure before decoding. A
# progressive JPEG from libjpeg has 10 scans (6 for grey), mozjpeg's searched scripts
# about 20; each scan costs a pass over every block (~30 ms at 40 MP here).
MAX_JPEG_SCANS = 32
MAX_JPEG_SEGMENTS = 1000  # cameras write a few dozen (APPn, DQT, DHT per scan, SOS)
MAX_CONTAINER_CHUNKS = 100_000  # PNG and WebP chunks walked; encoders write 8-64 KB IDATs
MAX_TIFF_IFDS = 64

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
class _Header:
    """What we learn from a file's header without decoding its pixels."""
    width: int
    height: int
    orientation: int = 1           # EXIF orientation, 1..8
    truncated: str | None = None   # why the file looks cut short, if it does
    channels: int = 4              # what IMREAD_UNCHANGED gives: 1 grey, 3 BGR, 4 BGRA (unknown: 4)
    sample_bytes: int = 1          # bytes per sample of that: 1, 2 (16-bit), 4, 8 (64-bit float)
    extra_bytes: int = 0           # what the decoder holds besides its output (JPEG coefficients, canvases)
    copied: bool = True            # imdecode copies a BGR result (measured: not a progressive JPEG's)


def decode_cost(header: "_Header") -> int:
    """Bytes decoding an image to RGB8 holds at once: the decoder's output (width x height
    x channels x sample_bytes, the bit depth as the header gives it), what the decoder
    keeps besides, the 8-bit copy _to_rgb8 makes of a deeper image, and for grey or
    alpha the RGB8 array it makes. OpenCV 5.0's imdecode holds a BGR result twice
    (8-bit BGR is then swapped to RGB in place, no third copy), and a 16-bit result
    twice under Python 3.10 with NumPy 2.2 (CI's second interpreter). Measured peaks stay
    within 1.25 times this (tests/test_hostile_images.py)."""
    pixels = header.width * header.height
    decoded = pixels * header.channels * header.sample_bytes
    cost = decoded + header.extra_bytes
    if header.copied and (header.channels == 3 or header.sample_bytes > 1):
        cost += decoded  # a deeper image's result is copied too (measured under Python 3.10, numpy 2.2)
    if header.sample_bytes > 1:
        cost += pixels * header.channels  # the 8-bit copy, made while the decoded array still exists
    if header.channels != 3:
        cost += pixels * 3  # grey expanded, or alpha composited over white
    return cost


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
    fmt = _sniff_format(data)
    if fmt is None:
        raise ImageError(f"not a decodable image ({_EXPECTED_FORMATS})")
    header = _HEADER_READERS[fmt](data)
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
_JPEG_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_JPEG_SOS, _JPEG_EOI, _JPEG_APP1 = 0xDA, 0xD9, 0xE1
# After a scan header comes entropy-coded data, in which every 0xFF is followed by 00
# (stuffing) or a restart marker D0-D7: the next other FFxx is the next marker.
_JPEG_NEXT_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")


def _jpeg_header(data: bytes) -> _Header:
    """Walk the marker segments from SOI to EOI, skipping each scan's entropy-coded data.

    Segment lengths let us skip APP payloads, so an EXIF thumbnail's own markers are
    never mistaken for the main image's. The walk counts scans and segments, and
    refuses a file with more than the decoder should be asked to work through.
    """
    size: tuple[int, int] | None = None
    frame = b""  # the SOF payload: precision, size, then (id, sampling factors, table) per component
    progressive = False
    orientation, scans, segments, complete, pos, end = None, 0, 0, False, 2, len(data)
    while pos < end:
        if scans:  # past the first scan header: skip entropy-coded data up to the next marker
            found = _JPEG_NEXT_MARKER.search(data, pos)
            if found is None:
                break
            pos = found.start()
        elif data[pos] != 0xFF:
            break  # garbage where a marker belongs
        while pos + 1 < end and data[pos + 1] == 0xFF:  # fill bytes
            pos += 1
        if pos + 1 >= end:
            break
        marker = data[pos + 1]
        pos += 2
        if marker in _JPEG_STANDALONE:
            continue
        if marker == _JPEG_EOI:
            complete = True
            break
        if pos + 2 > end:
            break
        length = int.from_bytes(data[pos:pos + 2], "big")
        if length < 2:
            break  # a length counts its own two bytes: corrupt
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise ImageError(f"image is refused: JPEG has more than {MAX_JPEG_SEGMENTS} marker segments")
        if marker in _JPEG_SOF and size is None and length >= 7:
            height, width = struct.unpack_from(">HH", data, pos + 3) if pos + 7 <= end else (0, 0)
            size = (width, height)
            frame, progressive = data[pos + 2:pos + length], marker in _JPEG_PROGRESSIVE
        elif marker == _JPEG_APP1 and orientation is None and data.startswith(b"Exif\x00\x00", pos + 2):
            orientation = _exif_orientation(data[pos + 8:pos + length])
        elif marker == _JPEG_SOS:
            scans += 1
            if scans > MAX_JPEG_SCANS:
                raise ImageError(f"image is refused: JPEG has more than {MAX_JPEG_SCANS} scans "
                                 "(a progressive JPEG has about 10)")
        pos += length
    if size is None:
        raise ImageError("image is truncated or corrupt (JPEG has no readable frame header)")
    truncated = None if complete and scans else "JPEG has no end-of-image marker FFD9"
    channels, sample_bytes, extra = _jpeg_memory(size[0], size[1], frame, progressive or scans > 1)
    return _Header(size[0], size[1], orientation or 1, truncated, channels, sample_bytes, extra, copied=not extra)


def _jpeg_memory(width: int, height: int, frame: bytes, whole_image: bool) -> tuple[int, int, int]:
    """(channels, bytes per sample, coefficient bytes) libjpeg holds for this frame.

    A progressive (or multi-scan) JPEG is decoded from a buffer of every block's DCT
    coefficients, 64 int16 per 8x8 block of each component at its own sampling: as
    much again as the 8-bit output for 4:2:0, twice as much for 4:4:4."""
    components = frame[5] if len(frame) > 5 else 3
    channels = 1 if components == 1 else 4 if components == 4 else 3  # CMYK/YCCK: 4, then BGR
    sample_bytes = 2 if frame[:1] and frame[0] > 8 else 1  # 12/16-bit precision
    extra = 0
    if whole_image:
        factors = [frame[6 + 3 * i + 1] for i in range(components) if 6 + 3 * i + 1 < len(frame)]
        h_max = max((f >> 4 for f in factors), default=1) or 1
        v_max = max((f & 15 for f in factors), default=1) or 1
        for f in factors or [0x11] * components:
            blocks_w = -(-width * max(f >> 4, 1) // (8 * h_max))
            blocks_h = -(-height * max(f & 15, 1) // (8 * v_max))
            extra += blocks_w * blocks_h * 128
    return channels, sample_bytes, extra


def _exif_orientation(tiff: bytes) -> int:
    """EXIF Orientation (tag 0x0112) from the TIFF structure in APP1; 1 if absent or garbled."""
    value = _tiff_ifd0(tiff).get(0x0112, 1)
    return value if 1 <= value <= 8 else 1


def _tiff_ifd0(tiff: bytes) -> dict[int, int]:
    """Single SHORT/LONG values of a TIFF structure's first IFD; stops quietly at garbage."""
    values: dict[int, int] = {}
    for ifd in _tiff_ifds(tiff, limit=1):
        for tag, value in ifd:
            values[tag] = value
    return values


# TIFF field types that hold integers, as struct formats: BYTE, SHORT, LONG, SBYTE,
# SSHORT, SLONG, LONG8, SLONG8 (libtiff reads a size from any of them)
_TIFF_INTEGERS = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i", 16: "Q", 17: "q"}


def _tiff_ifds(tiff: bytes, limit: int = MAX_TIFF_IFDS) -> list[list[tuple[int, int]]]:
    """Each IFD of a TIFF structure (the chain from the header, at most `limit`), as its
    (tag, first integer value) entries in file order, repeated tags included. Stops
    quietly at garbage or a loop."""
    endian = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    ifds: list[list[tuple[int, int]]] = []
    if endian is None:
        return ifds
    try:
        magic, offset = struct.unpack_from(endian + "HI", tiff, 2)
        if magic != 42:
            return ifds
        seen: set[int] = set()
        while offset and offset not in seen and len(ifds) < limit:
            seen.add(offset)
            entries: list[tuple[int, int]] = []
            ifds.append(entries)
            (count,) = struct.unpack_from(endian + "H", tiff, offset)
            for entry in range(offset + 2, offset + 2 + 12 * count, 12):
                tag, kind, n = struct.unpack_from(endian + "HHI", tiff, entry)
                fmt = _TIFF_INTEGERS.get(kind)
                if fmt is None or n == 0:
                    continue
                at = entry + 8  # the value sits in the entry if it fits in 4 bytes, else there is its offset
                if struct.calcsize(fmt) * n > 4:
                    (at,) = struct.unpack_from(endian + "I", tiff, at)
                entries.append((tag, struct.unpack_from(endian + fmt, tiff, at)[0]))
            (offset,) = struct.unpack_from(endian + "I", tiff, offset + 2 + 12 * count)
    except struct.error:
        pass
    return ifds


def _png_header(data: bytes) -> _Header:
    """Size from IHDR; then walk the chunks to check that IEND is there, and read eXIf."""
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ImageError("image is truncated or corrupt (PNG has no IHDR header)")
    width, height = struct.unpack_from(">II", data, 16)
    depth, colour = data[24], data[25]
    # IMREAD_UNCHANGED: grey 1 channel, RGB 3, palette 3 (4 with a tRNS chunk: counted as
    # 4), grey+alpha and RGBA 4; 16-bit stays 16-bit
    memory = {"channels": {0: 1, 2: 3}.get(colour, 4), "sample_bytes": 2 if depth == 16 else 1}
    orientation, pos = None, 8
    for _ in range(MAX_CONTAINER_CHUNKS):
        if pos + 8 > len(data):
            return _Header(width, height, orientation or 1, truncated="PNG has no IEND chunk", **memory)
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"eXIf" and orientation is None:
            orientation = _exif_orientation(_without_exif_prefix(data[pos + 8:pos + 8 + length]))
        pos += 12 + length  # length, type, payload, CRC
        if kind == b"IEND":
            truncated = None if pos <= len(data) else "PNG IEND chunk is cut short"
            return _Header(width, height, orientation or 1, truncated=truncated, **memory)
    raise ImageError(f"image is refused: PNG has more than {MAX_CONTAINER_CHUNKS} chunks")


def _without_exif_prefix(exif: bytes) -> bytes:
    """PNG eXIf and WebP EXIF hold the TIFF structure itself; some writers put JPEG's
    'Exif\\0\\0' before it anyway."""
    return exif[6:] if exif.startswith(b"Exif\x00\x00") else exif


def _bmp_header(data: bytes) -> _Header:
    if len(data) < 26:
        raise ImageError("image is truncated or corrupt (BMP header is cut short)")
    (info_size,) = struct.unpack_from("<I", data, 14)
    if info_size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack_from("<HH", data, 18)
        (bits,) = struct.unpack_from("<H", data, 24)
    else:
        width, height = struct.unpack_from("<ii", data, 18)
        (bits,) = struct.unpack_from("<H", data, 28)
    # 32-bit: BGRA; a palette of greys decodes to 1 channel, then RGB: counted as 3 + 1
    extra = width * abs(height) if 0 < bits <= 8 and width > 0 else 0
    return _Header(width, abs(height), channels=4 if bits == 32 else 3, extra_bytes=extra)  # negative height = top-down


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
    orientation = _webp_orientation(data) if chunk == b"VP8X" else 1  # only the extended format has EXIF
    # decoded as BGRA (counted so whatever the alpha flag says); an animation is composed
    # on RGBA canvases of the full canvas size, two of them (measured: 10.5 bytes a pixel)
    animated = chunk == b"VP8X" and bool(data[20] & 0x02)
    return _Header(width, height, orientation, truncated=truncated, channels=4,
                   extra_bytes=8 * width * height if animated else 0)


def _webp_orientation(data: bytes) -> int:
    """EXIF Orientation from an extended WebP's EXIF chunk (RIFF chunks: fourcc, size, payload, pad)."""
    pos = 12
    for _ in range(MAX_CONTAINER_CHUNKS):
        if pos + 8 > len(data):
            break
        kind, length = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if kind == b"EXIF":
            return _exif_orientation(_without_exif_prefix(data[pos + 8:pos + 8 + length]))
        pos += 8 + length + (length & 1)
    return 1


def _tiff_header(data: bytes) -> _Header:
    """The largest width and height any IFD lists, however often it lists them: decoders
    differ on which of two repeated tags counts, and one may decode the 12000x12000 that
    a 16x16 listed after it hides. Tiles count too: each is a buffer of its own."""
    widths, heights = [], []
    bits, samples, palette, strip_rows = 1, 1, False, 0  # the TIFF defaults; the largest any IFD lists counts
    for ifd in _tiff_ifds(data):
        for tag, value in ifd:
            if tag in (256, 322):  # ImageWidth, TileWidth
                widths.append(value)
            elif tag in (257, 323):  # ImageLength, TileLength
                heights.append(value)
            elif tag == 258:  # BitsPerSample (the first sample's: writers repeat one value)
                bits = max(bits, value)
            elif tag == 277:  # SamplesPerPixel
                samples = max(samples, value)
            elif tag == 262 and value == 3:  # PhotometricInterpretation: palette
                palette = True
            elif tag == 278:  # RowsPerStrip
                strip_rows = max(strip_rows, value)
    if not widths or not heights:
        raise ImageError("image is truncated or corrupt (TIFF has no readable size)")
    # OpenCV keeps the depth (8, 16, 32-bit, 64-bit float: SampleFormat only says which
    # kind) and gives 1, 3 or 4 channels; anything else is read as RGBA
    channels = 1 if samples == 1 and not palette else 3 if samples in (1, 3) else max(4, samples)
    sample_bytes = 1 if bits <= 8 else 2 if bits <= 16 else 4 if bits <= 32 else 8
    width, height = max(widths), max(heights)
    # OpenCV reads a strip (or tile) at a time into a buffer of its own: with no
    # RowsPerStrip the strip is the whole image (measured: a one-strip 64-bit TIFF peaks at twice its size)
    rows = min(strip_rows or height, height)
    extra = width * rows * max(channels, samples) * sample_bytes
    return _Header(width, height, channels=channels, sample_bytes=sample_bytes, extra_bytes=extra)


def _gif_header(data: bytes) -> _Header:
    if len(data) < 10:
        raise ImageError("image is truncated or corrupt (GIF header is cut short)")
    width, height = struct.unpack_from("<HH", data, 6)  # logical screen size
    return _Header(width, height, channels=4, extra_bytes=4 * width * height)  # BGRA on a canvas


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
