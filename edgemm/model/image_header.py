"""What an image file's header says, read without decoding a pixel: its format, size,
EXIF orientation, whether it is cut short, and what decoding it would cost.

edgemm.model.image checks its limits against this before it lets OpenCV decode anything:
the pixels (a few KB of PNG or JPEG can declare 100000 x 100000), the memory the decode
holds (`decode_cost`), and the work a JPEG asks of the decoder (at most MAX_JPEG_SCANS
scans and MAX_JPEG_SEGMENTS marker segments). Only the formats read here are accepted:
JPEG, PNG, BMP, WebP, TIFF and GIF.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from edgemm.model.errors import ImageError

# Decode-work bounds, checked by walking the file's structure before decoding. A
# progressive JPEG from libjpeg has 10 scans (6 for grey), mozjpeg's searched scripts
# about 20; each scan costs a pass over every block (~30 ms at 40 MP here).
MAX_JPEG_SCANS = 32
MAX_JPEG_SEGMENTS = 1000  # cameras write a few dozen (APPn, DQT, DHT per scan, SOS)
MAX_CONTAINER_CHUNKS = 100_000  # PNG and WebP chunks walked; encoders write 8-64 KB IDATs
MAX_TIFF_IFDS = 64


@dataclass
class ImageHeader:
    """What we learn from a file's header without decoding its pixels."""
    width: int
    height: int
    orientation: int = 1           # EXIF orientation, 1..8
    truncated: str | None = None   # why the file looks cut short, if it does
    channels: int = 4              # what IMREAD_UNCHANGED gives: 1 grey, 3 BGR, 4 BGRA (unknown: 4)
    sample_bytes: int = 1          # bytes per sample of that: 1, 2 (16-bit), 4, 8 (64-bit float)
    extra_bytes: int = 0           # what the decoder holds besides its output (JPEG coefficients, canvases)
    copied: bool = True            # imdecode copies a BGR result (measured: not a progressive JPEG's)


def decode_cost(header: ImageHeader) -> int:
    """Bytes decoding an image to RGB8 holds at once: the decoder's output (width x height
    x channels x sample_bytes, the bit depth as the header gives it), what the decoder
    keeps besides, the 8-bit copy edgemm.model.image makes of a deeper image, and for grey or
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


def sniff_format(data: bytes) -> str | None:
    """The format of an encoded image, from its first bytes; None for one not read here."""
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


# --- headers -------------------------------------------------------------------------

# SOFn markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: no length
_JPEG_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_JPEG_SOS, _JPEG_EOI, _JPEG_APP1 = 0xDA, 0xD9, 0xE1
# After a scan header comes entropy-coded data, in which every 0xFF is followed by 00
# (stuffing) or a restart marker D0-D7: the next other FFxx is the next marker.
_JPEG_NEXT_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")


def _jpeg_header(data: bytes) -> ImageHeader:
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
    return ImageHeader(size[0], size[1], orientation or 1, truncated, channels, sample_bytes, extra, copied=not extra)


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


def _png_header(data: bytes) -> ImageHeader:
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
            return ImageHeader(width, height, orientation or 1, truncated="PNG has no IEND chunk", **memory)
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"eXIf" and orientation is None:
            orientation = _exif_orientation(_without_exif_prefix(data[pos + 8:pos + 8 + length]))
        pos += 12 + length  # length, type, payload, CRC
        if kind == b"IEND":
            truncated = None if pos <= len(data) else "PNG IEND chunk is cut short"
            return ImageHeader(width, height, orientation or 1, truncated=truncated, **memory)
    raise ImageError(f"image is refused: PNG has more than {MAX_CONTAINER_CHUNKS} chunks")


def _without_exif_prefix(exif: bytes) -> bytes:
    """PNG eXIf and WebP EXIF hold the TIFF structure itself; some writers put JPEG's
    'Exif\\0\\0' before it anyway."""
    return exif[6:] if exif.startswith(b"Exif\x00\x00") else exif


def _bmp_header(data: bytes) -> ImageHeader:
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
    return ImageHeader(width, abs(height), channels=4 if bits == 32 else 3, extra_bytes=extra)  # negative height = top-down


def _webp_header(data: bytes) -> ImageHeader:
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
    return ImageHeader(width, height, orientation, truncated=truncated, channels=4,
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


def _tiff_header(data: bytes) -> ImageHeader:
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
    return ImageHeader(width, height, channels=channels, sample_bytes=sample_bytes, extra_bytes=extra)


def _gif_header(data: bytes) -> ImageHeader:
    if len(data) < 10:
        raise ImageError("image is truncated or corrupt (GIF header is cut short)")
    width, height = struct.unpack_from("<HH", data, 6)  # logical screen size
    return ImageHeader(width, height, channels=4, extra_bytes=4 * width * height)  # BGRA on a canvas


_READERS = {"JPEG": _jpeg_header, "PNG": _png_header, "BMP": _bmp_header,
                   "WebP": _webp_header, "TIFF": _tiff_header, "GIF": _gif_header}


def read_header(data: bytes, fmt: str) -> ImageHeader:
    """The header of `data`, a file of format `fmt` (as sniff_format names it); ImageError
    if it is cut short or asks too much of the decoder."""
    return _READERS[fmt](data)
